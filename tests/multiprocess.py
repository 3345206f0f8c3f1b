"""Run a test function in N processes and collect what each rank returns.

``run_ranks("module:function", n)`` starts n Python processes (forked from :mod:`fork_server`, which has
imported torch already, for a module named ``*_torch``; or one
``mpiexec -n n`` job, or one ``mpiexec -n 1`` job per rank, so that a rank killed by a signal ends only its own
job), each calling ``function(*args)`` from this tests folder
with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT set (under
mpiexec the rank comes from the MPI launcher). The values returned are pickled
back. If a rank fails or the job outlives its timeout, every process is killed
and the test fails with each rank's output (at a timeout, with the stacks of the ranks still running).
"""

from __future__ import annotations

import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fork_server import start_rank
from stack_dumps import request_dump

from bagua_common.job.local_launch import free_port, mpiexec
from bagua_common.job.rank_environment import threads_per_rank

TESTS = Path(__file__).resolve().parent
BENCHMARKS = TESTS.parent / "benchmarks"
"""Where the benchmarks' network harness is imported from, as ``harness`` (the partition tests' links)."""
ONE_CPU_DEVICE = {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}
"""The environment of JAX ranks with one CPU device each, in place of conftest.py's four simulated devices."""


def rank_import_path() -> str:
    """The ``PYTHONPATH`` of the tests' ranks: the test modules, this checkout's packages and the benchmarks'
    harness, whatever the cwd, before what this process was given."""
    inherited = os.environ.get("PYTHONPATH", "")
    return os.pathsep.join(p for p in [str(TESTS), str(TESTS.parent), str(BENCHMARKS), inherited] if p)


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # None: killed at the timeout
    output: str
    value: Any = None


def has_mpiexec() -> bool:
    """Whether :func:`mpiexec` finds one."""
    try:
        mpiexec()
    except RuntimeError:
        return False
    return True


def run_ranks(
    target: str,
    nprocs: int,
    *args: Any,
    launcher: Literal["python", "mpiexec", "mpiexec-per-rank"] = "python",
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    check: bool = True,
    watch: Callable[[list[int | None]], None] | None = None,
    network: Any = None,
) -> list[RankResult]:
    """Run ``target`` on ``nprocs`` ranks; with ``check``, fail unless all succeed and return values.

    ``watch``, if given, is called with the processes' exit codes (None while running) every 50 ms until all
    ended: a test reacts to a rank's end there. ``network`` (the network harness's ``Network``, of at least
    ``nprocs`` ranks) runs each rank of a per-rank launcher in its own namespace, behind its own link."""
    workdir = Path(tempfile.mkdtemp(prefix="bagua-ranks-"))
    (workdir / "args.pkl").write_bytes(pickle.dumps(args))
    base_env = {
        "OMP_NUM_THREADS": str(threads_per_rank(nprocs)),  # what bagua-launch gives its ranks
        **os.environ,
        **(env or {}),
        "WORLD_SIZE": str(nprocs),
        "MASTER_ADDR": "127.0.0.1" if network is None else network.master_addr,
        "MASTER_PORT": str(free_port()),
        "BAGUA_TEST_WORKDIR": str(workdir),
        "PYTHONPATH": rank_import_path(),
        "PYTHONUNBUFFERED": "1",
    }
    command = [sys.executable, "-m", "rank_main", target]
    logs = [open(workdir / f"rank{r}.log", "w+") for r in range(nprocs)]
    try:
        if launcher == "mpiexec":
            # Survivors of a dead rank must keep running to report their own error.
            procs = [
                subprocess.Popen(
                    [mpiexec(), "-disable-auto-cleanup", "-n", str(nprocs), *command],
                    env=base_env,
                    stdout=logs[0],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            ]
        elif launcher == "python" and target.split(":")[0].endswith("_torch"):
            procs = [
                start_rank(command[1:], {**base_env, "RANK": str(r), "LOCAL_RANK": str(r)}, Path(logs[r].name))
                for r in range(nprocs)
            ]
        else:
            prefix = [mpiexec(), "-n", "1"] if launcher == "mpiexec-per-rank" else []
            procs = [
                subprocess.Popen(
                    [*([] if network is None else ["ip", "netns", "exec", network.ns(r)]), *prefix, *command],
                    env={**base_env, "RANK": str(r), "LOCAL_RANK": str(r)},
                    stdout=logs[r],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                for r in range(nprocs)
            ]
        codes = _wait_all(procs, timeout, workdir, stop_on_failure=check, watch=watch)
        results = _collect(workdir, nprocs, codes, logs, launcher)
    finally:
        for log in logs:
            log.close()
    if check:
        failed = [r for r in results if r.returncode != 0]
        if failed:
            report = "\n".join(
                f"--- rank {r.rank}: {'timed out' if r.returncode is None else f'exit {r.returncode}'} ---\n"
                f"{r.output[-4000:]}"
                for r in results
            )
            raise AssertionError(f"{target} failed on {len(failed)} of {nprocs} ranks\n{report}")
    shutil.rmtree(workdir, ignore_errors=True)
    return results


def _wait_all(
    procs: list[Any],
    timeout: float,
    workdir: Path,
    stop_on_failure: bool,
    watch: Callable[[list[int | None]], None] | None = None,
) -> list[int | None]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if watch is not None:
            watch(codes)
        if all(c is not None for c in codes):
            return codes
        if stop_on_failure and any(c not in (None, 0) for c in codes):
            break
        time.sleep(0.05)
    else:
        _request_stacks(procs, workdir)
    codes = [p.poll() for p in procs]
    for p, c in zip(procs, codes):
        if c is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    return codes


def _request_stacks(procs: list[Any], workdir: Path) -> None:
    """At a timeout: ask each rank still running for its threads' stacks, by the pid rank_main wrote (a rank's own
    process, or while one ``mpiexec`` job runs them all, each of its ranks; an ended rank's pid may be another's)."""
    for path in sorted(workdir.glob("pid*")):
        rank = int(path.name.removeprefix("pid"))
        if (procs[0] if len(procs) == 1 else procs[rank]).poll() is None:
            request_dump(int(path.read_text()))


def _collect(workdir: Path, nprocs: int, codes: list[int | None], logs, launcher: str) -> list[RankResult]:
    results = []
    for r in range(nprocs):
        value_file = workdir / f"result{r}.pkl"
        value = pickle.loads(value_file.read_bytes()) if value_file.exists() else None
        if launcher == "mpiexec":
            # One job: its exit code is the job's, each rank's own success is its result file.
            code = codes[0] if not value_file.exists() else 0
            log = logs[0]
        else:
            code, log = codes[r], logs[r]
        log.flush()
        log.seek(0)
        results.append(RankResult(r, code, log.read(), value))
    return results

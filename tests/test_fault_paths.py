"""Fault paths: a rank that fails after a collective, and how fast every process is gone.

Two ranks; after one allreduce together rank 1 fails (``tests/fault_workers.py``) while rank 0
keeps running allreduces. Under the MPI engine (both front ends) a rank that raises must exit
at once (finalizing MPI would wait for rank 0), rank 0 must raise within the collective
timeout, and ``bagua-launch --mpi`` must name rank 1. Under ``jax.distributed`` (joined with
``bagua_jax.distributed.initialize``) every fault (raise, SIGKILL, SIGTERM, a hung peer) must
end every process within the timeout. Each case is started by plain ``mpiexec`` or plain
processes and by ``bagua-launch``, and is bounded in time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from multiprocess import TESTS, free_port, mpiexec

ROOT = TESTS.parent
TIMEOUT = 10.0  # BAGUA_COMM_TIMEOUT of the jobs (three cases wait it out; both ranks start within it)
PROMPT = 15.0  # "at once": a failed job must be gone this long after the fault (slow under load)
WORKER = str(TESTS / "fault_workers.py")
LAUNCH = [sys.executable, "-m", "bagua_launch", "--nproc-per-node", "2", "--grace", "5"]


def _env() -> dict[str, str]:
    drop = (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "XLA_FLAGS",
    )
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env |= {
        "BAGUA_COMM_TIMEOUT": str(TIMEOUT),
        "PYTHONUNBUFFERED": "1",
        "JAX_PLATFORMS": "cpu",
    }
    return env


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has exited; its parent just has not reaped it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def run_job(commands: list[list[str]], workdir: Path, rank_env: bool = False):
    """Start the commands (with RANK etc. when ``rank_env``), wait for all, kill what is left.

    Returns (exit codes, output, seconds from rank 1's fault to its pid gone, to all gone).
    """
    env, port = _env(), str(free_port())
    procs = [
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env=env
            | (
                {
                    "RANK": str(r),
                    "WORLD_SIZE": str(len(commands)),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": port,
                }
                if rank_env
                else {}
            ),
        )
        for r, command in enumerate(commands)
    ]
    fault_file, pid_file = workdir / "fault", workdir / "pid1"
    deadline = time.monotonic() + TIMEOUT + 120
    failed_gone = None
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        faulted = failed_gone is None and fault_file.exists() and fault_file.read_text()
        if faulted and not _alive(int(pid_file.read_text())):
            failed_gone = time.time() - float(fault_file.read_text())
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    output = "".join(p.communicate()[0] for p in procs)
    assert fault_file.exists(), f"rank 1 never reached its fault\n{output}"
    all_gone = time.time() - float(fault_file.read_text())
    failed_gone = all_gone if failed_gone is None else failed_gone
    label = " ".join(Path(a).name for a in commands[0] if a != str(workdir))
    print(f"\n{label}: rank 1 gone {failed_gone:.1f} s, all gone {all_gone:.1f} s after fault")
    return [p.returncode for p in procs], output, failed_gone, all_gone


# --- the MPI engine: a rank that raises ---------------------------------------------------


def mpi_job(front_end: str, tmp_path, *mpiexec_flags: str) -> list[str]:
    """Two ranks under plain mpiexec (with ``mpiexec_flags``), rank 1 raising."""
    return [mpiexec(), *mpiexec_flags, "-n", "2", sys.executable, WORKER, f"{front_end}-mpi", "raise", str(tmp_path)]


@pytest.mark.parametrize("front_end", ["jax", "torch"])
def test_mpi_raising_rank_exits_under_plain_mpiexec(tmp_path, front_end):
    [code], output, failed_gone, all_gone = run_job([mpi_job(front_end, tmp_path)], tmp_path)
    assert code != 0 and "rank 1 fails on purpose" in output
    assert failed_gone < PROMPT, f"rank 1 lived {failed_gone:.1f} s after raising"
    # mpiexec stops the job once a rank exits with an error: no one waits for the timeout.
    assert all_gone < PROMPT, f"the job lived {all_gone:.1f} s after rank 1 raised"


@pytest.mark.parametrize("front_end", ["jax", "torch"])
def test_mpi_survivor_raises_within_the_timeout(tmp_path, front_end):
    [code], output, failed_gone, all_gone = run_job([mpi_job(front_end, tmp_path, "-disable-auto-cleanup")], tmp_path)
    assert code != 0
    assert failed_gone < PROMPT, f"rank 1 lived {failed_gone:.1f} s after raising"
    assert f"did not complete within {TIMEOUT:g} s" in output, output
    assert all_gone < TIMEOUT + PROMPT, f"rank 0 lived {all_gone:.1f} s after rank 1 raised"


@pytest.mark.parametrize("front_end", ["jax", "torch"])
def test_mpi_launcher_names_the_rank_that_raised(tmp_path, front_end):
    [code], output, failed_gone, all_gone = run_job(
        [[*LAUNCH, "--mpi", WORKER, f"{front_end}-mpi", "raise", str(tmp_path)]],
        tmp_path,
    )
    assert code == 1, output
    assert failed_gone < PROMPT, f"rank 1 lived {failed_gone:.1f} s after raising"
    assert all_gone < PROMPT, f"the job lived {all_gone:.1f} s after rank 1 raised"
    summary = output[output.index("=" * 20) :]
    assert "rank 1 failed (exit code 1)" in summary, summary
    assert "rank 0: killed by SIGTERM (stopped by the launcher)" in summary, summary


# --- jax.distributed (the multi-process mesh mode) ------------------------------------------

# fault -> (what ends rank 1, the bound on every process gone after the fault)
MESH_FAULTS = {
    "raise": ("RuntimeError: rank 1 fails on purpose", PROMPT),
    "kill": (None, PROMPT),
    "term": (None, PROMPT),
    "hang": (
        None,
        TIMEOUT + PROMPT,
    ),  # rank 0's collective times out, then JAX ends rank 1
}


@pytest.mark.parametrize("fault", MESH_FAULTS)
def test_mesh_fault_ends_every_process_under_plain_processes(tmp_path, fault):
    expected, bound = MESH_FAULTS[fault]
    command = [sys.executable, WORKER, "jax-mesh", fault, str(tmp_path)]
    codes, output, failed_gone, all_gone = run_job([command, command], tmp_path, rank_env=True)
    assert all(c not in (0, None) for c in codes), (codes, output)
    assert all_gone < bound, f"processes lived {all_gone:.1f} s after the fault\n{output}"
    if expected:
        assert expected in output
    if fault == "hang":
        assert f"Timed out waiting {int(TIMEOUT * 1000)}ms" in output, output
    else:
        assert failed_gone < PROMPT


@pytest.mark.parametrize("fault", ["raise", "kill"])
def test_mesh_fault_under_the_launcher_names_rank_1(tmp_path, fault):
    [code], output, failed_gone, all_gone = run_job([[*LAUNCH, WORKER, "jax-mesh", fault, str(tmp_path)]], tmp_path)
    assert code == (1 if fault == "raise" else 128 + signal.SIGKILL), output
    assert failed_gone < PROMPT, f"rank 1 lived {failed_gone:.1f} s after the fault"
    assert all_gone < PROMPT, f"the job lived {all_gone:.1f} s after the fault\n{output}"
    summary = output[output.index("=" * 20) :]
    assert "rank 1 failed" in summary.splitlines()[0], summary

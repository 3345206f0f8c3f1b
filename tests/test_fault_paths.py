"""Fault paths of the MPI engine: a rank that raises exits at once, the job ends, the blame is right.

Two ranks on the MPI engine; after one allreduce together rank 1 raises while rank 0 waits in
a second allreduce. Rank 1 must be gone within seconds (finalizing MPI would wait for rank 0),
rank 0 must raise its timeout error within the collective timeout, and ``bagua-launch --mpi``
must name rank 1 as the failing rank. Each case is started by plain ``mpiexec`` and by
``bagua-launch --mpi``, for both front ends, and is bounded in time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multiprocess import TESTS, mpiexec

ROOT = TESTS.parent
TIMEOUT = 40.0  # BAGUA_COMM_TIMEOUT of the jobs: rank 0's wait for the rank that raised
PROMPT = 15.0  # rank 1 must be gone this long after it raised (process start-up is slow under load)

FRONT_ENDS = ["jax", "torch"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["BAGUA_COMM_TIMEOUT"] = str(TIMEOUT)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run(command: list[str], workdir: Path) -> tuple[subprocess.CompletedProcess, float, float]:
    """Run the job; return it, the seconds from rank 1's raise to its pid gone, and to the end."""
    job = subprocess.Popen(
        command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    deadline = time.monotonic() + TIMEOUT + 90
    raised_file, pid_file = workdir / "raised", workdir / "pid1"
    raiser_gone = None
    while job.poll() is None and time.monotonic() < deadline:
        if raiser_gone is None and raised_file.exists() and pid_file.exists() and raised_file.read_text():
            if not _alive(int(pid_file.read_text())):
                raiser_gone = time.time() - float(raised_file.read_text())
        time.sleep(0.05)
    if job.poll() is None:
        os.killpg(job.pid, 9)
    stdout, stderr = job.communicate()
    assert raised_file.exists(), f"rank 1 never reached its raise\n{stdout}\n{stderr}"
    job_gone = time.time() - float(raised_file.read_text())
    if raiser_gone is None:
        raiser_gone = job_gone
    print(f"{' '.join(command[:4])}: raiser gone {raiser_gone:.1f} s, job gone {job_gone:.1f} s after raise")
    return subprocess.CompletedProcess(command, job.returncode, stdout, stderr), raiser_gone, job_gone


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_raising_rank_exits_under_plain_mpiexec(tmp_path, front_end):
    script = [sys.executable, str(TESTS / "fault_workers.py"), front_end, str(tmp_path)]
    result, raiser_gone, job_gone = _run([mpiexec(), "-n", "2", *script], tmp_path)
    assert result.returncode != 0
    assert "rank 1 fails on purpose" in result.stderr + result.stdout
    assert raiser_gone < PROMPT, f"rank 1 lived {raiser_gone:.1f} s after raising"
    # mpiexec stops the job once a rank exits with an error: no one waits for the timeout.
    assert job_gone < PROMPT, f"the job lived {job_gone:.1f} s after rank 1 raised"


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_survivor_raises_within_the_timeout(tmp_path, front_end):
    script = [sys.executable, str(TESTS / "fault_workers.py"), front_end, str(tmp_path)]
    command = [mpiexec(), "-disable-auto-cleanup", "-n", "2", *script]
    result, raiser_gone, job_gone = _run(command, tmp_path)
    assert raiser_gone < PROMPT, f"rank 1 lived {raiser_gone:.1f} s after raising"
    assert "did not complete within 40 s" in result.stderr + result.stdout, result.stderr
    assert job_gone < TIMEOUT + PROMPT, f"rank 0 lived {job_gone:.1f} s after rank 1 raised"


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_launcher_names_the_rank_that_raised(tmp_path, front_end):
    script = [str(TESTS / "fault_workers.py"), front_end, str(tmp_path)]
    command = [sys.executable, "-m", "bagua_launch", "--nproc-per-node", "2", "--mpi", "--grace", "5", *script]
    result, raiser_gone, job_gone = _run(command, tmp_path)
    assert result.returncode == 1, result.stderr
    assert raiser_gone < PROMPT, f"rank 1 lived {raiser_gone:.1f} s after raising"
    assert job_gone < PROMPT, f"the job lived {job_gone:.1f} s after rank 1 raised"
    summary = result.stderr[result.stderr.index("====") :]
    assert "rank 1 failed (exit code 1)" in summary, summary
    assert "rank 0: killed by SIGTERM (stopped by the launcher)" in summary, summary

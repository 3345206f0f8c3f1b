"""A gloo job exits cleanly: torch.distributed holds none of a collective's tensors once ``wait()`` returns.

The defect guarded against: a gloo worker thread that drops the last reference to a finished
collective takes the GIL to release its tensors' Python objects; if the interpreter is already
finalizing, Python ends that thread inside a C++ destructor and the rank aborts at exit with
"terminate called without an active exception". ``clean_exit_workers_torch`` holds the ranks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from multiprocess import run_ranks

TESTS = Path(__file__).resolve().parent
JOBS = 3  # each exit of the old code aborted about half the time here, so 3 jobs (6 exits) catch it


def test_torch_holds_no_tensor_of_a_collective_after_wait():
    """Every primitive, sync and async, and an allreduce waited while a later barrier is pending."""
    held = run_ranks("clean_exit_workers_torch:held_after_wait", 2, timeout=90)
    for rank in held:
        for name, (handed, still_held) in rank.value.items():
            assert handed > 0 or name.startswith("barrier"), (rank.rank, name)  # the spy saw the call
            assert still_held == 0, (rank.rank, name, handed, still_held)


def test_gloo_job_exits_with_status_zero_after_its_last_collective():
    """bagua-launch (no --mpi) runs the 2-rank job ``JOBS`` times; every rank must exit with 0."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS.parent), env.get("PYTHONPATH", "")) if p)
    command = [sys.executable, "-m", "bagua_launch", "--nproc-per-node", "2", "--timeout", "60"]
    for _ in range(JOBS):
        job = subprocess.run(
            [*command, str(TESTS / "clean_exit_workers_torch.py")], capture_output=True, text=True, env=env, timeout=90
        )
        assert job.returncode == 0, job.stdout + job.stderr
        assert "terminate called" not in job.stdout + job.stderr

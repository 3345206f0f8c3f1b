"""The end of a fault-tolerant job: a process asking to join a finished job exits cleanly, and the launcher's slot
starts no replacement for a rank that ends after the job finished (before, both waited to join a job that was gone,
and the launcher never returned)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from multiprocess import free_port

from bagua_common.fault_tolerance import (
    FaultToleranceSettings,
    JobFinished,
    KVClient,
    KVServer,
    Membership,
    job_secret,
)
from bagua_common.fault_tolerance.node_directory import FINISHED, job_finished
from bagua_common.fault_tolerance.settings import ENV_DIRECTORY, ENV_JOIN

FAST = FaultToleranceSettings(heartbeat_period=0.05, dead_after=0.6, quorum_timeout=3.0)


@pytest.fixture
def directory(monkeypatch):
    """A node's launcher directory (``bagua-launch --fault-tolerant`` hosts one), named in the environment."""
    server = KVServer("127.0.0.1", secret=job_secret())
    monkeypatch.setenv(ENV_DIRECTORY, f"127.0.0.1:{server.port}")
    yield server
    server.close()


def start(n: int) -> list[Membership]:
    """``n`` members forming epoch 0 together (each on a thread, as each rank's process would)."""
    port, made = free_port(), {}
    threads = [
        threading.Thread(target=lambda r=r: made.update({r: Membership.start(FAST, r, n, "127.0.0.1", port, 20)}))
        for r in range(n)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return [made[r] for r in range(n)]


def test_a_joiner_of_a_finished_job_exits_with_status_0_at_a_member_or_at_the_launchers_directory(
    directory, monkeypatch
):
    group = start(2)
    try:
        for transaction in (1, 2):
            votes = [threading.Thread(target=m.commit, args=(m.epoch, transaction)) for m in group]
            for vote in votes:
                vote.start()
            for vote in votes:
                vote.join(10)
        port = group[0].epoch.coordinator.port
        assert not job_finished()
        for member in group:
            member.finished()
        assert job_finished()

        monkeypatch.delenv(ENV_DIRECTORY)  # asked at a member's own store
        with pytest.raises(JobFinished) as ended:
            Membership.join(FAST, "127.0.0.1", port, timeout=5)
        assert ended.value.code == 0 and "2 steps committed" in ended.value.message
    finally:
        for member in reversed(group):  # the members leave; the launcher's directory stays as long as the job
            member.close()

    monkeypatch.setenv(ENV_DIRECTORY, f"127.0.0.1:{directory.port}")
    started = time.monotonic()
    with pytest.raises(JobFinished):
        Membership.join(FAST, "127.0.0.1", port, timeout=5)
    assert time.monotonic() - started < 2  # at once, not after the join's timeout


def run_slot(folder, exit_status: int) -> tuple[int, int, str]:
    """The launcher's slot (``python -m bagua_launch.replacements``) running a rank that counts its starts in a file
    and exits with ``exit_status``; return the slot's status, the rank's starts and the slot's stderr."""
    folder.mkdir()
    counter = folder / "starts"
    rank = f"import sys; open({str(counter)!r}, 'a').write('x'); sys.exit({exit_status})"
    environment = {k: v for k, v in os.environ.items() if k != ENV_JOIN}
    slot = subprocess.run(
        [sys.executable, "-m", "bagua_launch.replacements", sys.executable, "-c", rank],
        env={**environment, "BAGUA_FT_REPLACEMENTS": "1", "RANK": "3"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return slot.returncode, len(counter.read_text()), slot.stderr


def test_the_launchers_slot_replaces_a_dead_rank_only_while_the_job_runs(directory, tmp_path):
    code, starts, stderr = run_slot(tmp_path / "running", 3)
    assert (code, starts) == (3, 2), stderr  # replaced once (BAGUA_FT_REPLACEMENTS=1), then the agent's policy

    client = KVClient("127.0.0.1", directory.port, 5.0, secret=job_secret())
    client.set(FINISHED, "40")
    client.close()
    code, starts, stderr = run_slot(tmp_path / "finished", 3)
    assert (code, starts) == (0, 1), stderr
    assert "rank 3 ended (exit code 3) after the job finished: not replaced" in stderr

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
from bagua_common.fault_tolerance.node_directory import CURRENT, FINISHED, STOPPED, job_finished
from bagua_common.fault_tolerance.settings import ENV_DIRECTORY, ENV_JOIN

FAST = FaultToleranceSettings(heartbeat_period=0.05, dead_after=0.6, quorum_timeout=3.0)


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
    launcher_directory, monkeypatch
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

    monkeypatch.setenv(ENV_DIRECTORY, f"127.0.0.1:{launcher_directory.port}")
    started = time.monotonic()
    with pytest.raises(JobFinished):
        Membership.join(FAST, "127.0.0.1", port, timeout=5)
    assert time.monotonic() - started < 2  # at once, not after the join's timeout


def run_slot(folder, exit_status: int, replacements: int = 2, admitted: bool = False) -> tuple[int, str, str]:
    """The launcher's slot (``python -m bagua_launch.replacements``, starting at most ``replacements`` replacements)
    running a rank that records each start in a file (``j`` when started to join the running job, ``r`` when started
    as itself), says it was admitted into the job when ``admitted`` (as a joiner's membership does), and exits with
    ``exit_status``; return the slot's status, the rank's starts and the slot's stderr."""
    folder.mkdir()
    starts = folder / "starts"
    rank = (
        "import os, sys; from bagua_common.fault_tolerance import FaultToleranceSettings; "
        "from bagua_common.fault_tolerance.node_directory import tell_admitted; "
        f"joiner = os.environ.get({ENV_JOIN!r}) == '1'; open({str(starts)!r}, 'a').write('j' if joiner else 'r'); "
        f"joiner and {admitted} and tell_admitted(FaultToleranceSettings.from_environment()); sys.exit({exit_status})"
    )
    environment = {k: v for k, v in os.environ.items() if k != ENV_JOIN}
    slot = subprocess.run(
        [sys.executable, "-m", "bagua_launch.replacements", sys.executable, "-c", rank],
        env={**environment, "BAGUA_FT_REPLACEMENTS": str(replacements), "RANK": "3"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return slot.returncode, starts.read_text(), slot.stderr


def tell_directory(directory: KVServer, key: str, value: str) -> None:
    client = KVClient("127.0.0.1", directory.port, 5.0, secret=job_secret())
    client.set(key, value)
    client.close()


def test_the_launchers_slot_restarts_a_rank_lost_before_the_job_formed_as_itself_then_replaces_it_by_a_joiner(
    launcher_directory, tmp_path
):
    code, starts, stderr = run_slot(tmp_path / "forming", 3)
    assert (code, starts) == (3, "rrr"), stderr  # twice again as rank 3 (BAGUA_FT_REPLACEMENTS=2), then the agent's
    assert "rank 3 ended (exit code 3) after" in stderr and "starting it again: the job had not formed yet" in stderr

    tell_directory(launcher_directory, CURRENT, '{"epoch": 0, "host": "127.0.0.1", "port": 1}')
    code, starts, stderr = run_slot(tmp_path / "running", 3)
    assert (code, starts) == (3, "rjj"), stderr
    assert "starting a replacement that joins the running job" in stderr


def test_the_launchers_slot_ends_after_three_starts_in_a_row_that_never_took_part_in_the_job(
    launcher_directory, tmp_path
):
    code, starts, stderr = run_slot(tmp_path / "forming", 3, replacements=100)
    assert (code, starts) == (3, "rrr"), stderr  # the job never formed: the third start as itself ends the slot
    assert "ended (exit code 3) before it took part in the job, 3 times in a row: ending the slot" in stderr

    tell_directory(launcher_directory, CURRENT, '{"epoch": 0, "host": "127.0.0.1", "port": 1}')
    code, starts, stderr = run_slot(tmp_path / "never-admitted", 3, replacements=100)
    assert (code, starts) == (3, "rjjj"), stderr  # the rank took part; three replacements the job never admitted
    assert "ended (exit code 3) before it took part in the job, 3 times in a row: ending the slot" in stderr

    code, starts, stderr = run_slot(tmp_path / "admitted", 3, replacements=5, admitted=True)
    assert (code, starts) == (3, "rjjjjj"), stderr  # each admitted before it ended: replaced until none is left
    assert "before it took part" not in stderr


def test_the_launchers_slot_replaces_no_rank_after_the_job_finished(launcher_directory, tmp_path):
    tell_directory(launcher_directory, CURRENT, '{"epoch": 0, "host": "127.0.0.1", "port": 1}')
    tell_directory(launcher_directory, FINISHED, "40")
    code, starts, stderr = run_slot(tmp_path / "finished", 3)
    assert (code, starts) == (0, "r"), stderr
    assert "rank 3 ended (exit code 3) after the job finished: not replaced" in stderr


def test_the_launchers_slot_replaces_no_rank_after_the_members_stopped_the_job(launcher_directory, tmp_path):
    # NoProgress: a replacement would wait quorum_timeout for members that are gone, then end the slot anyway.
    tell_directory(launcher_directory, CURRENT, '{"epoch": 0, "host": "127.0.0.1", "port": 1}')
    tell_directory(launcher_directory, STOPPED, "NoProgress")
    code, starts, stderr = run_slot(tmp_path / "stopped", 1)
    assert (code, starts) == (1, "r"), stderr
    assert "rank 3 ended (exit code 1) after the members stopped the job" in stderr and "not replaced" in stderr

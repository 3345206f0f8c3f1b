"""run_group (tests/process_group.py): a timed-out run leaves no process of its group behind.

The command stands for Lightning's launcher: its "rank 0" starts a "rank 1" as its own child
(same process group, no death signal), which writes its pid to a file and then sleeps or
finishes. ``subprocess.run`` with a timeout kills rank 0 alone and rank 1 runs on.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_group import run_group

LEADER = """
import subprocess, sys, time
rank_1 = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(float(sys.argv[2])); "
rank_1 += "open(sys.argv[1] + '.done', 'w').close()"
subprocess.Popen([sys.executable, "-c", rank_1, sys.argv[1], sys.argv[2]])
time.sleep(float(sys.argv[3]))
"""
TIMEOUT_S = 3.0


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _pid(path: Path) -> int:
    deadline = time.monotonic() + 30
    while not path.exists() or not path.read_text():
        assert time.monotonic() < deadline, "rank 1 never started"
        time.sleep(0.05)
    return int(path.read_text())


@pytest.mark.parametrize("hangs", ["rank 0", "rank 1"])
def test_a_timed_out_run_kills_every_process_of_its_group(tmp_path, hangs):
    pid_file = tmp_path / "rank1.pid"
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_group([sys.executable, "-c", LEADER, str(pid_file), "60", "60" if hangs == "rank 0" else "0"], TIMEOUT_S)
    assert time.monotonic() - started < TIMEOUT_S + 10
    assert not _running(_pid(pid_file)), "rank 1 outlived the run"


def test_a_run_waits_for_the_processes_its_command_started(tmp_path):
    """Rank 0 exits at once, rank 1 a second later: the run ends when rank 1 has, its file written."""
    pid_file = tmp_path / "rank1.pid"
    done = run_group([sys.executable, "-c", LEADER, str(pid_file), "1", "0"], timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "rank1.pid.done").exists()

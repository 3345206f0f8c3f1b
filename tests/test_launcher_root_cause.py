"""Which rank the launcher names when a killed rank's peer fails right after it (bagua_launch.root_cause).

The job: rank 1 kills itself with SIGKILL; rank 0 waits until rank 1 is dead, then exits 1 at
once, as a rank does whose peer vanished. Rank 1 died first, by construction, and the launcher
must name it (exit status 137) whichever exit its waiter threads report first. "late" makes
rank 1's waiter report 1 s after it reaped the rank, as a starved thread on a loaded machine
does (the order that named rank 0 in CI); "prompt" leaves the threads alone.
"""

from __future__ import annotations

import re
import signal
import sys
import textwrap
import time

import pytest

from bagua_common.job.local_launch import mpiexec
from bagua_launch.root_cause import SETTLE_S, root_cause
from bagua_launch.supervisor import Config, Launcher
from bagua_launch.wrapper_reports import WrapperReports

RANKS = """
import os, signal, sys, time
from pathlib import Path

pid_file = Path(sys.argv[1])
if os.environ["RANK"] == "1":
    pid_file.with_suffix(".tmp").write_text(str(os.getpid()))
    pid_file.with_suffix(".tmp").rename(pid_file)
    os.kill(os.getpid(), signal.SIGKILL)
while not pid_file.exists():
    time.sleep(0.002)
stat = Path(f"/proc/{pid_file.read_text()}/stat")
while True:  # until rank 1 is a zombie or reaped
    try:
        if stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            break
    except OSError:
        break
    time.sleep(0.001)
print("rank 1 is dead", flush=True)
sys.exit(1)
"""


# Under --mpi the launcher learns the ranks' ends from their wrappers' reports (bagua_launch.wrapper_reports). Rank 1
# leaves a process holding its output open, as a worker process or a server it started does for a while: its wrapper
# reads that output to the end (1 s here) after the rank ended, and rank 0's wrapper reports first.
HELD_OUTPUT = (
    """
import os, subprocess
if os.environ["RANK"] == "1":
    subprocess.Popen(["sleep", "1"])
"""
    + RANKS
)


# The launcher runs inside pytest here, where earlier tests loaded JAX, which warns at the fork that starts each
# rank (preexec_fn sets its parent-death signal); bagua-launch's own process never imports JAX.
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
@pytest.mark.parametrize("notice", ["prompt", "late", "mpi held output"])
def test_a_peer_failing_right_after_a_killed_rank_is_not_named(tmp_path, monkeypatch, capsys, notice):
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent(HELD_OUTPUT if notice.startswith("mpi") else RANKS))
    if notice == "late":
        report = Launcher._wait

        def late_for_rank_1(self: Launcher, child) -> None:
            if child.rank == 1:
                child.proc.wait()
                time.sleep(1.0)
            report(self, child)

        monkeypatch.setattr(Launcher, "_wait", late_for_rank_1)
    config = Config(
        nproc_per_node=2,
        nnodes=1,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=29500,
        command=[sys.executable, str(script), str(tmp_path / "rank1.pid")],
        mode="script",
        mpi=notice.startswith("mpi"),
        mpiexec=mpiexec() if notice.startswith("mpi") else None,
        mpi_args=[],
        grace=5.0,
        timeout=300.0,
        tail_lines=3,
    )
    code = Launcher(config).run()
    err = capsys.readouterr().err
    assert code == 128 + signal.SIGKILL, err
    summary = err[err.index("=" * 20) :]
    assert "rank 1 failed (killed by SIGKILL)" in summary.splitlines()[0], summary
    # It failed on its own, unless a loaded machine kept it from noticing rank 1's death before the launcher's stop
    # (under MPI the stop may also come before its wrapper's stamp, or mpiexec may kill that wrapper first).
    stopped = r"exit code 1 \(stopped by the launcher\)|gone without an exit status|" if config.mpi else ""
    assert re.search(
        rf"^rank 0: ({stopped}exit code 1|killed by SIGTERM \(stopped by the launcher\))$", summary, re.M
    ), summary


def test_the_rule_prefers_a_rank_killed_from_outside_then_the_first_noticed():
    assert root_cause([(0, 1), (1, -9)]) == (1, -9)
    assert root_cause([(3, 2), (0, 1)]) == (3, 2)
    assert root_cause([(2, 1), (1, -15), (0, -9)]) == (1, -15)
    assert root_cause([(2, 1), (1, None)]) == (1, None)  # MPI: a wrapper gone without a status was killed
    # A peer's own abort or crash follows from the loss of a rank as its exit code does: first noticed.
    assert root_cause([(0, 1), (1, -signal.SIGABRT)]) == (0, 1)
    assert root_cause([(1, -signal.SIGSEGV), (0, -signal.SIGKILL)]) == (0, -signal.SIGKILL)
    with pytest.raises(ValueError, match="no failures"):
        root_cause([])


def test_mpi_reports_weigh_the_failures_within_the_settle_time():
    """Under --mpi each wrapper stamps its rank's end; a peer's exit stamped first does not take the blame. A rank
    SIGKILLed while its wrapper lives counts until the stop (its wrapper's stamp may come late); a wrapper gone
    (mpiexec kills wrappers) or a relayed SIGTERM stamped later is not the cause of rank 0's exit."""
    reports = WrapperReports(3)
    try:
        t = time.time()
        reports.statuses = {0: {"code": 1, "time": t}, 1: {"code": -9, "time": t + SETTLE_S / 2}, 2: {"code": 0}}
        assert reports.failure(None) == (1, -9)
        reports.statuses[1]["time"] = t + 3 * SETTLE_S
        assert reports.failure(None) == (1, -9)
        assert reports.failure(t + 2 * SETTLE_S) == (0, 1)  # after the launcher's stop: its own kill
        for later in (None, -signal.SIGTERM):
            reports.statuses[1]["code"] = later
            assert reports.failure(None) == (0, 1)
    finally:
        reports.remove()

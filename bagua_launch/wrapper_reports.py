"""What the ``rank_env`` wrappers of an MPI job report: their pids and exit statuses, through files.

Under ``--mpi``, ``mpiexec`` starts the ranks, so the launcher learns about them only from what
each wrapper writes into a private folder (``$BAGUA_LAUNCH_STATUS_DIR``): ``rank<N>.pid`` once
its script started (the wrapper's pid and the script's process group) and ``rank<N>.json`` when
it ended (the return code and the time). A wrapper of this node gone without writing its
status was killed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from bagua_launch.root_cause import SETTLE_S, root_cause


class WrapperReports:
    """The reports of the ``world`` ranks of one MPI job, read from a folder of its own."""

    def __init__(self, world: int) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="bagua-launch-"))
        self.world = world
        self.statuses: dict[int, dict] = {}  # rank -> {"code": return code or None, "time": when}
        self.pids: dict[int, dict[str, int]] = {}  # rank -> its wrapper's pid and its script's group
        self.lost: list[int] = []  # ranks killed together, none known to be first

    def remove(self) -> None:
        """Delete the folder (the job is over)."""
        shutil.rmtree(self.folder, ignore_errors=True)

    def pid_files(self) -> dict[int, dict[str, int]]:
        """{rank: {"pid": wrapper pid, "child": the script's process group}} of this node's ranks."""
        if len(self.pids) < self.world:
            for path in self.folder.glob("rank*.pid"):
                try:
                    rank = int(path.stem[4:])
                    if rank not in self.pids:
                        info = json.loads(path.read_text())
                        self.pids[rank] = {"pid": int(info["pid"]), "child": int(info["child"])}
                except (OSError, ValueError, KeyError, TypeError):
                    pass
        return self.pids

    def running_wrappers(self) -> list[int] | None:
        """The pids of the wrappers still running, or None unless every rank is known here."""
        self.poll_statuses()
        known = self.pid_files()
        if len(known) < self.world:
            return None
        return [info["pid"] for rank, info in known.items() if rank not in self.statuses]

    def poll_statuses(self) -> None:
        """Read the exit statuses the wrappers wrote."""
        for path in self.folder.glob("rank*.json"):
            try:
                rank = int(path.stem[4:])
                if rank in self.statuses:
                    continue
                self.statuses[rank] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue

    def check_gone(self) -> None:
        """A wrapper of this node gone without writing its exit status (killed) is a failure too.

        Hydra then kills the other ranks at once; when several are found gone together, which
        one went first is unknown (:meth:`failure` says so in :attr:`lost`).
        """
        now = time.time()
        for rank, info in self.pid_files().items():
            if rank in self.statuses:
                continue
            try:
                os.kill(info["pid"], 0)
                continue
            except PermissionError:
                continue
            except ProcessLookupError:
                pass
            self.poll_statuses()  # it writes its status just before it exits
            self.statuses.setdefault(rank, {"code": None, "time": now})

    def ended_unreported(self) -> bool:
        """Whether a rank of this node has ended whose wrapper, still running, has not written its status yet.

        A loaded machine may run a peer's wrapper, and the peer's failure, before it. Only where
        ``/proc`` tells whether a process has ended (a zombie or gone); elsewhere False.
        """
        if not os.path.exists("/proc/self/stat"):
            return False
        for rank, info in self.pid_files().items():
            if rank in self.statuses or not _ended(info["child"]):
                continue
            try:
                os.kill(info["pid"], 0)
                return True
            except ProcessLookupError:
                continue  # the wrapper is gone too: check_gone counts it
            except PermissionError:
                return True
        return False

    def failure(self, stopped_at: float | None) -> tuple[int, int | None] | None:
        """The rank whose failure before ``stopped_at`` ended the job and its return code; None if none (or unknown).

        Of the ranks that failed within :data:`~bagua_launch.root_cause.SETTLE_S` of the first, as
        :func:`~bagua_launch.root_cause.root_cause` chooses, and the ranks SIGKILLed before
        ``stopped_at`` whose wrappers reported it: neither mpiexec (which kills the wrappers) nor the
        launcher before its stop kills a rank so, the OOM killer or a user does, and then its
        wrapper's stamp may come late on a loaded machine, after the failures it caused.
        """
        bad = sorted(
            (s["time"], r, s.get("code"))
            for r, s in self.statuses.items()
            if s.get("code") != 0 and (stopped_at is None or s["time"] <= stopped_at)
        )
        if not bad:
            return None
        rank, code = root_cause([(r, c) for t, r, c in bad if t <= bad[0][0] + SETTLE_S or c == -signal.SIGKILL])
        together = [r for t, r, c in bad if c is None and t == self.statuses[rank]["time"]]
        if code is None and len(together) > 1:
            self.lost = sorted(together)
            return None
        return rank, code


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: a zombie, or gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
    except OSError:
        return True

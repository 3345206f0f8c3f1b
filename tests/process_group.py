"""Run a command and every process it starts as one process group, leaving none behind.

``subprocess.run(..., timeout=...)`` kills only the process it started: the ranks a launcher
such as Lightning's starts as its own children (no death signal, same process group) outlive
it, stuck in a collective. :func:`run_group` waits for the whole group and, at its timeout,
kills the whole group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

_POLL_S = 0.05


def group_running(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies have ended: a container's init may never reap them)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def run_group(command: list[str], timeout: float, **popen: Any) -> subprocess.CompletedProcess:
    """Run ``command`` in a session of its own until it and every process of its group have ended.

    Returns what ``subprocess.run(command, capture_output=True, text=True)`` would. At ``timeout``
    seconds it kills the whole group with SIGKILL and raises ``subprocess.TimeoutExpired`` with
    the output so far. ``popen`` goes to ``subprocess.Popen`` (``env``, ``cwd``).
    """
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, text=True, start_new_session=True, **popen)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        while proc.poll() is not None and group_running(proc.pid) and time.monotonic() < deadline:
            time.sleep(_POLL_S)  # the leader is done; the processes it started may still be finishing
        timed_out = proc.poll() is None or group_running(proc.pid)
        if timed_out:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            while group_running(proc.pid):  # SIGKILL takes effect when each process is next scheduled
                time.sleep(_POLL_S)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, stdout, stderr)
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)

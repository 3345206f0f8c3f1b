"""What starting ranks on this machine needs: a free loopback port and the ``mpiexec`` to use (and its kind)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
    """A TCP port free on the loopback interface now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mpiexec() -> str:
    """The mpiexec beside this interpreter (the mpich wheel's), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec found; pip install mpich")
    return found


def is_hydra(mpiexec: str) -> bool:
    """Whether ``mpiexec`` is MPICH's Hydra (Intel MPI's too)."""
    try:
        probe = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return "HYDRA" in (probe.stdout + probe.stderr).upper()

"""What starting ranks on this machine needs: a free loopback port and the ``mpiexec`` to use (and its kind)."""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
from pathlib import Path

_LOWEST_PORT = 10000  # free_port's choice: from here to the first port the kernel hands out to outgoing connections


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port free on ``address`` now, below the kernel's range of ports for outgoing connections: a port from
    that range can be taken, before the server meant for it binds it, by a connection some process opens meanwhile
    (a rank retrying to reach a store that is not up yet opens many), and the server then fails to start with
    "Address already in use". Falls back to a port the kernel chooses when none below is free."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        first_outgoing = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first_outgoing = _LOWEST_PORT
    chooser = random.SystemRandom()  # not the random module's state, which a program may have seeded alike everywhere
    below = range(_LOWEST_PORT, first_outgoing)
    candidates = [chooser.choice(below) for _ in range(64)] if below else []
    for port in [*candidates, 0]:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise OSError(f"no free TCP port on {address}")


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

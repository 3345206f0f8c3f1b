"""What the native engines' rendezvous need of the job's key-value store (``mpi_rendezvous``, ``tcp_rendezvous``),
and the waits they make on it: for a key, and for every rank of a build to arrive."""

from __future__ import annotations

import threading
import time
from typing import Protocol

__all__ = ["BuildIncomplete", "KeyValueStore", "meet", "wait_for"]

_POLL_SECONDS = 0.05  # how often a wait for the store looks at whether the build was abandoned


class KeyValueStore(Protocol):
    """A store only the job's processes can write: ``bagua_common.fault_tolerance.StoreClient`` is one."""

    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key``."""

    def get(self, key: str, wait: float = 0.0) -> bytes | None:
        """The value of ``key``, waiting up to ``wait`` seconds for it to appear; None if it did not."""


class BuildIncomplete(ConnectionError):
    """The communicator could not be built with these ranks: one did not reach the build within its timeout, or the
    build was abandoned (the members it was for changed). Nothing is connected; the members may build again under
    another prefix."""


def wait_for(store: KeyValueStore, key: str, deadline: float, abandoned: threading.Event | None = None) -> str:
    """The value a rank of a build set under ``key``, waiting for it until ``deadline`` (``time.monotonic``); raises
    :class:`BuildIncomplete` past it, or as soon as ``abandoned`` is set."""
    while True:
        left = deadline - time.monotonic()
        value = store.get(key, wait=max(0.0, left if abandoned is None else min(left, _POLL_SECONDS)))
        if value is not None:
            return value.decode() if isinstance(value, bytes) else value
        if abandoned is not None and abandoned.is_set():
            raise BuildIncomplete(f"the build was abandoned while waiting for {key!r} in the job's store")
        if left <= 0:
            raise BuildIncomplete(f"nothing under {key!r} in the job's store before the build's timeout")


def meet(
    store: KeyValueStore, prefix: str, rank: int, size: int, timeout: float, abandoned: threading.Event | None = None
) -> None:
    """Return once every one of ``size`` ranks, each calling it with its ``rank`` and the same unused ``prefix``, has
    arrived: for a build that cannot be abandoned once begun (MPI's shrink), so that none begins it for a rank that
    never comes. Raises :class:`BuildIncomplete` after ``timeout`` seconds, or as soon as ``abandoned`` is set."""
    store.set(f"{prefix}arrived/{rank}", "1")
    deadline = time.monotonic() + timeout
    for other in range(size):
        wait_for(store, f"{prefix}arrived/{other}", deadline, abandoned)

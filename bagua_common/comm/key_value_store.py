"""What the native engines' rendezvous need of the job's key-value store (``mpi_rendezvous``, ``tcp_rendezvous``)."""

from __future__ import annotations

from typing import Protocol

__all__ = ["KeyValueStore"]


class KeyValueStore(Protocol):
    """A store only the job's processes can write: ``bagua_common.fault_tolerance.StoreClient`` is one."""

    def set(self, key: str, value: bytes | str) -> None:
        """Store ``value`` under ``key``."""

    def get(self, key: str, wait: float = 0.0) -> bytes | None:
        """The value of ``key``, waiting up to ``wait`` seconds for it to appear; None if it did not."""

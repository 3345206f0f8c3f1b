"""Checking that the members' replicated state is bit-identical: one digest per part, compared across members.

A front end hashes each *part* of its replicated state (``"parameters"``, ``"optimizer"``,
``"algorithm"``, ``"position"``) with :class:`ReplicaDigest`, gathers every member's
:meth:`ReplicaDigest.digest` (32 bytes per part) over its communicator, and calls
:func:`check_digests`, which raises the same :class:`~bagua_common.fault_tolerance.ReplicaMismatch`
on every member when any part differs.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence

import numpy as np

from bagua_common.fault_tolerance.errors import ReplicaMismatch

__all__ = ["DIGEST_BYTES", "ReplicaDigest", "check_digests"]

DIGEST_BYTES = 32
"""The bytes of one part's digest (BLAKE2b-256)."""


class ReplicaDigest:
    """The digests of named parts of the replicated state, each over raw bytes added in a fixed order."""

    def __init__(self, parts: Sequence[str]):
        self.parts = tuple(parts)
        self._hashes = {part: hashlib.blake2b(digest_size=DIGEST_BYTES) for part in self.parts}

    def add(self, part: str, data: bytes | memoryview | np.ndarray) -> None:
        """Hash ``data``'s bytes into ``part`` (an array's dtype and shape count too, not only its bytes)."""
        digest = self._hashes[part]
        if isinstance(data, np.ndarray):
            digest.update(f"{data.dtype.str}{data.shape}".encode())
            data = np.ascontiguousarray(data).view(np.uint8).reshape(-1).data
        digest.update(data)

    def digest(self) -> np.ndarray:
        """All parts' digests as one uint8 array of ``len(parts) * 32`` bytes (what the members gather)."""
        return np.frombuffer(b"".join(self._hashes[p].digest() for p in self.parts), dtype=np.uint8).copy()


def check_digests(parts: Sequence[str], gathered: np.ndarray, what: str = "after a check") -> None:
    """Raise :class:`ReplicaMismatch` unless every row of ``gathered`` (one :meth:`ReplicaDigest.digest` per rank,
    in rank order) is the same; the message names each differing part and the ranks that differ from the
    majority's value."""
    rows = np.asarray(gathered, dtype=np.uint8).reshape(len(gathered), len(parts), DIGEST_BYTES)
    problems = []
    for index, part in enumerate(parts):
        values = [bytes(row[index]) for row in rows]
        if len(set(values)) > 1:
            majority, _ = Counter(values).most_common(1)[0]
            odd = [rank for rank, value in enumerate(values) if value != majority]
            problems.append(f"{part} differs on rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))}")
    if problems:
        raise ReplicaMismatch(f"the replicas are not bit-identical {what}: {'; '.join(problems)}")

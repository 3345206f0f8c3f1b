"""Low-precision decentralized training's invariant after its members change, in both front ends: each rank's
copies of its neighbours' weights are, bit for bit, the weights those neighbours hold as their own."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np


def ring_digests(held: Mapping[str, Iterable[Any]]) -> dict[str, str]:
    """The SHA-256 of a rank's ``weights``, ``left`` and ``right`` copies, each its buckets (tensors or arrays)."""
    return {k: hashlib.sha256(b"".join(np.asarray(b).tobytes() for b in held[k])).hexdigest() for k in held}


def assert_ring_copies_are_the_neighbours_weights(records: Iterable[Mapping[str, Any]]) -> None:
    """``records``: each member's at the end of a job, with its ``rank`` (its place on the ring) and its ``copies``
    (:func:`ring_digests`)."""
    ring = {record["rank"]: record["copies"] for record in records}
    n = len(ring)
    assert sorted(ring) == list(range(n)), sorted(ring)
    for rank, held in ring.items():
        assert held["left"] == ring[(rank - 1) % n]["weights"], f"rank {rank}'s copy of its left neighbour's"
        assert held["right"] == ring[(rank + 1) % n]["weights"], f"rank {rank}'s copy of its right neighbour's"

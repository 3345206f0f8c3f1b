"""Who talks to whom: the two levels of a hierarchical job, the ``shift_one`` pairing, the ring.

Both front ends take their peers from here, so a JAX rank and a torch rank of the same job
size pair up identically and reject the same sizes with the same message.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import numpy as np

PeerSelectionMode = Literal["all", "shift_one"]
PEER_SELECTION_MODES: tuple[PeerSelectionMode, ...] = ("all", "shift_one")


def check_peer_selection_mode(mode: Any, algorithm: str) -> None:
    """Raise a ValueError naming ``mode`` unless it is one of :data:`PEER_SELECTION_MODES`."""
    if mode not in PEER_SELECTION_MODES:
        raise ValueError(f"{algorithm}: peer_selection_mode must be one of {PEER_SELECTION_MODES}, got {mode!r}")


def check_two_levels(intra_size: int, inter_size: int, world_size: int, algorithm: str) -> None:
    """Raise a ValueError unless ``intra_size`` x ``inter_size`` ranks make the world."""
    if intra_size * inter_size != world_size:
        raise ValueError(
            f"{algorithm}: intra ({intra_size} ranks) x inter ({inter_size} ranks) "
            f"must equal world ({world_size} ranks)"
        )


def check_pairable(size: int, algorithm: str, across_nodes: bool = False) -> None:
    """Raise a ValueError if ``shift_one`` cannot pair ``size`` ranks (or nodes): odd and > 1."""
    if size % 2 and size != 1:
        group = "nodes (the inter-node group of a hierarchical run)" if across_nodes else "ranks"
        remedy = ", an even count, or hierarchical=False" if across_nodes else " or an even count"
        raise ValueError(
            f"{algorithm}: peer_selection_mode='shift_one' pairs {group} two by two "
            f"and needs an even number of them, got {size}; use peer_selection_mode='all'{remedy}"
        )


def shift_one_schedule(size: int) -> np.ndarray:
    """The ``shift_one`` peers as an int32 table: row ``t`` holds every rank's peer in round ``t``.

    With ``h = size / 2`` there are ``h`` rows (round ``t`` uses row ``t mod h``): rank ``r < h``
    takes ``(t + r) mod h + h``, the others ``(r - h - t) mod h``, so every rank has exactly
    one peer per round and meets every rank of the other half once per cycle. A ``size`` below 2
    or odd raises a ValueError.
    """
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 2:
        raise ValueError(f"shift_one needs at least 2 ranks to pair, got {size!r}")
    check_pairable(int(size), "shift_one")
    half = int(size) // 2
    shift = np.arange(half)[:, None]
    rank = np.arange(size)[None, :]
    return np.where(rank < half, (shift + rank) % half + half, (rank - half - shift) % half).astype(np.int32)


def ring_neighbours(rank: int, size: int) -> tuple[int, int]:
    """``(left, right)`` of ``rank`` on the ring ``0 -> 1 -> ... -> size - 1 -> 0``."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in 0..{size - 1}")
    return (rank - 1) % size, (rank + 1) % size


def ring_peers(rank: int, size: int) -> list[int]:
    """The ranks ``rank`` exchanges with on a ring of ``size >= 2``: its left and right neighbours, or with two ranks
    the other one, once (both neighbours are that rank)."""
    left, right = ring_neighbours(rank, size)
    return [left] if size == 2 else [left, right]


class Communicators(NamedTuple):
    """The communicators of a run: everyone, and for hierarchical algorithms the two levels.

    ``intra`` groups the ranks of one node (the fast links), ``inter`` the ranks with the same
    local index across nodes (the slow links); world rank ``r`` is local rank ``r % intra.size``
    of node ``r // intra.size``. Both are None on a flat topology (one node, or one rank per
    node), and hierarchical algorithms then communicate over ``world`` alone. The members are a
    front end's communicators (``bagua_jax`` or ``bagua_torch``).
    """

    world: Any
    intra: Any = None
    inter: Any = None

    @property
    def hierarchical(self) -> bool:
        """Whether both levels are set."""
        return self.intra is not None and self.inter is not None

    def levels(self, hierarchical: bool, algorithm: str = "algorithm") -> tuple[Any, Any] | None:
        """``(intra, inter)`` if ``hierarchical`` is asked for and both levels exist, else None (flat over world).

        Raises a ValueError if the two levels do not tile ``world``.
        """
        if not (hierarchical and self.hierarchical):
            return None
        check_two_levels(self.intra.size, self.inter.size, self.world.size, algorithm)
        return self.intra, self.inter

"""The communicator protocol the algorithms program against.

Two implementations share these method names and semantics, so an algorithm
works with either: :class:`bagua_jax.LaxCommunicator` (JAX's own collectives on a
named mesh axis, used inside ``jax.shard_map``) and
:class:`bagua_jax.NativeCommunicator` (the native MPI/NCCL collectives as ordered
XLA FFI calls, one device per process, used inside ``jax.jit``).

Shapes are per rank. Where a method moves one block per rank, blocks lie along
the leading axis. Every method is a pure function of its inputs and may be
called inside ``jax.jit``; results are bit-identical across ranks wherever every
rank receives the same value.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import numpy as np

from bagua_common.comm.collectives import REDUCE_OPS, Collectives, ReduceOp

__all__ = ["REDUCE_OPS", "Communicator", "ReduceOp", "check_schedule"]


@runtime_checkable
class Communicator(Collectives[jax.Array], Protocol):
    """Collectives among ``size`` ranks (see :class:`bagua_common.comm.collectives.Collectives`); see the module
    docstring for conventions."""

    def rank(self) -> jax.Array:
        """This rank's index as an int32 scalar (traced under ``shard_map``)."""

    def alltoall_v(self, x: jax.Array, send_counts: jax.Array, recv_counts: jax.Array, out_size: int) -> jax.Array:
        """Variable all-to-all on 1-D ``x``: ``send_counts[j]`` leading elements (packed in rank
        order) go to rank j; the result has ``out_size`` elements, the ``recv_counts[j]`` from rank
        j packed in rank order, then zeros. Counts are int32 arrays of ``size`` entries, known at
        run time; they must agree (what i sends to j is what j expects from i)."""

    def send_recv(self, x: jax.Array, peers: jax.Array) -> jax.Array:
        """Send ``x`` to each rank in the int32 array ``peers`` (chosen at run time) and return
        ``[len(peers), *x.shape]`` where row i came from ``peers[i]``. Peers must be symmetric:
        if rank r lists q, rank q lists r as often."""

    def send_recv_scheduled(self, x: jax.Array, schedule: np.ndarray, round_index: jax.Array) -> jax.Array:
        """``send_recv`` with peers from a table known when tracing: ``schedule`` is an int table
        ``[rounds, size, k]`` whose row ``[t, r]`` lists rank r's k peers in round t (every column
        ``[t, :, j]`` a permutation of the ranks, every round symmetric as in ``send_recv``), and
        the run-time ``round_index`` (taken modulo ``rounds``) picks the round. Returns
        ``[k, *x.shape]``, row j from peer ``schedule[t, r, j]``. Unlike ``send_recv`` this lets
        JAX's collectives send ``k B`` (one ``ppermute`` per column) instead of gathering."""

    def barrier(self, x: jax.Array) -> jax.Array:
        """Return ``x`` once every rank has reached this point (orders the barrier with ``x``)."""


def innermost(comm: Any) -> Any:
    """The communicator under ``comm``'s wrappers (those with an ``inner``, e.g. a CountingCommunicator), which
    decides what the collectives can do; ``comm`` itself when it wraps nothing."""
    while hasattr(comm, "inner"):
        comm = comm.inner
    return comm


def check_schedule(schedule: np.ndarray, size: int) -> np.ndarray:
    """``schedule`` as an int32 ``[rounds, size, k]`` table, checked as ``send_recv_scheduled``
    requires (each column a permutation of the ranks, each round symmetric); raises otherwise."""
    table = np.asarray(schedule)
    if table.ndim != 3 or table.shape[1] != size or 0 in table.shape or not np.issubdtype(table.dtype, np.integer):
        raise ValueError(f"a schedule is an int table [rounds, {size}, peers], got {table.dtype}{list(table.shape)}")
    ranks = np.arange(size)
    for t, round_peers in enumerate(table):
        for j in range(table.shape[2]):
            if not np.array_equal(np.sort(round_peers[:, j]), ranks):
                raise ValueError(
                    f"schedule round {t}, column {j} is not a permutation of the ranks: {round_peers[:, j]}"
                )
        links = np.zeros((size, size), np.int64)
        np.add.at(links, (np.repeat(ranks, table.shape[2]), round_peers.ravel()), 1)
        if not np.array_equal(links, links.T):
            raise ValueError(f"schedule round {t} is not symmetric: a rank lists a peer that does not list it back")
    return table.astype(np.int32)

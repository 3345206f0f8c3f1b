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

from typing import Literal, Protocol, runtime_checkable

import jax

ReduceOp = Literal["sum", "avg", "min", "max"]
REDUCE_OPS: tuple[ReduceOp, ...] = ("sum", "avg", "min", "max")


@runtime_checkable
class Communicator(Protocol):
    """Collectives among ``size`` ranks; see the module docstring for conventions."""

    @property
    def size(self) -> int:
        """The number of ranks (a Python int, known when tracing)."""

    def rank(self) -> jax.Array:
        """This rank's index as an int32 scalar (traced under ``shard_map``)."""

    def allreduce(self, x: jax.Array, op: ReduceOp = "sum") -> jax.Array:
        """Reduce ``x`` over all ranks; every rank gets the result."""

    def reduce(self, x: jax.Array, root: int, op: ReduceOp = "sum") -> jax.Array:
        """Reduce ``x`` over all ranks onto ``root``; other ranks get zeros."""

    def broadcast(self, x: jax.Array, root: int) -> jax.Array:
        """Every rank gets ``root``'s ``x``."""

    def reduce_scatter(self, x: jax.Array, op: ReduceOp = "sum") -> jax.Array:
        """``x`` is ``[size, *s]``; rank r gets row r reduced over ranks (shape ``s``)."""

    def allgather(self, x: jax.Array) -> jax.Array:
        """Every rank gets ``[size, *x.shape]``: row j is rank j's ``x``."""

    def gather(self, x: jax.Array, root: int) -> jax.Array:
        """``root`` gets ``[size, *x.shape]`` (row j from rank j); other ranks get zeros."""

    def scatter(self, x: jax.Array, root: int) -> jax.Array:
        """``x`` is ``[size, *s]`` (read on ``root``); rank r gets ``root``'s row r."""

    def alltoall(self, x: jax.Array) -> jax.Array:
        """``x`` is ``[size, *s]``; row j goes to rank j, and row j of the result came from rank j."""

    def alltoall_v(self, x: jax.Array, send_counts: jax.Array, recv_counts: jax.Array, out_size: int) -> jax.Array:
        """Variable all-to-all on 1-D ``x``: ``send_counts[j]`` leading elements (packed in rank
        order) go to rank j; the result has ``out_size`` elements, the ``recv_counts[j]`` from rank
        j packed in rank order, then zeros. Counts are int32 arrays of ``size`` entries, known at
        run time; they must agree (what i sends to j is what j expects from i)."""

    def send_recv(self, x: jax.Array, peers: jax.Array) -> jax.Array:
        """Send ``x`` to each rank in the int32 array ``peers`` (chosen at run time) and return
        ``[len(peers), *x.shape]`` where row i came from ``peers[i]``. Peers must be symmetric:
        if rank r lists q, rank q lists r as often."""

    def barrier(self, x: jax.Array) -> jax.Array:
        """Return ``x`` once every rank has reached this point (orders the barrier with ``x``)."""

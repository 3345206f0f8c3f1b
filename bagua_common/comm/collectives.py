"""The collectives every communicator offers, in both front ends: their names, shapes and meaning.

``bagua_jax.communicator.Communicator`` (on ``jax.Array``) and
``bagua_torch.communicator.Communicator`` (on ``torch.Tensor``) extend :class:`Collectives` with
what differs between the frameworks (how a rank is told, peers, barriers, asynchronous issue).
Shapes are per rank; where a method moves one block per rank, the blocks lie along the leading
axis. ``reduce`` and ``gather`` give zeros off the root. Results are bit-identical across ranks
wherever every rank receives the same value.
"""

from __future__ import annotations

import enum
from typing import Protocol, TypeVar


class ReduceOp(str, enum.Enum):
    """A reduction of the collectives: a member (``ReduceOp.AVG``) or its name (``"avg"``), which it equals.

    The communicators compute the first four (:data:`REDUCE_OPS`), listed in the order of the
    native engines' enum (``xla_ffi/communicator.h``), so :attr:`code` is the integer the engines
    take. ``PRODUCT`` and the bitwise reductions are Bagua's: its collectives
    (:mod:`bagua_torch.torch_api.communication`) compute them from an allgather.
    """

    SUM = "sum"
    AVG = "avg"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    def __str__(self) -> str:
        return self.value

    def __hash__(self) -> int:  # as its name's (Enum hashes the member's name): equal keys, equal hashes
        return hash(self.value)

    @property
    def code(self) -> int:
        """The native engines' code of this reduction; a ValueError for one the engines lack."""
        if self not in _CODES:
            raise ValueError(f"the native engines have no {self.value!r} reduction; they take {REDUCE_OPS}")
        return _CODES[self]


_CODES = {op: code for code, op in enumerate((ReduceOp.SUM, ReduceOp.AVG, ReduceOp.MIN, ReduceOp.MAX))}

REDUCE_OPS: tuple[str, ...] = tuple(op.value for op in _CODES)
"""The names of the reductions the communicators compute, in the engines' order."""

Array = TypeVar("Array")


class Collectives(Protocol[Array]):
    """Collectives among ``size`` ranks on a front end's ``Array``."""

    @property
    def size(self) -> int:
        """The number of ranks (a Python int, known when tracing)."""

    def allreduce(self, x: Array, op: ReduceOp = "sum") -> Array:
        """Reduce ``x`` over all ranks; every rank gets the result."""

    def reduce(self, x: Array, root: int, op: ReduceOp = "sum") -> Array:
        """Reduce ``x`` over all ranks onto ``root``; other ranks get zeros."""

    def broadcast(self, x: Array, root: int) -> Array:
        """Every rank gets ``root``'s ``x``."""

    def reduce_scatter(self, x: Array, op: ReduceOp = "sum") -> Array:
        """``x`` is ``[size, *s]``; rank r gets row r reduced over ranks (shape ``s``)."""

    def allgather(self, x: Array) -> Array:
        """Every rank gets ``[size, *x.shape]``: row j is rank j's ``x``."""

    def gather(self, x: Array, root: int) -> Array:
        """``root`` gets ``[size, *x.shape]`` (row j from rank j); other ranks get zeros."""

    def scatter(self, x: Array, root: int) -> Array:
        """``x`` is ``[size, *s]`` (read on ``root``); rank r gets ``root``'s row r."""

    def alltoall(self, x: Array) -> Array:
        """``x`` is ``[size, *s]``; row j goes to rank j, and row j of the result came from rank j."""

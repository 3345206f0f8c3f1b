"""The argument checks and synchronous methods both communicators share."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import torch

from bagua_torch.communicator.protocol import (
    REDUCE_OPS,
    SUPPORTED_DTYPES,
    ReduceOp,
    Work,
)


class CommunicatorBase(abc.ABC):
    """Argument checks and the synchronous methods, shared by both implementations.

    Subclasses set ``_rank``, ``_size``, ``_name`` and implement the ``*_async`` methods;
    each synchronous method issues its asynchronous variant and waits.
    """

    _rank: int
    _size: int
    _name: str
    _kind: str  # for messages, e.g. "torch.distributed gloo" or "MPI"

    @property
    def size(self) -> int:
        """The number of ranks."""
        return self._size

    @property
    def rank(self) -> int:
        """This process's index among the ranks."""
        return self._rank

    @property
    def name(self) -> str:
        """The communicator's name, used in error messages."""
        return self._name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._kind}, name={self._name!r}, rank={self._rank}, size={self._size})"

    # --- checks -------------------------------------------------------------------

    def _where(self, op: str) -> str:
        return f"{self._kind} {op} on communicator '{self._name}' (rank {self._rank} of {self._size})"

    def _tensor(self, op: str, x: Any) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in SUPPORTED_DTYPES:
            names = ", ".join(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES)
            raise TypeError(f"{op}: unsupported dtype {x.dtype}; communicators carry {names}")
        self._check_device(op, x)
        return x.detach().contiguous()

    def _check_device(self, op: str, x: torch.Tensor) -> None:  # overridden per engine
        pass

    def _reduce_op(self, op_name: str, op: Any, x: torch.Tensor) -> ReduceOp:
        if op not in REDUCE_OPS:
            raise ValueError(f"{op_name}: unknown reduction {op!r}; use one of {REDUCE_OPS}")
        if op == "avg" and not x.dtype.is_floating_point:
            raise TypeError(f"{op_name}: 'avg' needs a floating-point tensor, got {x.dtype}")
        return ReduceOp(op)

    def _root(self, op: str, root: Any) -> int:
        if isinstance(root, bool) or not isinstance(root, int):
            try:
                root = int(root.__index__())
            except (AttributeError, TypeError):
                raise TypeError(f"{op}: root must be an int, got {type(root).__name__}") from None
        if not 0 <= root < self._size:
            raise ValueError(f"{op}: root {root} is not a rank of this {self._size}-rank communicator")
        return root

    def _rows(self, op: str, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 0 or x.shape[0] != self._size:
            raise ValueError(f"{op}: x must have shape [size={self._size}, ...], got {list(x.shape)}")
        return x

    def _ints(self, op: str, what: str, values: Any) -> list[int]:
        if isinstance(values, torch.Tensor):
            values = values.tolist()
        try:
            out = [int(v) for v in values]
        except (TypeError, ValueError):
            raise TypeError(f"{op}: {what} must be a sequence of ints, got {values!r}") from None
        return out

    def _alltoall_v_operands(
        self, x: Any, send_counts: Any, recv_counts: Any, out_size: Any
    ) -> tuple[torch.Tensor, list[int], list[int], torch.Tensor]:
        """``alltoall_v``'s checked operands: ``x``, the counts and the zeroed output."""
        op = "alltoall_v"
        x = self._tensor(op, x)
        if x.dim() != 1:
            raise ValueError(f"{op}: x must be 1-D, got shape {list(x.shape)}")
        send = self._ints(op, "send_counts", send_counts)
        recv = self._ints(op, "recv_counts", recv_counts)
        for what, counts in (("send_counts", send), ("recv_counts", recv)):
            if len(counts) != self._size:
                raise ValueError(f"{op}: {what} needs one entry per rank ({self._size}), got {len(counts)}")
            if any(c < 0 for c in counts):
                raise ValueError(f"{op}: {what} must be non-negative, got {counts}")
        out_size = int(out_size)
        if sum(send) > x.numel():
            raise ValueError(f"{op}: send_counts sum to {sum(send)} but x has only {x.numel()} elements")
        if sum(recv) > out_size:
            raise ValueError(f"{op}: recv_counts sum to {sum(recv)}, more than out_size={out_size}")
        return x, send, recv, torch.zeros(out_size, dtype=x.dtype, device=x.device)

    def _peers(self, peers: Any) -> list[int]:
        peers = self._ints("send_recv", "peers", peers)
        for p in peers:
            if not 0 <= p < self._size or p == self._rank:
                raise ValueError(
                    f"send_recv: peer {p} is not another rank of this {self._size}-rank communicator "
                    f"(this is rank {self._rank})"
                )
        return peers

    # --- synchronous methods: issue, then wait ------------------------------------

    def allreduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``x`` over all ranks; every rank gets the result."""
        return self.allreduce_async(x, op).wait()

    def reduce(self, x: torch.Tensor, root: int, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``x`` over all ranks onto ``root``; other ranks get zeros."""
        return self.reduce_async(x, root, op).wait()

    def broadcast(self, x: torch.Tensor, root: int) -> torch.Tensor:
        """Every rank gets ``root``'s ``x``."""
        return self.broadcast_async(x, root).wait()

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """``x`` is ``[size, *s]``; rank r gets row r reduced over ranks."""
        return self.reduce_scatter_async(x, op).wait()

    def allgather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank gets ``[size, *x.shape]``: row j is rank j's ``x``."""
        return self.allgather_async(x).wait()

    def gather(self, x: torch.Tensor, root: int) -> torch.Tensor:
        """``root`` gets ``[size, *x.shape]`` (row j from rank j); other ranks get zeros."""
        return self.gather_async(x, root).wait()

    def scatter(self, x: torch.Tensor, root: int) -> torch.Tensor:
        """``x`` is ``[size, *s]`` (read on ``root``); rank r gets ``root``'s row r."""
        return self.scatter_async(x, root).wait()

    def alltoall(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` is ``[size, *s]``; row j goes to rank j, and row j of the result came from rank j."""
        return self.alltoall_async(x).wait()

    def alltoall_v(
        self, x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], out_size: int
    ) -> torch.Tensor:
        """Variable all-to-all on 1-D ``x`` (see :meth:`Communicator.alltoall_v`)."""
        return self.alltoall_v_async(x, send_counts, recv_counts, out_size).wait()

    def send_recv(self, x: torch.Tensor, peers: Sequence[int]) -> torch.Tensor:
        """Exchange ``x`` with each of ``peers``; row i of the result came from ``peers[i]``."""
        return self.send_recv_async(x, peers).wait()

    def barrier(self) -> None:
        """Return once every rank has reached this point."""
        self.barrier_async().wait()

    # --- what each implementation issues ----------------------------------------

    @abc.abstractmethod
    def allreduce_async(self, x: torch.Tensor, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`allreduce`; ``wait()`` returns its result."""

    @abc.abstractmethod
    def reduce_async(self, x: torch.Tensor, root: int, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`reduce`; ``wait()`` returns its result."""

    @abc.abstractmethod
    def broadcast_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`broadcast`; ``wait()`` returns its result."""

    @abc.abstractmethod
    def reduce_scatter_async(self, x: torch.Tensor, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`reduce_scatter`; ``wait()`` returns its result."""

    @abc.abstractmethod
    def allgather_async(self, x: torch.Tensor) -> Work:
        """Issue :meth:`allgather`; ``wait()`` returns its result."""

    @abc.abstractmethod
    def gather_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`gather`; ``wait()`` returns its result."""

    @abc.abstractmethod
    def scatter_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`scatter`; ``wait()`` returns its result."""

    @abc.abstractmethod
    def alltoall_async(self, x: torch.Tensor) -> Work:
        """Issue :meth:`alltoall`; ``wait()`` returns its result."""

    @abc.abstractmethod
    def alltoall_v_async(
        self, x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], out_size: int
    ) -> Work:
        """Issue :meth:`alltoall_v`; ``wait()`` returns its result."""

    @abc.abstractmethod
    def send_recv_async(self, x: torch.Tensor, peers: Sequence[int]) -> Work:
        """Issue :meth:`send_recv`; ``wait()`` returns its result."""

    @abc.abstractmethod
    def barrier_async(self) -> Work:
        """Issue :meth:`barrier`; ``wait()`` returns ``None``."""

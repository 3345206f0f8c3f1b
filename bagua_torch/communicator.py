"""The communicator protocol for PyTorch, and its two implementations.

The methods and their semantics are those of :mod:`bagua_jax.communicator`, on
torch tensors: shapes are per rank; where a method moves one block per rank, the
blocks lie along the leading dimension; ``reduce`` and ``gather`` give zeros off
the root; every method returns a new tensor and never writes into its input.
Results are bit-identical across ranks wherever every rank receives the same
value. ``rank`` is a plain ``int`` here, counts and peers are lists of ints, and
``barrier()`` takes no tensor.

Each collective also has an ``<name>_async`` variant that issues it and returns a
:class:`Work` handle at once; ``wait()`` returns the result. Collectives are
issued in call order on every rank (sync and async alike), so PyTorch can overlap
communication with the backward pass as long as every rank issues the same
sequence. As with ``torch.distributed``, do not modify an asynchronous
collective's input before its ``wait()`` returns.

:class:`ProcessGroupCommunicator` runs over a ``torch.distributed`` process group
(gloo on CPU, nccl on GPU); :class:`NativeCommunicator` runs over Bagua's native
engines through DLPack (``_bagua_mpi`` for CPU tensors, ``_bagua_nccl`` for CUDA
tensors). A peer that dies, or a collective that never completes, raises
:class:`CommunicationError` on the surviving ranks within the communicator's
timeout (default ``BAGUA_COMM_TIMEOUT`` or 300 seconds) instead of hanging.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import functools
import importlib
import itertools
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import ModuleType
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from bagua_common.comm_timeout import timeout_seconds

ReduceOp = Literal["sum", "avg", "min", "max"]
REDUCE_OPS: tuple[ReduceOp, ...] = ("sum", "avg", "min", "max")
_OP_CODES = {"sum": 0, "avg": 1, "min": 2, "max": 3}

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.uint8,
    torch.int32,
    torch.int64,
)
"""The element types every communicator carries (the native engines' set)."""

class CommunicationError(RuntimeError):
    """A collective failed or did not complete within the communicator's timeout.

    The message names the communicator, the operation and this rank. After such an
    error the communicator (and, for a process group, the group) should be
    considered unusable: peers may be dead or out of step.
    """


@runtime_checkable
class Work(Protocol):
    """The handle of an asynchronous collective."""

    def wait(self) -> torch.Tensor | None:
        """Block until the collective is done (or fails) and return its result.

        For CUDA tensors this orders the caller's current stream after the
        communication rather than synchronizing the host with the device. Calling it
        again returns the same tensor. ``barrier_async`` yields ``None``.
        """

    def is_completed(self) -> bool:
        """Whether the collective has finished, without blocking."""


@runtime_checkable
class Communicator(Protocol):
    """Collectives among ``size`` ranks on torch tensors; see the module docstring."""

    @property
    def size(self) -> int:
        """The number of ranks."""

    @property
    def rank(self) -> int:
        """This process's index among the ranks."""

    def allreduce(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``x`` over all ranks; every rank gets the result."""

    def reduce(self, x: torch.Tensor, root: int, op: ReduceOp = "sum") -> torch.Tensor:
        """Reduce ``x`` over all ranks onto ``root``; other ranks get zeros."""

    def broadcast(self, x: torch.Tensor, root: int) -> torch.Tensor:
        """Every rank gets ``root``'s ``x``."""

    def reduce_scatter(self, x: torch.Tensor, op: ReduceOp = "sum") -> torch.Tensor:
        """``x`` is ``[size, *s]``; rank r gets row r reduced over ranks."""

    def allgather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank gets ``[size, *x.shape]``: row j is rank j's ``x``."""

    def gather(self, x: torch.Tensor, root: int) -> torch.Tensor:
        """``root`` gets ``[size, *x.shape]`` (row j from rank j); other ranks get zeros."""

    def scatter(self, x: torch.Tensor, root: int) -> torch.Tensor:
        """``x`` is ``[size, *s]`` (read on ``root``); rank r gets ``root``'s row r."""

    def alltoall(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` is ``[size, *s]``; row j goes to rank j, and row j of the result came from rank j."""

    def alltoall_v(
        self, x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], out_size: int
    ) -> torch.Tensor:
        """Variable all-to-all on 1-D ``x``: ``send_counts[j]`` leading elements (packed in rank
        order) go to rank j; the result has ``out_size`` elements, the ``recv_counts[j]`` from
        rank j packed in rank order, then zeros. Counts must agree across ranks."""

    def send_recv(self, x: torch.Tensor, peers: Sequence[int]) -> torch.Tensor:
        """Send ``x`` to each rank in ``peers`` and return ``[len(peers), *x.shape]`` where row i
        came from ``peers[i]``. Peers must be symmetric: if rank r lists q, q lists r as often."""

    def barrier(self) -> None:
        """Return once every rank has reached this point."""

    def allreduce_async(self, x: torch.Tensor, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`allreduce`; ``wait()`` returns its result."""

    def reduce_async(self, x: torch.Tensor, root: int, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`reduce`; ``wait()`` returns its result."""

    def broadcast_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`broadcast`; ``wait()`` returns its result."""

    def reduce_scatter_async(self, x: torch.Tensor, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`reduce_scatter`; ``wait()`` returns its result."""

    def allgather_async(self, x: torch.Tensor) -> Work:
        """Issue :meth:`allgather`; ``wait()`` returns its result."""

    def gather_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`gather`; ``wait()`` returns its result."""

    def scatter_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`scatter`; ``wait()`` returns its result."""

    def alltoall_async(self, x: torch.Tensor) -> Work:
        """Issue :meth:`alltoall`; ``wait()`` returns its result."""

    def alltoall_v_async(
        self, x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], out_size: int
    ) -> Work:
        """Issue :meth:`alltoall_v`; ``wait()`` returns its result."""

    def send_recv_async(self, x: torch.Tensor, peers: Sequence[int]) -> Work:
        """Issue :meth:`send_recv`; ``wait()`` returns its result."""

    def barrier_async(self) -> Work:
        """Issue :meth:`barrier`; ``wait()`` returns ``None``."""


class _DoneWork:
    """A collective with nothing to communicate (e.g. ``send_recv`` with no peers)."""

    def __init__(self, result: torch.Tensor | None):
        self._result = result

    def wait(self) -> torch.Tensor | None:
        return self._result

    def is_completed(self) -> bool:
        return True


class _CommunicatorBase:
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

    def _reduce_op(self, op_name: str, op: Any, x: torch.Tensor) -> str:
        if op not in REDUCE_OPS:
            raise ValueError(f"{op_name}: unknown reduction {op!r}; use one of {REDUCE_OPS}")
        if op == "avg" and not x.dtype.is_floating_point:
            raise TypeError(f"{op_name}: 'avg' needs a floating-point tensor, got {x.dtype}")
        return op

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

    def _counts(
        self, x: torch.Tensor, send_counts: Any, recv_counts: Any, out_size: Any
    ) -> tuple[list[int], list[int], int]:
        op = "alltoall_v"
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
        return send, recv, out_size

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

    # The *_async methods are the subclasses'.
    def allreduce_async(self, x: torch.Tensor, op: ReduceOp = "sum") -> Work:  # pragma: no cover
        raise NotImplementedError

    def reduce_async(self, x: torch.Tensor, root: int, op: ReduceOp = "sum") -> Work:  # pragma: no cover
        raise NotImplementedError

    def broadcast_async(self, x: torch.Tensor, root: int) -> Work:  # pragma: no cover
        raise NotImplementedError

    def reduce_scatter_async(self, x: torch.Tensor, op: ReduceOp = "sum") -> Work:  # pragma: no cover
        raise NotImplementedError

    def allgather_async(self, x: torch.Tensor) -> Work:  # pragma: no cover
        raise NotImplementedError

    def gather_async(self, x: torch.Tensor, root: int) -> Work:  # pragma: no cover
        raise NotImplementedError

    def scatter_async(self, x: torch.Tensor, root: int) -> Work:  # pragma: no cover
        raise NotImplementedError

    def alltoall_async(self, x: torch.Tensor) -> Work:  # pragma: no cover
        raise NotImplementedError

    def alltoall_v_async(
        self, x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], out_size: int
    ) -> Work:  # pragma: no cover
        raise NotImplementedError

    def send_recv_async(self, x: torch.Tensor, peers: Sequence[int]) -> Work:  # pragma: no cover
        raise NotImplementedError

    def barrier_async(self) -> Work:  # pragma: no cover
        raise NotImplementedError


# =====================================================================================
# torch.distributed
# =====================================================================================


# torch 2.13 renamed the one-tensor collectives and deprecated the old names (a FutureWarning
# on every call); the oldest torch supported has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _torch_op(op: str) -> Any:
    return {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]


class _TorchWork:
    """Wraps the ``torch.distributed`` work objects of one collective."""

    def __init__(
        self,
        comm: ProcessGroupCommunicator,
        op: str,
        works: list[Any],
        result: torch.Tensor | None,
        finish: Callable[[torch.Tensor | None], torch.Tensor | None] | None = None,
    ):
        self._comm, self._op, self._works = comm, op, works
        self._result, self._finish = result, finish
        self._done = False

    def wait(self) -> torch.Tensor | None:
        if not self._done:
            timeout = timedelta(seconds=self._comm.timeout)
            for work in self._works:
                self._comm._guard(self._op, lambda work=work: work.wait(timeout), waiting=True)
            if self._finish is not None:
                self._result = self._finish(self._result)
            self._done = True
        return self._result

    def is_completed(self) -> bool:
        return self._done or all(work.is_completed() for work in self._works)


class ProcessGroupCommunicator(_CommunicatorBase):
    """The communicator protocol over a ``torch.distributed`` process group.

    ``group`` is a process group (default: the world group of an initialized
    ``torch.distributed``); gloo communicates CPU tensors, nccl CUDA tensors. The
    asynchronous variants use ``async_op=True`` and return at once. ``wait()`` waits
    at most ``timeout`` seconds (default ``BAGUA_COMM_TIMEOUT`` or 300) and turns any failure
    (a dead peer, a timeout) into :class:`CommunicationError` naming the
    communicator, the operation and the rank; the process group's own timeout
    (``init_process_group(timeout=...)``) bounds the operation as well. Emulations:
    ``avg`` is a sum divided by the rank count on every backend but nccl (which has a
    native average); ``reduce_scatter`` falls back to an allreduce followed by taking
    this rank's row on backends without ``reduce_scatter_tensor`` (older gloo), which
    moves ``size`` times the data; ``reduce`` and ``gather`` zero the result off the
    root, and ``alltoall_v`` pads it with zeros, as the protocol requires.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        timeout: float | timedelta | None = None,
        name: str | None = None,
    ):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroupCommunicator needs torch.distributed; call dist.init_process_group() first"
            )
        self._group = group
        self._backend = str(dist.get_backend(group))
        self._rank = dist.get_rank(group)
        if self._rank < 0:
            raise ValueError("this process is not a member of the given process group")
        self._size = dist.get_world_size(group)
        if name is None:
            name = "world" if group is None else f"group {getattr(group, 'group_name', '') or id(group)}"
        self._name = name
        self._kind = f"torch.distributed {self._backend}"
        self.timeout = timeout_seconds(timeout)
        # None: unknown, found out on the first reduce_scatter.
        self._has_reduce_scatter: bool | None = None
        self._native_avg = self._backend == "nccl"

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (``None`` for the default world group)."""
        return self._group

    @property
    def backend(self) -> str:
        """The process group's backend, e.g. ``"gloo"`` or ``"nccl"``."""
        return self._backend

    def _check_device(self, op: str, x: torch.Tensor) -> None:
        if self._backend == "nccl" and not x.is_cuda:
            raise ValueError(f"{op}: the nccl backend communicates CUDA tensors, got a {x.device} tensor")
        if self._backend == "gloo" and x.device.type != "cpu":
            raise ValueError(f"{op}: this communicator's gloo backend is used for CPU tensors, got {x.device}")

    def _global(self, rank: int) -> int:
        return rank if self._group is None else dist.get_global_rank(self._group, rank)

    def _guard(self, op: str, call: Callable[[], Any], waiting: bool = False) -> Any:
        try:
            return call()
        except RuntimeError as error:  # DistBackendError, gloo and timeout errors
            note = (
                f" (waited at most {self.timeout:g} s; a peer may have died or not entered the same collective)"
                if waiting
                else ""
            )
            raise CommunicationError(f"{self._where(op)} failed{note}: {error}") from error

    def _issue(self, op: str, call: Callable[[], Any], result: torch.Tensor | None, finish=None) -> _TorchWork:
        work = self._guard(op, call)
        works = work if isinstance(work, list) else [work]
        return _TorchWork(self, op, [w for w in works if w is not None], result, finish)

    def _sum_op(self, op: str):
        if op == "avg":
            return dist.ReduceOp.AVG if self._native_avg else dist.ReduceOp.SUM
        return _torch_op(op)

    def _average(self, op: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        if op == "avg" and not self._native_avg:
            return lambda t: t.div_(self._size)
        return None

    def allreduce_async(self, x: torch.Tensor, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`allreduce`; ``wait()`` returns its result."""
        x = self._tensor("allreduce", x)
        op = self._reduce_op("allreduce", op, x)
        out = x.clone()
        return self._issue(
            "allreduce",
            lambda: dist.all_reduce(out, op=self._sum_op(op), group=self._group, async_op=True),
            out,
            self._average(op),
        )

    def reduce_async(self, x: torch.Tensor, root: int, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`reduce`; ``wait()`` returns its result."""
        x = self._tensor("reduce", x)
        op = self._reduce_op("reduce", op, x)
        root = self._root("reduce", root)
        out = x.clone()
        average = self._average(op)

        def finish(t: torch.Tensor) -> torch.Tensor:
            if self._rank != root:
                return t.zero_()  # torch leaves partial sums off the root
            return average(t) if average else t

        return self._issue(
            "reduce",
            lambda: dist.reduce(out, self._global(root), op=self._sum_op(op), group=self._group, async_op=True),
            out,
            finish,
        )

    def broadcast_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`broadcast`; ``wait()`` returns its result."""
        x = self._tensor("broadcast", x)
        root = self._root("broadcast", root)
        out = x.clone()
        return self._issue(
            "broadcast", lambda: dist.broadcast(out, self._global(root), group=self._group, async_op=True), out
        )

    def reduce_scatter_async(self, x: torch.Tensor, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`reduce_scatter`; ``wait()`` returns its result.

        Uses ``reduce_scatter_single`` where the backend has it, otherwise an allreduce
        of the whole tensor followed by taking row ``rank`` (same result, ``size``
        times the traffic).
        """
        x = self._rows("reduce_scatter", self._tensor("reduce_scatter", x))
        op = self._reduce_op("reduce_scatter", op, x)
        average = self._average(op)
        if self._has_reduce_scatter is not False:
            out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
            try:
                work = _reduce_scatter_single(
                    out.view(-1), x.view(-1), op=self._sum_op(op), group=self._group, async_op=True
                )
                self._has_reduce_scatter = True
                return _TorchWork(self, "reduce_scatter", [work], out, average)
            except RuntimeError as error:
                text = str(error).lower()
                unsupported = "support" in text or "not implemented" in text
                if self._has_reduce_scatter or not unsupported:
                    raise CommunicationError(f"{self._where('reduce_scatter')} failed: {error}") from error
                self._has_reduce_scatter = False  # every rank runs the same backend: all fall back
        full = x.clone()

        def finish(t: torch.Tensor) -> torch.Tensor:
            row = t[self._rank].clone()
            return average(row) if average else row

        return self._issue(
            "reduce_scatter",
            lambda: dist.all_reduce(full, op=self._sum_op(op), group=self._group, async_op=True),
            full,
            finish,
        )

    def allgather_async(self, x: torch.Tensor) -> Work:
        """Issue :meth:`allgather`; ``wait()`` returns its result."""
        x = self._tensor("allgather", x)
        out = torch.empty((self._size, *x.shape), dtype=x.dtype, device=x.device)
        return self._issue(
            "allgather",
            lambda: _all_gather_single(out.view(-1), x.view(-1), group=self._group, async_op=True),
            out,
        )

    def gather_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`gather`; ``wait()`` returns its result."""
        x = self._tensor("gather", x)
        root = self._root("gather", root)
        out = torch.zeros((self._size, *x.shape), dtype=x.dtype, device=x.device)
        rows = list(out.unbind(0)) if self._rank == root else None
        return self._issue(
            "gather",
            lambda: dist.gather(x, rows, dst=self._global(root), group=self._group, async_op=True),
            out,
        )

    def scatter_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`scatter`; ``wait()`` returns its result."""
        x = self._rows("scatter", self._tensor("scatter", x))
        root = self._root("scatter", root)
        out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
        rows = list(x.unbind(0)) if self._rank == root else None
        return self._issue(
            "scatter",
            lambda: dist.scatter(out, rows, src=self._global(root), group=self._group, async_op=True),
            out,
        )

    def alltoall_async(self, x: torch.Tensor) -> Work:
        """Issue :meth:`alltoall`; ``wait()`` returns its result."""
        x = self._rows("alltoall", self._tensor("alltoall", x))
        out = torch.empty_like(x)
        return self._issue(
            "alltoall",
            lambda: dist.all_to_all_single(out, x, group=self._group, async_op=True),
            out,
        )

    def alltoall_v_async(
        self, x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], out_size: int
    ) -> Work:
        """Issue :meth:`alltoall_v`; ``wait()`` returns its result."""
        x = self._tensor("alltoall_v", x)
        send, recv, out_size = self._counts(x, send_counts, recv_counts, out_size)
        out = torch.zeros(out_size, dtype=x.dtype, device=x.device)
        return self._issue(
            "alltoall_v",
            lambda: dist.all_to_all_single(
                out[: sum(recv)], x[: sum(send)], output_split_sizes=recv, input_split_sizes=send,
                group=self._group, async_op=True,
            ),
            out,
        )

    def send_recv_async(self, x: torch.Tensor, peers: Sequence[int]) -> Work:
        """Issue :meth:`send_recv` (one batch of point-to-point operations); ``wait()`` returns its result."""
        x = self._tensor("send_recv", x)
        peers = self._peers(peers)
        out = torch.empty((len(peers), *x.shape), dtype=x.dtype, device=x.device)
        if not peers:
            return _DoneWork(out)
        ops = []
        for i, peer in enumerate(peers):
            # The i-th exchange with a given peer uses tag i on both sides (repeated peers pair in order).
            tag = peers[:i].count(peer)
            ops.append(dist.P2POp(dist.irecv, out[i], self._global(peer), self._group, tag))
            ops.append(dist.P2POp(dist.isend, x, self._global(peer), self._group, tag))
        return self._issue("send_recv", lambda: dist.batch_isend_irecv(ops), out)

    def barrier_async(self) -> Work:
        """Issue :meth:`barrier`; ``wait()`` returns ``None``."""
        return self._issue("barrier", lambda: dist.barrier(group=self._group, async_op=True), None)


# =====================================================================================
# The native engines through DLPack
# =====================================================================================

_ENGINE_MODULES = {"mpi": "_bagua_mpi", "nccl": "_bagua_nccl"}
_ENGINE_DEVICES = {"mpi": "cpu", "nccl": "cuda"}
_store_sequence = itertools.count()  # communicators created from a store, in call order


@functools.cache
def _engine(kind: str) -> ModuleType:
    """Import the native engine module ``kind`` ("mpi" or "nccl") once, finalizing it at exit."""
    import _bagua_ffi

    if not _bagua_ffi.build_info().get(kind):
        raise RuntimeError(
            f"bagua was built without the {kind.upper()} engine (see bagua_torch.build_info()); "
            + ("install mpich and rebuild" if kind == "mpi" else "install NCCL and rebuild with CUDA")
        )
    module = importlib.import_module(_ENGINE_MODULES[kind])
    atexit.register(module.finalize)
    return module


class _NativeWork:
    """A collective running on a communicator's worker thread."""

    def __init__(
        self,
        future: concurrent.futures.Future,
        result: torch.Tensor | None,
        done_event: Any = None,
        device: torch.device | None = None,
    ):
        self._future, self._result, self._event, self._device = future, result, done_event, device

    def wait(self) -> torch.Tensor | None:
        self._future.result()  # re-raises the worker's error
        if self._event is not None:
            torch.cuda.current_stream(self._device).wait_event(self._event)
        return self._result

    def is_completed(self) -> bool:
        if not self._future.done():
            return False
        if self._future.exception() is not None or self._event is None:
            return True
        return self._event.query()


class NativeCommunicator(_CommunicatorBase):
    """The communicator protocol over Bagua's native engines, through DLPack.

    One communicator uses one engine: MPI for CPU tensors (:meth:`mpi_world`, under
    ``mpiexec``) or NCCL for CUDA tensors (:meth:`from_store`). Collectives run on
    one worker thread per communicator, so the asynchronous variants overlap with
    the caller and every collective, sync or async, is issued in call order. CUDA
    collectives run on a side stream that first waits for the caller's current
    stream; ``wait()`` then orders the caller's current stream after them (no host
    synchronization). Each collective completes or raises
    :class:`CommunicationError` within ``timeout`` seconds, the message naming the
    communicator, the operation and the rank; after such an error the communicator
    is unusable. NCCL enqueues without waiting for the device, so a CUDA collective
    that fails after being enqueued (its watchdog aborts the communicator at the
    timeout) is reported by the next call on the communicator.
    """

    def __init__(self, handle: int, engine: str, timeout: float, name: str, device: torch.device | None = None):
        """Wrap an engine ``handle`` (use :meth:`mpi_world`, :meth:`from_store` or :meth:`split`)."""
        if engine not in _ENGINE_MODULES:
            raise ValueError(f"unknown engine {engine!r}; use 'mpi' or 'nccl'")
        self._module = _engine(engine)
        self._engine_kind = engine
        self._handle = int(handle)
        self._rank = int(self._module.rank(self._handle))
        self._size = int(self._module.size(self._handle))
        self._name = name
        self._kind = engine.upper()
        self.timeout = float(timeout)
        self._device_type = _ENGINE_DEVICES[engine]
        self._device = device if device is not None else torch.device(self._device_type)
        self._issue_lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"bagua-{name}")
        self._stream: Any = None  # the CUDA side stream, made on first use
        self._closed = False

    # --- construction -------------------------------------------------------------

    @classmethod
    def mpi_world(cls, timeout: float | timedelta | None = None, name: str = "world") -> NativeCommunicator:
        """All ranks of the MPI job (a duplicate of ``MPI_COMM_WORLD``), for CPU tensors.

        Start the processes with ``mpiexec``; MPI is initialized on first use and
        finalized at exit. ``timeout`` defaults to ``BAGUA_COMM_TIMEOUT`` or 300 seconds.
        """
        seconds = timeout_seconds(timeout)
        handle = _engine("mpi").world(name, seconds)
        return cls(handle, "mpi", seconds, name)

    @classmethod
    def from_store(
        cls,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: float | timedelta | None = None,
        name: str = "world",
        device: torch.device | int | None = None,
    ) -> NativeCommunicator:
        """An NCCL communicator of ``size`` processes, for CUDA tensors on ``device``.

        Rank 0 creates the NCCL unique id and puts it in ``store`` (a
        ``torch.distributed`` Store, e.g. ``dist.TCPStore`` or the default group's);
        the other ranks wait for it there. Every process must call it, in the same
        order relative to other ``from_store`` calls on the same store. ``device``
        defaults to the current CUDA device.
        """
        rank, size = int(rank), int(size)
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in [0, {size})")
        seconds = timeout_seconds(timeout)
        nccl = _engine("nccl")
        cuda = cls._cuda_device(device)
        key = f"bagua/nccl/{name}/{next(_store_sequence)}"
        unique_id = cls._share_unique_id(store, key, rank == 0, nccl, seconds)
        try:
            handle = nccl.create(unique_id, rank, size, name, seconds, cuda.index)
        except RuntimeError as error:
            raise CommunicationError(
                f"NCCL create of communicator '{name}' (rank {rank} of {size}): {str(error).removeprefix('bagua ')}"
            ) from error
        return cls(handle, "nccl", seconds, name, cuda)

    @staticmethod
    def _cuda_device(device: torch.device | int | None) -> torch.device:
        if not torch.cuda.is_available():
            raise RuntimeError("the NCCL engine needs a CUDA device, and torch sees none")
        if device is None:
            return torch.device("cuda", torch.cuda.current_device())
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"the NCCL engine communicates CUDA tensors; device {device} is not a CUDA device")
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())

    @staticmethod
    def _share_unique_id(store: Any, key: str, leader: bool, nccl: ModuleType, timeout: float) -> bytes:
        if leader:
            unique_id = bytes(nccl.unique_id())
            store.set(key, unique_id)
            return unique_id
        try:
            store.wait([key], timedelta(seconds=timeout))
        except Exception as error:
            raise CommunicationError(
                f"NCCL setup of communicator at store key '{key}': the unique id from the leader rank did "
                f"not arrive within {timeout} s: {error}"
            ) from error
        return bytes(store.get(key))

    def split(self, color: int, key: int, name: str | None = None) -> NativeCommunicator:
        """The ranks with the same ``color`` (>= 0), ordered by ``key`` (ties by rank).

        Every rank of this communicator must call it, in the same order as its
        collectives (it runs on the worker thread behind any queued collective). The
        child has this communicator's engine, device and timeout; ``name`` defaults
        to ``"<parent name>/<color>"``.
        """
        color, key = int(color), int(key)
        if color < 0:
            raise ValueError(f"split: color must be non-negative, got {color}")
        name = name if name is not None else f"{self._name}/{color}"

        def split() -> int:
            try:
                return self._module.split(self._handle, color, key, name)
            except RuntimeError as error:
                raise CommunicationError(f"{self._where('split')}: {error}") from error

        handle = self._run_ordered(split)
        return NativeCommunicator(handle, self._engine_kind, self.timeout, name, self._device)

    def close(self) -> None:
        """Wait for queued collectives, stop the worker thread and release the engine handle."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        self._module.destroy(self._handle)

    def __enter__(self) -> NativeCommunicator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def engine(self) -> str:
        """The engine, ``"mpi"`` or ``"nccl"``."""
        return self._engine_kind

    @property
    def handle(self) -> int:
        """The engine's integer handle of this communicator."""
        return self._handle

    # --- issuing ------------------------------------------------------------------

    def _check_device(self, op: str, x: torch.Tensor) -> None:
        if x.device.type != self._device_type:
            raise ValueError(
                f"{op}: communicator '{self._name}' uses the {self._kind} engine, which communicates "
                f"{self._device_type.upper()} tensors; got a tensor on {x.device}"
            )
        if self._device_type == "cuda" and x.device != self._device:
            raise ValueError(f"{op}: communicator '{self._name}' lives on {self._device}; got a tensor on {x.device}")

    def _run_ordered(self, call: Callable[[], Any]) -> Any:
        """Run ``call`` on the worker thread after every collective issued so far."""
        with self._issue_lock:
            if self._closed:
                raise RuntimeError(f"communicator '{self._name}' is closed")
            future = self._executor.submit(call)
        return future.result()

    def _submit(
        self,
        op: str,
        call: Callable[[int], None],
        result: torch.Tensor | None,
        tensors: Sequence[torch.Tensor] = (),
        finish: Callable[[], None] | None = None,
    ) -> Work:
        """Queue ``call(stream)`` on the worker thread; ``finish`` runs there afterwards."""
        where = self._where(op)

        def translate(error: RuntimeError) -> CommunicationError:
            text = str(error).removeprefix("bagua ")
            return CommunicationError(text if f"'{self._name}'" in text else f"{where}: {text}")

        with self._issue_lock:
            if self._closed:
                raise RuntimeError(f"{where}: the communicator is closed")
            if self._device_type != "cuda":

                def run() -> None:
                    try:
                        call(0)
                    except RuntimeError as error:
                        raise translate(error) from error
                    if finish is not None:
                        finish()

                return _NativeWork(self._executor.submit(run), result)

            # CUDA: the side stream waits for what the caller queued so far, then runs the collective.
            if self._stream is None:
                self._stream = torch.cuda.Stream(self._device)
            stream, device = self._stream, self._device
            stream.wait_stream(torch.cuda.current_stream(device))
            for t in tensors:
                t.record_stream(stream)
            done = torch.cuda.Event()

            def run_cuda() -> None:
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    try:
                        call(stream.cuda_stream)
                    except RuntimeError as error:
                        raise translate(error) from error
                    if finish is not None:
                        finish()
                    done.record(stream)

            return _NativeWork(self._executor.submit(run_cuda), result, done, device)

    def _empty(self, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=like.dtype, device=like.device)

    # --- the collectives ----------------------------------------------------------

    def allreduce_async(self, x: torch.Tensor, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`allreduce`; ``wait()`` returns its result."""
        x = self._tensor("allreduce", x)
        code = _OP_CODES[self._reduce_op("allreduce", op, x)]
        out = self._empty(x.shape, x)
        m, h = self._module, self._handle
        return self._submit("allreduce", lambda s: m.allreduce(h, x, out, code, s), out, (x, out))

    def reduce_async(self, x: torch.Tensor, root: int, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`reduce`; ``wait()`` returns its result."""
        x = self._tensor("reduce", x)
        code = _OP_CODES[self._reduce_op("reduce", op, x)]
        root = self._root("reduce", root)
        out = self._empty(x.shape, x)
        m, h = self._module, self._handle
        finish = out.zero_ if self._rank != root else None
        return self._submit("reduce", lambda s: m.reduce(h, x, out, code, root, s), out, (x, out), finish)

    def broadcast_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`broadcast`; ``wait()`` returns its result."""
        x = self._tensor("broadcast", x)
        root = self._root("broadcast", root)
        out = x.clone()
        m, h = self._module, self._handle
        return self._submit("broadcast", lambda s: m.broadcast(h, out, root, s), out, (out,))

    def reduce_scatter_async(self, x: torch.Tensor, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`reduce_scatter`; ``wait()`` returns its result."""
        x = self._rows("reduce_scatter", self._tensor("reduce_scatter", x))
        code = _OP_CODES[self._reduce_op("reduce_scatter", op, x)]
        out = self._empty(x.shape[1:], x)
        m, h = self._module, self._handle
        return self._submit("reduce_scatter", lambda s: m.reduce_scatter(h, x, out, code, s), out, (x, out))

    def allgather_async(self, x: torch.Tensor) -> Work:
        """Issue :meth:`allgather`; ``wait()`` returns its result."""
        x = self._tensor("allgather", x)
        out = self._empty((self._size, *x.shape), x)
        m, h = self._module, self._handle
        return self._submit("allgather", lambda s: m.allgather(h, x, out, s), out, (x, out))

    def gather_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`gather`; ``wait()`` returns its result."""
        x = self._tensor("gather", x)
        root = self._root("gather", root)
        out = self._empty((self._size, *x.shape), x)
        m, h = self._module, self._handle
        finish = out.zero_ if self._rank != root else None
        return self._submit("gather", lambda s: m.gather(h, x, out, root, s), out, (x, out), finish)

    def scatter_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`scatter`; ``wait()`` returns its result."""
        x = self._rows("scatter", self._tensor("scatter", x))
        root = self._root("scatter", root)
        out = self._empty(x.shape[1:], x)
        m, h = self._module, self._handle
        return self._submit("scatter", lambda s: m.scatter(h, x, out, root, s), out, (x, out))

    def alltoall_async(self, x: torch.Tensor) -> Work:
        """Issue :meth:`alltoall`; ``wait()`` returns its result."""
        x = self._rows("alltoall", self._tensor("alltoall", x))
        out = self._empty(x.shape, x)
        m, h = self._module, self._handle
        return self._submit("alltoall", lambda s: m.alltoall(h, x, out, s), out, (x, out))

    def alltoall_v_async(
        self, x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], out_size: int
    ) -> Work:
        """Issue :meth:`alltoall_v`; ``wait()`` returns its result."""
        x = self._tensor("alltoall_v", x)
        send, recv, out_size = self._counts(x, send_counts, recv_counts, out_size)
        out = torch.zeros(out_size, dtype=x.dtype, device=x.device)
        m, h = self._module, self._handle
        return self._submit("alltoall_v", lambda s: m.alltoall_v(h, x, send, out, recv, s), out, (x, out))

    def send_recv_async(self, x: torch.Tensor, peers: Sequence[int]) -> Work:
        """Issue :meth:`send_recv`; ``wait()`` returns its result."""
        x = self._tensor("send_recv", x)
        peers = self._peers(peers)
        out = self._empty((len(peers), *x.shape), x)
        if not peers:
            return _DoneWork(out)
        m, h = self._module, self._handle
        return self._submit("send_recv", lambda s: m.send_recv(h, x, out, peers, s), out, (x, out))

    def barrier_async(self) -> Work:
        """Issue :meth:`barrier`; ``wait()`` returns ``None``."""
        m, h = self._module, self._handle
        return self._submit("barrier", lambda s: m.barrier(h, s), None)

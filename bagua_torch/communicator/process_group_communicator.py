"""The communicator protocol over a ``torch.distributed`` process group (gloo, nccl)."""

from __future__ import annotations

import atexit
import ctypes
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bagua_common.comm.timeout import timeout_seconds
from bagua_common.fault_tolerance.errors import MembershipChanged
from bagua_torch.communicator.abandon import wait_or_abandon
from bagua_torch.communicator.base import CommunicatorBase
from bagua_torch.communicator.protocol import (
    CommunicationError,
    DoneWork,
    ReduceOp,
    Work,
)

# torch 2.13 renamed the one-tensor collectives and deprecated the old names (a FutureWarning
# on every call); the oldest torch supported has only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# How often and how long await_gloo_releases looks whether gloo has let go of the tensors; it
# normally has within microseconds, the limit only keeps the exit from waiting on a collective
# that is still running (never waited for) or on a gloo barrier left pending on a shared group.
_RELEASE_POLL_S = 1e-4
_RELEASE_LIMIT_S = 1.0

_still_held_by_gloo: list[weakref.ref] = []
"""The lent aliases of collectives waited for while a gloo thread still held them."""
_still_held_lock = threading.Lock()  # collectives are waited for on several threads (e.g. ordered workers)
_abandoned_for_good: list[torch.Tensor] = []
"""The lent aliases of collectives a fault-tolerant job abandoned, never freed (one step's buckets per change of
members). Gloo finishes such a collective only when a peer's process ends, maybe while this one finalizes its
interpreter; were their Python objects freed then, gloo's thread would take the GIL and abort the process."""
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_abandoned_for_good))

Lend = Callable[[torch.Tensor], torch.Tensor]


def _lender() -> tuple[Lend, list[weakref.ref]]:
    """``lend`` and weak references to what it lent: ``lend(t)`` is a fresh alias of ``t`` (same memory)."""
    lent: list[weakref.ref] = []

    def lend(t: torch.Tensor) -> torch.Tensor:
        alias = t.detach()
        lent.append(weakref.ref(alias))
        return alias

    return lend, lent


def _lend_rows(lend: Lend, rows: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
    """The root's rows of a gather or scatter, lent (None off the root)."""
    return None if rows is None else [lend(r) for r in rows]


def await_gloo_releases() -> None:
    """Let gloo's worker threads release the tensors of every collective waited for so far (called at exit).

    A gloo worker thread drops its reference to a collective just after waking the waiter. If that
    reference is the last, the thread takes the GIL to release the tensors' Python objects; should
    the interpreter be finalizing by then, Python ends that thread with ``pthread_exit`` inside a
    C++ destructor and the process aborts ("terminate called without an active exception"). Sleeping
    here, before finalization, lets the threads take the GIL while they still can.
    """
    deadline = time.monotonic() + _RELEASE_LIMIT_S
    while any(ref() is not None for ref in _still_held_by_gloo) and time.monotonic() < deadline:
        time.sleep(_RELEASE_POLL_S)
    _still_held_by_gloo.clear()


atexit.register(await_gloo_releases)


def _registered(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` was made by ``torch.distributed`` (``new_group``), not built directly on a store."""
    return dist.is_available() and dist.is_initialized() and group in dist.distributed_c10d._world.pg_map


def _torch_op(op: str) -> Any:
    return {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op]


class _TorchWork:
    """Wraps the ``torch.distributed`` work objects of one collective.

    ``lent`` are weak references to the aliases of the tensors handed to ``torch.distributed``
    (see :meth:`ProcessGroupCommunicator._issue`): only torch's references keep them alive.
    """

    def __init__(
        self,
        comm: ProcessGroupCommunicator,
        op: str,
        works: list[Any],
        result: torch.Tensor | None,
        finish: Callable[[torch.Tensor | None], torch.Tensor | None] | None = None,
        lent: Sequence[weakref.ref] = (),
    ):
        self._comm, self._op, self._works = comm, op, works
        self._result, self._finish, self._lent = result, finish, lent
        self._done = False
        # A fault-tolerant job's collective may be abandoned: its tensors are kept until it is seen finished.
        self._kept = [t for t in (ref() for ref in lent) if t is not None] if comm.abandon is not None else []

    def __del__(self) -> None:
        if self._kept:  # never seen finished (abandoned, or dropped by a reducer): gloo may finish it any time
            _abandoned_for_good.extend(self._kept)

    def wait(self) -> torch.Tensor | None:
        if not self._done:
            self._wait_works()
            if self._finish is not None:
                self._result = self._finish(self._result)
            self._done = True
        return self._result

    def _wait_works(self) -> None:
        timeout = timedelta(seconds=self._comm.timeout)
        works = self._works
        if self._comm.abandon is not None:
            comm = self._comm
            where = comm._where(self._op)
            works = comm._guard(
                self._op,
                lambda: wait_or_abandon(works, comm.abandon, comm.timeout, comm.group, comm.backend, where),
                waiting=True,
            )
        for work in works:
            self._comm._guard(self._op, lambda work=work: work.wait(timeout), waiting=True)
        self._works = []  # finished: only torch's own references to them are left
        self._kept = []
        if self._comm.backend == "gloo":
            held = [ref for ref in self._lent if ref() is not None]
            if held:  # a worker thread has yet to let go: await_gloo_releases waits for it at exit
                with _still_held_lock:
                    _still_held_by_gloo[:] = [ref for ref in _still_held_by_gloo if ref() is not None] + held

    def is_completed(self) -> bool:
        return self._done or all(work.is_completed() for work in self._works)


class ProcessGroupCommunicator(CommunicatorBase):
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
    root, and ``alltoall_v`` pads it with zeros, as the protocol requires. On gloo, the
    interpreter's exit first waits for gloo's threads to let go of the tensors of the
    collectives waited for (see :func:`await_gloo_releases`).
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        timeout: float | timedelta | None = None,
        name: str | None = None,
        *,
        abandon: threading.Event | None = None,
    ):
        self._standalone = group is not None and not _registered(group)
        if self._standalone:  # a group of a fault-tolerant job's epoch, made outside torch.distributed's registry
            self._backend, self._rank, self._size = group.name(), group.rank(), group.size()
        else:
            if not dist.is_available() or not dist.is_initialized():
                raise RuntimeError(
                    "ProcessGroupCommunicator needs torch.distributed; call dist.init_process_group() first"
                )
            self._backend = str(dist.get_backend(group))
            self._rank = dist.get_rank(group)
            if self._rank < 0:
                raise ValueError("this process is not a member of the given process group")
            self._size = dist.get_world_size(group)
        self._group = group
        if name is None:
            name = "world" if group is None else f"group {getattr(group, 'group_name', '') or id(group)}"
        self._name = name
        self._kind = f"torch.distributed {self._backend}"
        self.timeout = timeout_seconds(timeout)
        self.abandon = abandon
        """Set when the members of a fault-tolerant job change: a wait then raises ``MembershipChanged``."""
        self.dedicated: Callable[[str], ProcessGroupCommunicator] | None = None
        """How to make a group of the same ranks for a purpose, for a group made outside torch.distributed's
        registry (see :func:`~bagua_torch.communicator.dedicated_communicator`)."""
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

    def _peer(self, keyword: str, rank: int) -> dict[str, int]:
        """``{keyword: global rank}`` naming group rank ``rank`` to ``torch.distributed`` (``dst``, ``src``), or
        ``{group_<keyword>: rank}`` for a group outside its registry."""
        if self._standalone:
            return {f"group_{keyword}": rank}
        return {keyword: rank if self._group is None else dist.get_global_rank(self._group, rank)}

    def _guard(self, op: str, call: Callable[[], Any], waiting: bool = False) -> Any:
        try:
            return call()
        except MembershipChanged:  # abandoned: not a failure of this communicator
            raise
        except RuntimeError as error:  # DistBackendError, gloo and timeout errors
            note = (
                f" (waited at most {self.timeout:g} s; a peer may have died or not entered the same collective)"
                if waiting
                else ""
            )
            raise CommunicationError(f"{self._where(op)} failed{note}: {error}") from error

    def _issue(self, op: str, call: Callable[[Lend], Any], result: torch.Tensor | None, finish=None) -> _TorchWork:
        """Start ``call(lend)``, which passes every tensor it gives ``torch.distributed`` through ``lend``.

        ``lend(t)`` is a fresh alias of ``t`` that nothing of ours keeps, so that the returned
        work can tell when torch has let go of it (see :func:`await_gloo_releases`).
        """
        if self.abandon is not None and self.abandon.is_set():
            raise MembershipChanged(f"{self._where(op)} was not issued: the members changed")
        lend, lent = _lender()
        work = self._guard(op, lambda: call(lend))
        works = work if isinstance(work, list) else [work]
        return _TorchWork(self, op, [w for w in works if w is not None], result, finish, lent)

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
            lambda lend: dist.all_reduce(lend(out), op=self._sum_op(op), group=self._group, async_op=True),
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
            lambda lend: dist.reduce(
                lend(out), op=self._sum_op(op), group=self._group, async_op=True, **self._peer("dst", root)
            ),
            out,
            finish,
        )

    def broadcast_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`broadcast`; ``wait()`` returns its result."""
        x = self._tensor("broadcast", x)
        root = self._root("broadcast", root)
        out = x.clone()
        return self._issue(
            "broadcast",
            lambda lend: dist.broadcast(lend(out), group=self._group, async_op=True, **self._peer("src", root)),
            out,
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
            lend, lent = _lender()
            try:
                work = _reduce_scatter_single(
                    lend(out.view(-1)), lend(x.view(-1)), op=self._sum_op(op), group=self._group, async_op=True
                )
                self._has_reduce_scatter = True
                return _TorchWork(self, "reduce_scatter", [work], out, average, lent)
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
            lambda lend: dist.all_reduce(lend(full), op=self._sum_op(op), group=self._group, async_op=True),
            full,
            finish,
        )

    def allgather_async(self, x: torch.Tensor) -> Work:
        """Issue :meth:`allgather`; ``wait()`` returns its result."""
        x = self._tensor("allgather", x)
        out = torch.empty((self._size, *x.shape), dtype=x.dtype, device=x.device)
        return self._issue(
            "allgather",
            lambda lend: _all_gather_single(lend(out.view(-1)), lend(x.view(-1)), group=self._group, async_op=True),
            out,
        )

    def gather_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`gather`; ``wait()`` returns its result."""
        x = self._tensor("gather", x)
        root = self._root("gather", root)
        out = torch.zeros((self._size, *x.shape), dtype=x.dtype, device=x.device)
        return self._issue_rooted("gather", dist.gather, "dst", root, x, out, out=out)

    def scatter_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`scatter`; ``wait()`` returns its result."""
        rows = self._rows("scatter", self._tensor("scatter", x))
        out = torch.empty(rows.shape[1:], dtype=rows.dtype, device=rows.device)
        return self._issue_rooted("scatter", dist.scatter, "src", self._root("scatter", root), out, rows, out=out)

    def _issue_rooted(
        self,
        name: str,
        collective: Callable[..., Any],
        keyword: str,
        root: int,
        tensor: torch.Tensor,
        rows: torch.Tensor,
        *,
        out: torch.Tensor,
    ) -> Work:
        """Issue ``dist.gather`` or ``dist.scatter`` (``collective``) between this rank's ``tensor`` and the rows of
        ``rows`` on ``root``; ``wait()`` returns ``out`` (the receiving one of the two)."""
        root_rows = list(rows.unbind(0)) if self._rank == root else None
        return self._issue(
            name,
            lambda lend: collective(
                lend(tensor), _lend_rows(lend, root_rows), group=self._group, async_op=True, **self._peer(keyword, root)
            ),
            out,
        )

    def alltoall_async(self, x: torch.Tensor) -> Work:
        """Issue :meth:`alltoall`; ``wait()`` returns its result."""
        x = self._rows("alltoall", self._tensor("alltoall", x))
        out = torch.empty_like(x)
        return self._issue(
            "alltoall",
            lambda lend: dist.all_to_all_single(lend(out), lend(x), group=self._group, async_op=True),
            out,
        )

    def alltoall_v_async(
        self, x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], out_size: int
    ) -> Work:
        """Issue :meth:`alltoall_v`; ``wait()`` returns its result."""
        x, send, recv, out = self._alltoall_v_operands(x, send_counts, recv_counts, out_size)
        return self._issue(
            "alltoall_v",
            lambda lend: dist.all_to_all_single(
                lend(out[: sum(recv)]),
                lend(x[: sum(send)]),
                output_split_sizes=recv,
                input_split_sizes=send,
                group=self._group,
                async_op=True,
            ),
            out,
        )

    def send_recv_async(self, x: torch.Tensor, peers: Sequence[int]) -> Work:
        """Issue :meth:`send_recv` (one batch of point-to-point operations); ``wait()`` returns its result."""
        x = self._tensor("send_recv", x)
        peers = self._peers(peers)
        out = torch.empty((len(peers), *x.shape), dtype=x.dtype, device=x.device)
        if not peers:
            return DoneWork(out)

        def exchange(lend: Lend) -> list[Any]:
            ops = []
            for i, peer in enumerate(peers):
                # The i-th exchange with a given peer uses tag i on both sides (repeated peers pair in order).
                tag = peers[:i].count(peer)
                if self._standalone:  # torch.distributed's point-to-point calls need a registered group
                    ops += [self._group.recv([lend(out[i])], peer, tag), self._group.send([lend(x)], peer, tag)]
                    continue
                global_peer = self._peer("peer", peer)["peer"]
                ops.append(dist.P2POp(dist.irecv, lend(out[i]), global_peer, self._group, tag))
                ops.append(dist.P2POp(dist.isend, lend(x), global_peer, self._group, tag))
            return ops if self._standalone else dist.batch_isend_irecv(ops)

        return self._issue("send_recv", exchange, out)

    def barrier_async(self) -> Work:
        """Issue :meth:`barrier`; ``wait()`` returns ``None``."""
        return self._issue("barrier", lambda lend: dist.barrier(group=self._group, async_op=True), None)

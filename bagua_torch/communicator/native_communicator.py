"""The communicator protocol over Bagua's native engines (MPI, NCCL) through DLPack."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from bagua_common.comm.engines import MpiSettings, load_engine, mpi_ring_min_bytes
from bagua_common.comm.timeout import timeout_seconds
from bagua_torch.communicator.base import CommunicatorBase
from bagua_torch.communicator.protocol import (
    CommunicationError,
    DoneWork,
    ReduceOp,
    Work,
)
from bagua_torch.ordered_worker import OrderedWorker

_ENGINE_DEVICES = {"mpi": "cpu", "nccl": "cuda"}
_store_sequence = itertools.count()  # communicators created from a store, in call order


class NativeCommunicator(CommunicatorBase, MpiSettings):
    """The communicator protocol over Bagua's native engines, through DLPack.

    One communicator uses one engine: MPI for CPU tensors (:meth:`mpi_world`, under
    ``mpiexec``) or NCCL for CUDA tensors (:meth:`from_store`). Collectives run on
    one worker thread per communicator (:attr:`ordered_worker`; a child split with
    ``share_thread=True`` uses its parent's), so the asynchronous variants overlap with
    the caller and every collective, sync or async, is issued in call order; one issued
    from a job running on that thread runs at once, inline. CUDA
    collectives run on a side stream that first waits for the caller's current
    stream; ``wait()`` then orders the caller's current stream after them (no host
    synchronization). Each collective completes or raises
    :class:`CommunicationError` within ``timeout`` seconds, the message naming the
    communicator, the operation and the rank; after such an error the communicator
    is unusable. NCCL enqueues without waiting for the device, so a CUDA collective
    that fails after being enqueued (its watchdog aborts the communicator at the
    timeout) is reported by the next call on the communicator.

    Attributes (read them, do not set them): ``engine``, ``"mpi"`` or ``"nccl"``; ``handle``,
    the engine's integer handle of this communicator; ``timeout``, in seconds.
    """

    def __init__(
        self,
        handle: int,
        engine: str,
        timeout: float,
        name: str,
        device: torch.device | None = None,
        worker: OrderedWorker | None = None,
    ):
        """Wrap an engine ``handle`` (use :meth:`mpi_world`, :meth:`from_store` or :meth:`split`); ``worker`` is the
        thread to issue its collectives on (default: a thread of its own)."""
        self._module = load_engine(engine)
        self.engine = engine
        self.handle = int(handle)
        self._rank = int(self._module.rank(self.handle))
        self._size = int(self._module.size(self.handle))
        self._name = name
        self._kind = engine.upper()
        self.timeout = float(timeout)
        self._device_type = _ENGINE_DEVICES[engine]
        self._device = device if device is not None else torch.device(self._device_type)
        self._issue_lock = threading.Lock()
        self._worker = worker if worker is not None else OrderedWorker(name, self._device)
        self._closed = False

    @property
    def ordered_worker(self) -> OrderedWorker:
        """The thread that issues this communicator's collectives, in call order.

        A job submitted to it runs after every collective issued before, and the collectives
        it issues on this communicator (or on one sharing the thread) run inline, in its order.
        """
        return self._worker

    # --- construction -------------------------------------------------------------

    @classmethod
    def mpi_world(cls, timeout: float | timedelta | None = None, name: str = "world") -> NativeCommunicator:
        """All ranks of the MPI job (a duplicate of ``MPI_COMM_WORLD``), for CPU tensors.

        Start the processes with ``mpiexec``; MPI is initialized on first use and
        finalized at exit. ``timeout`` defaults to ``BAGUA_COMM_TIMEOUT`` or 300 seconds.
        """
        seconds = timeout_seconds(timeout)
        handle = load_engine("mpi").world(name, seconds)
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
        nccl = load_engine("nccl")
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

    def split(self, color: int, key: int, name: str | None = None, *, share_thread: bool = False) -> NativeCommunicator:
        """The ranks with the same ``color`` (>= 0), ordered by ``key`` (ties by rank).

        Every rank of this communicator must call it, in the same order as its
        collectives (it runs on the worker thread behind any queued collective). The
        child has this communicator's engine, device and timeout; ``name`` defaults
        to ``"<parent name>/<color>"``. With ``share_thread`` the child issues its
        collectives on this communicator's thread, in one order with this one's (a pipeline
        over both then crosses no second thread; the two levels of a hierarchical job);
        without it, on a thread of its own (collectives issued concurrently from another
        thread, as background averaging does, then never wait behind this one's).
        """
        color, key = int(color), int(key)
        if color < 0:
            raise ValueError(f"split: color must be non-negative, got {color}")
        name = name if name is not None else f"{self._name}/{color}"

        def split() -> int:
            try:
                return self._module.split(self.handle, color, key, name)
            except RuntimeError as error:
                raise CommunicationError(f"{self._where('split')}: {error}") from error

        handle = self._run_ordered(split)
        worker = self._worker if share_thread else None
        return NativeCommunicator(handle, self.engine, self.timeout, name, self._device, worker)

    # --- the MPI engine's settings --------------------------------------------------

    def _engine_state(self) -> tuple[str, ModuleType, int, str]:
        return self.engine, self._module, self.handle, f"communicator {self._name!r}"

    def set_mpi_ring_min_bytes(self, value: int) -> None:
        """Set :attr:`mpi_ring_min_bytes` for the collectives issued after this call (it waits for those
        issued before). Every rank must set the same value at the same point of its collectives."""
        value = mpi_ring_min_bytes(value, self.engine, f"communicator {self._name!r}")
        module, handle = self._module, self.handle
        self._run_ordered(lambda: module.set_ring_min_bytes(handle, value))

    def close(self) -> None:
        """Wait for queued collectives, stop the worker thread and release the engine handle."""
        if self._closed:
            return
        self._closed = True
        self._worker.close()
        self._module.destroy(self.handle)

    def __enter__(self) -> NativeCommunicator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

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
        """Run ``call`` on the worker thread after every collective issued so far (at once if on it)."""
        work = None
        with self._issue_lock:
            if self._closed:
                raise RuntimeError(f"communicator '{self._name}' is closed")
            if not self._worker.is_current():
                work = self._worker.submit(lambda stream: call())
        return work.wait() if work is not None else call()

    def _submit(
        self,
        op: str,
        call: Callable[[int], None],
        result: torch.Tensor | None,
        tensors: Sequence[torch.Tensor] = (),
        finish: Callable[[], None] | None = None,
    ) -> Work:
        """Queue ``call(stream)`` on the worker thread (from a job of that thread: run it now); ``finish`` runs
        after it."""
        where = self._where(op)

        def translate(error: RuntimeError) -> CommunicationError:
            text = str(error).removeprefix("bagua ")
            return CommunicationError(text if f"'{self._name}'" in text else f"{where}: {text}")

        with self._issue_lock:
            if self._closed:
                raise RuntimeError(f"{where}: the communicator is closed")

            def run(stream: int) -> torch.Tensor | None:
                try:
                    call(stream)
                except RuntimeError as error:
                    raise translate(error) from error
                if finish is not None:
                    finish()
                return result

            if not self._worker.is_current():
                return self._worker.submit(run, tensors)
        # A job of the worker's own thread, so every earlier collective is done; it runs on the
        # job's stream, the current one (outside the lock: issuing from other threads goes on).
        cuda = self._device.type == "cuda"
        return DoneWork(run(torch.cuda.current_stream(self._device).cuda_stream if cuda else 0))

    def _empty(self, shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=like.dtype, device=like.device)

    # --- the collectives ----------------------------------------------------------

    def allreduce_async(self, x: torch.Tensor, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`allreduce`; ``wait()`` returns its result."""
        x = self._tensor("allreduce", x)
        code = self._reduce_op("allreduce", op, x).code
        out = self._empty(x.shape, x)
        m, h = self._module, self.handle
        return self._submit("allreduce", lambda s: m.allreduce(h, x, out, code, s), out, (x, out))

    def reduce_async(self, x: torch.Tensor, root: int, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`reduce`; ``wait()`` returns its result."""
        x = self._tensor("reduce", x)
        code = self._reduce_op("reduce", op, x).code
        root = self._root("reduce", root)
        out = self._empty(x.shape, x)
        m, h = self._module, self.handle
        finish = out.zero_ if self._rank != root else None
        return self._submit("reduce", lambda s: m.reduce(h, x, out, code, root, s), out, (x, out), finish)

    def broadcast_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`broadcast`; ``wait()`` returns its result."""
        x = self._tensor("broadcast", x)
        root = self._root("broadcast", root)
        out = x.clone()
        m, h = self._module, self.handle
        return self._submit("broadcast", lambda s: m.broadcast(h, out, root, s), out, (out,))

    def reduce_scatter_async(self, x: torch.Tensor, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`reduce_scatter`; ``wait()`` returns its result."""
        x = self._rows("reduce_scatter", self._tensor("reduce_scatter", x))
        code = self._reduce_op("reduce_scatter", op, x).code
        out = self._empty(x.shape[1:], x)
        m, h = self._module, self.handle
        return self._submit("reduce_scatter", lambda s: m.reduce_scatter(h, x, out, code, s), out, (x, out))

    def allgather_async(self, x: torch.Tensor) -> Work:
        """Issue :meth:`allgather`; ``wait()`` returns its result."""
        x = self._tensor("allgather", x)
        out = self._empty((self._size, *x.shape), x)
        m, h = self._module, self.handle
        return self._submit("allgather", lambda s: m.allgather(h, x, out, s), out, (x, out))

    def gather_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`gather`; ``wait()`` returns its result."""
        x = self._tensor("gather", x)
        root = self._root("gather", root)
        out = self._empty((self._size, *x.shape), x)
        m, h = self._module, self.handle
        finish = out.zero_ if self._rank != root else None
        return self._submit("gather", lambda s: m.gather(h, x, out, root, s), out, (x, out), finish)

    def scatter_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`scatter`; ``wait()`` returns its result."""
        x = self._rows("scatter", self._tensor("scatter", x))
        root = self._root("scatter", root)
        out = self._empty(x.shape[1:], x)
        m, h = self._module, self.handle
        return self._submit("scatter", lambda s: m.scatter(h, x, out, root, s), out, (x, out))

    def alltoall_async(self, x: torch.Tensor) -> Work:
        """Issue :meth:`alltoall`; ``wait()`` returns its result."""
        x = self._rows("alltoall", self._tensor("alltoall", x))
        out = self._empty(x.shape, x)
        m, h = self._module, self.handle
        return self._submit("alltoall", lambda s: m.alltoall(h, x, out, s), out, (x, out))

    def alltoall_v_async(
        self, x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], out_size: int
    ) -> Work:
        """Issue :meth:`alltoall_v`; ``wait()`` returns its result."""
        x, send, recv, out = self._alltoall_v_operands(x, send_counts, recv_counts, out_size)
        m, h = self._module, self.handle
        return self._submit("alltoall_v", lambda s: m.alltoall_v(h, x, send, out, recv, s), out, (x, out))

    def send_recv_async(self, x: torch.Tensor, peers: Sequence[int]) -> Work:
        """Issue :meth:`send_recv`; ``wait()`` returns its result."""
        x = self._tensor("send_recv", x)
        peers = self._peers(peers)
        out = self._empty((len(peers), *x.shape), x)
        if not peers:
            return DoneWork(out)
        m, h = self._module, self.handle
        return self._submit("send_recv", lambda s: m.send_recv(h, x, out, peers, s), out, (x, out))

    def barrier_async(self) -> Work:
        """Issue :meth:`barrier`; ``wait()`` returns ``None``."""
        m, h = self._module, self.handle
        return self._submit("barrier", lambda s: m.barrier(h, s), None)

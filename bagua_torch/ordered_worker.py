"""One worker thread that runs jobs in submission order, on a side CUDA stream for CUDA devices.

A native communicator issues its collectives through one (the two levels of a hierarchical
job share their world's), and an algorithm impl runs its multi-stage pipelines on the same
one (:meth:`~bagua_torch.algorithms.AlgorithmImpl.run_async`); the collectives a job issues on
its own worker's communicators run at once, inline, so each crosses one thread. Jobs of one
worker never overlap, so the collectives they issue keep every rank's order. Over
``torch.distributed``, whose collectives need no thread of ours, an impl has a worker of its own.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch


class WorkerWork:
    """The handle of one job of :meth:`OrderedWorker.submit` (a :class:`~bagua_torch.Work`)."""

    def __init__(
        self,
        future: concurrent.futures.Future,
        done: Any = None,
        device: torch.device | None = None,
    ):
        self._future, self._done, self._device = future, done, device

    def wait(self) -> Any:
        """The job's return value (or its exception); a CUDA caller's stream waits for the job."""
        result = self._future.result()
        if self._done is not None:
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(self._done)
            if isinstance(result, torch.Tensor) and result.is_cuda:
                result.record_stream(stream)  # made on the side stream, used on this one
        return result

    def is_completed(self) -> bool:
        """Whether the job (and on CUDA its stream work) has finished."""
        if not self._future.done():
            return False
        if self._done is None or self._future.exception() is not None:
            return True
        return bool(self._done.query())


def _with_threads(job: Callable[[int], Any], threads: int, stream: int) -> Any:
    """``job(stream)`` with this thread's intra-op thread count set to the submitter's ``threads``."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return job(stream)


_thread_of = threading.local()
"""``worker``: the :class:`OrderedWorker` whose thread this is (unset on other threads)."""


class OrderedWorker:
    """Jobs run one after another on one thread, in submission order; ``name`` names the thread.

    For a CUDA ``device`` a job runs on the worker's side stream, after everything the
    submitting thread had queued on its current stream; the thread starts on first use.
    """

    def __init__(self, name: str, device: torch.device) -> None:
        self._name, self._device = name, device
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._stream: Any = None

    @property
    def device(self) -> torch.device:
        """The device whose side stream the jobs run on (CUDA), or whose tensors they use."""
        return self._device

    def is_current(self) -> bool:
        """Whether the caller runs on this worker's thread (inside one of its jobs)."""
        return getattr(_thread_of, "worker", None) is self

    def _mark_thread(self) -> None:
        _thread_of.worker = self

    def submit(self, job: Callable[[int], Any], tensors: Sequence[torch.Tensor] = ()) -> WorkerWork:
        """Queue ``job(stream)``: ``stream`` is the side stream's handle on CUDA, 0 otherwise.

        ``tensors`` (CUDA) are used by the job on the side stream: their memory is kept until
        the job's stream work is done.
        """
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    max_workers=1, thread_name_prefix=f"bagua-{self._name}", initializer=self._mark_thread
                )
            # OpenMP keeps its thread count per thread, and torch sets it on a new thread only when one of its
            # parallel loops runs there, not before an MKL matmul: without this a job's matmuls ran on every core
            # although the process chose fewer (torch.set_num_threads), several ranks spinning per core.
            threads = torch.get_num_threads()
            job = functools.partial(_with_threads, job, threads)
            if self._device.type != "cuda":
                return WorkerWork(self._executor.submit(job, 0))
            if self._stream is None:
                self._stream = torch.cuda.Stream(self._device)
            stream, device = self._stream, self._device
            ready, done = torch.cuda.Event(), torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            for t in tensors:
                t.record_stream(stream)

            def on_stream() -> Any:
                with torch.cuda.device(device), torch.cuda.stream(stream):
                    stream.wait_event(ready)
                    result = job(stream.cuda_stream)
                    done.record(stream)
                    return result

            return WorkerWork(self._executor.submit(on_stream), done, device)

    def close(self) -> None:
        """Wait for the queued jobs and stop the thread (idempotent; a later job restarts it)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)

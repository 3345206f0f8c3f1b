"""The reducer: which buckets' gradients have arrived, launching them in order, waiting for them.

The module wrapper (:mod:`bagua_torch.bagua_module`) decides *whether* an iteration reduces
gradients; the :class:`Reducer` does it, as the reducer of torch's DDP does:

* when autograd has accumulated a parameter's gradient, it is copied into its bucket (unless
  it already lives there, see below); a bucket whose gradients have all arrived is handed to
  the algorithm (``reduce_bucket``), which starts communicating at once while the backward
  pass goes on. Buckets are launched in the fixed order 0, 1, 2, ... on every rank: a bucket
  that is ready early waits for the ones before it;
* at the end of the backward pass, gradients that never arrived (parameters unused in this
  iteration, on this rank) are taken as zeros and their buckets launched, so every rank issues
  the same collectives and nothing hangs;
* :meth:`Reducer.wait` waits for the buckets in order and writes the reduced gradients into
  ``.grad``: at the end of the backward pass (``sync_point="backward"``) or when the wrapper
  asks (``sync_point="step"``).

With :meth:`Reducer.bind_gradients_to_buckets` (what ``fuse_optimizer(optimizer, module=...)``
calls) every parameter's ``.grad`` is a view of its bucket's flat buffer, as with DDP's
``gradient_as_bucket_view``: backward accumulates straight into the bucket, and a reduced
result the algorithm hands over (:attr:`~bagua_torch.algorithms.base.AlgorithmImpl.results_are_fresh`)
becomes the bucket's buffer, the gradients re-pointed at it. No gradient byte is copied then;
:meth:`Reducer.stats` counts the bytes copied when one is.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch

from bagua_torch.algorithms.base import AlgorithmImpl
from bagua_torch.bucketing import Bucket
from bagua_torch.communicator import Work

__all__ = ["Reducer"]


def _queue_end_of_backward(callback) -> None:
    """Run ``callback`` when the current backward pass ends (must be called from inside it)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


class Reducer:
    """Bucket launch state of one wrapped model (see the module docstring).

    ``enabled`` (set by the wrapper at each forward) says whether the next backward pass
    reduces gradients. Setting ``events = []`` records ``(kind, bucket_index,
    time.perf_counter())`` tuples, kinds ``"ready"`` (all gradients of the bucket arrived),
    ``"launch"``, ``"backward_end"`` (index -1) and ``"done"`` (its result written into ``.grad``).
    """

    def __init__(self, buckets: Sequence[Bucket], algorithm_impl: AlgorithmImpl, *, wait_at_backward_end: bool):
        self.buckets = tuple(buckets)
        self.algorithm_impl = algorithm_impl
        self.wait_at_backward_end = wait_at_backward_end
        self.enabled = bool(algorithm_impl.need_gradient_hooks)
        self.events: list[tuple[str, int, float]] | None = None
        self.gradients_in_buckets = False
        self._grad_views = [bucket.views(bucket.grad) for bucket in self.buckets]
        self._slot: dict[int, tuple[int, int]] = {
            id(p): (bucket.index, i) for bucket in self.buckets for i, p in enumerate(bucket.params)
        }
        self._bytes_copied = 0
        # Iteration state, guarded by _lock (hooks may run on autograd's threads).
        self._lock = threading.RLock()
        self._in_iteration = False
        self._backward_done = False
        self._ready = [[False] * len(b.params) for b in self.buckets]
        self._missing = [len(b.params) for b in self.buckets]
        self._next_launch = 0
        self._works: list[Work | None] = [None] * len(self.buckets)
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for b in self.buckets for p in b.params]

    # --- gradients as views of the buckets ----------------------------------------------

    def bind_gradients_to_buckets(self) -> None:
        """Make every parameter's ``.grad`` a view of its bucket's buffer from now on (values kept)."""
        with self._lock:
            self.wait()
            with torch.no_grad():
                for bucket, views in zip(self.buckets, self._grad_views):
                    for p, view in zip(bucket.params, views):
                        if p.grad is None:
                            view.zero_()
                        elif p.grad.data_ptr() != view.data_ptr():
                            view.copy_(p.grad)
                        p.grad = view
            self.gradients_in_buckets = True

    def grad_views(self, bucket: Bucket) -> list[torch.Tensor]:
        """The current views of ``bucket.grad`` shaped like its parameters (re-made when the buffer changes)."""
        return self._grad_views[bucket.index]

    def stats(self) -> dict[str, int]:
        """``bytes_copied``: gradient bytes copied into or out of the buckets so far."""
        return {"bytes_copied": self._bytes_copied}

    # --- backward: gradients become ready, buckets launch in order ---------------------

    def _record(self, kind: str, index: int) -> None:
        if self.events is not None:
            self.events.append((kind, index, time.perf_counter()))

    def _grad_ready(self, param: torch.Tensor) -> None:
        if not self.enabled:
            return
        with self._lock:
            k, i = self._slot[id(param)]
            if not self._in_iteration:
                self._start_iteration()
            elif self._backward_done:
                raise RuntimeError(
                    "a second backward pass before the gradients of the first were synchronized "
                    "(sync_point='step'); call model.wait_gradients() between them, or run the first one under "
                    "model.no_sync()"
                )
            if self._ready[k][i]:
                raise RuntimeError(
                    f"parameter {self.buckets[k].names[i]} received a gradient twice in one backward pass; "
                    "reentrant checkpointing (torch.utils.checkpoint with use_reentrant=True) is not supported, "
                    "use use_reentrant=False"
                )
            bucket = self.buckets[k]
            grad = param.grad
            if grad is None:  # pragma: no cover (autograd always sets it before this hook)
                return
            if grad.is_sparse:
                raise RuntimeError(
                    f"parameter {bucket.names[i]} has a sparse gradient; sparse gradients are not supported"
                )
            view = self._grad_views[k][i]
            if grad.data_ptr() != view.data_ptr():
                with torch.no_grad():
                    view.copy_(grad)
                self._bytes_copied += view.nbytes
                if self.gradients_in_buckets:
                    param.grad = view
            self._ready[k][i] = True
            self._missing[k] -= 1
            if self._missing[k] == 0:
                self._record("ready", k)
            self._launch_ready()

    def _start_iteration(self) -> None:
        self._in_iteration = True
        self._backward_done = False
        self._ready = [[False] * len(b.params) for b in self.buckets]
        self._missing = [len(b.params) for b in self.buckets]
        self._next_launch = 0
        self._works = [None] * len(self.buckets)
        _queue_end_of_backward(self._backward_end)

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self._missing[self._next_launch] == 0:
            k = self._next_launch
            bucket = self.buckets[k]
            bucket.grad[bucket.numel :].zero_()
            weighed_out = self.algorithm_impl.weighed_out
            if weighed_out is not None and not weighed_out.contributes:
                bucket.grad.zero_()
            self._record("launch", k)
            work = self.algorithm_impl.reduce_bucket(bucket)
            if work is None or not hasattr(work, "wait"):
                raise TypeError(
                    f"{type(self.algorithm_impl).__name__}.reduce_bucket() must return a Work, got "
                    f"{type(work).__name__}"
                )
            self._works[k] = work
            self._next_launch += 1

    def _fill_missing(self) -> None:
        """Zeros for the gradients that never arrived, then launch every remaining bucket (in order)."""
        for k in range(self._next_launch, len(self.buckets)):
            if self._missing[k]:
                views = self._grad_views[k]
                with torch.no_grad():
                    for i, ready in enumerate(self._ready[k]):
                        if not ready:
                            views[i].zero_()
                            self._ready[k][i] = True
                self._missing[k] = 0
        self._launch_ready()

    def _backward_end(self) -> None:
        with self._lock:
            if not self._in_iteration or self._backward_done:
                return
            self._record("backward_end", -1)
            self._fill_missing()
            self._backward_done = True
            if self.wait_at_backward_end:
                self._finish()

    # --- sync point ---------------------------------------------------------------------

    def _finish(self) -> None:
        """Wait for every bucket in order and write the results into ``.grad``."""
        self._fill_missing()
        weighed_out = self.algorithm_impl.weighed_out
        try:
            for k, work in enumerate(self._works):
                result = work.wait() if work is not None else None
                if weighed_out is not None:
                    result = (self.buckets[k].grad if result is None else result) * weighed_out.scale
                if result is not None:
                    self._write_result(self.buckets[k], result)
                self._record("done", k)
        finally:
            self._in_iteration = False
            self._backward_done = False
            self._works = [None] * len(self.buckets)
            self.algorithm_impl.weighed_out = None

    def _write_result(self, bucket: Bucket, result: torch.Tensor) -> None:
        if not self.gradients_in_buckets:
            bucket.unflatten_to_grads(result)
            self._bytes_copied += bucket.numel * bucket.grad.element_size()
            return
        if result.data_ptr() == bucket.grad.data_ptr():
            return
        if (
            self.algorithm_impl.results_are_fresh
            and result.dim() == 1
            and result.is_contiguous()
            and result.numel() == bucket.size
            and result.dtype == bucket.dtype
            and result.device == bucket.device
        ):
            bucket.grad = result
            views = self._grad_views[bucket.index] = bucket.views(result)
            for p, view in zip(bucket.params, views):
                p.grad = view
            return
        with torch.no_grad():
            bucket.grad[: result.numel()].copy_(result)
        self._bytes_copied += result.nbytes
        for p, view in zip(bucket.params, self._grad_views[bucket.index]):
            p.grad = view

    def wait(self) -> None:
        """Finish any pending gradient reduction and write the results into ``.grad`` (a no-op if none)."""
        with self._lock:
            if self._in_iteration:
                self._finish()

    def discard(self) -> None:
        """Drop the iteration in flight without waiting for its work (abandoned: the members of a fault-tolerant
        job changed) and remove the gradient hooks; this reducer is not used again."""
        with self._lock:
            self._in_iteration = False
            self._backward_done = False
            self._works = [None] * len(self.buckets)
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def close(self) -> None:
        """Finish pending work and remove the gradient hooks."""
        self.wait()
        for handle in self._handles:
            handle.remove()
        self._handles = []

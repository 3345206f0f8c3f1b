"""Data-parallel training of a ``torch.nn.Module`` with a Bagua algorithm.

``with_bagua(model, [optimizer], algorithm)`` (Bagua's API) and
``DistributedDataParallel(model, ...)`` (the arguments of
``torch.nn.parallel.DistributedDataParallel``) both return a :class:`BaguaModule`: an
``nn.Module`` that holds the user's model as ``.module`` and trains it data-parallel.
Nothing is monkey-patched: the wrapper uses public hooks only
(``Tensor.register_post_accumulate_grad_hook``, ``Optimizer.register_step_pre_hook`` /
``register_step_post_hook``, an autograd end-of-backward callback, and
``nn.Module.get_extra_state`` for checkpoints).

What happens, in order (the algorithm's side is described in
:mod:`bagua_torch.algorithms.base`):

* On wrap: every rank checks that it wraps the same model (names, shapes, dtypes) with
  the same algorithm and bucket size as rank 0, then parameters and buffers are
  broadcast from rank 0, the trainable parameters are grouped into buckets
  (reverse registration order, at most ``bucket_bytes`` each, default 10 MiB, padded to
  a multiple of the world size) and the algorithm is built for them.
* Backward: when autograd has accumulated a parameter's gradient, it is copied into its
  bucket; a bucket whose gradients have all arrived is handed to the algorithm
  (``reduce_bucket``), which starts communicating at once (asynchronous collectives or
  a worker thread) while the backward pass goes on. Buckets are launched in the fixed
  order 0, 1, 2, ... on every rank: a bucket that is ready early waits for the ones
  before it. At the end of the backward pass, gradients that never arrived (parameters
  not used in this iteration, on this rank) are taken as zeros and their buckets
  launched, so every rank issues the same collectives and nothing hangs. A parameter
  unused on every rank ends the step with a zero gradient rather than None.
* Sync point: the wrapper waits for the buckets (in order) and writes the reduced
  gradients into ``.grad`` either at the end of the backward pass (``sync_point=
  "backward"``, the default: ``.grad`` is final when ``backward()`` returns, as with
  torch's DDP, so gradient clipping works) or at the latest possible moment, in the
  optimizer's step pre-hook (``sync_point="step"``: communication also overlaps whatever
  runs between ``backward()`` and ``step()``; call :meth:`BaguaModule.wait_gradients`
  before reading ``.grad`` yourself).
* ``no_sync()``: forwards inside it run backwards that only accumulate local gradients;
  the first backward after it reduces the accumulated gradients.
* ``state_dict()`` / ``load_state_dict()``: the model's entries (prefixed ``module.``,
  as with DDP) plus ``_extra_state``: the algorithm's name and state (residuals,
  neighbour copies, step counters), so a checkpointed run resumes identically (save
  the optimizer's ``state_dict()`` too).
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from bagua_common.signature import JobSignature, algorithm_config, check_same_job
from bagua_torch.algorithms import get_algorithm
from bagua_torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    Communicators,
)
from bagua_torch.bucketing import DEFAULT_BUCKET_BYTES, Bucket, make_buckets
from bagua_torch.communicator import Communicator, Work
from bagua_torch.job import communicators_from

SyncPoint = Literal["backward", "step"]
_EXTRA_STATE_FORMAT = 1


def _queue_end_of_backward(callback) -> None:
    """Run ``callback`` when the current backward pass ends (must be called from inside it)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def _broadcast(comm: Communicator, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
    """Overwrite ``tensors`` with ``root``'s values: one broadcast of all their bytes."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return
    flats = [t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors]
    received = comm.broadcast(torch.cat(flats), root)
    offset = 0
    with torch.no_grad():
        for t, flat in zip(tensors, flats):
            part = received[offset : offset + flat.numel()].clone()
            t.copy_(part.view(t.dtype).view(t.shape))
            offset += flat.numel()


class BaguaModule(nn.Module):
    """A model trained data-parallel with a Bagua algorithm (see the module docstring).

    Build it with :func:`with_bagua` or :class:`DistributedDataParallel`. Attributes:
    ``module`` (the user's model), ``algorithm`` (the configuration),
    ``algorithm_impl`` (its :class:`~bagua_torch.algorithms.AlgorithmImpl`),
    ``buckets`` (launch order), ``communicators``, ``optimizers``, ``sync_point``.
    Setting ``events = []`` records ``(kind, bucket_index, time.perf_counter())`` tuples,
    kinds ``"ready"`` (all gradients of the bucket arrived), ``"launch"``,
    ``"backward_end"`` (index -1) and ``"done"`` (its result written into ``.grad``).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
        algorithm: str | Algorithm = "gradient_allreduce",
        *,
        process_group: Any = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        sync_point: SyncPoint = "backward",
        broadcast_buffers: bool = False,
    ):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"the model must be a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, BaguaModule):
            raise TypeError("the model is already wrapped (a BaguaModule); wrap the inner .module instead")
        if isinstance(optimizers, torch.optim.Optimizer):
            optimizers = (optimizers,)
        if optimizers is None:
            optimizers = ()
        optimizers = tuple(optimizers)
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"optimizers must be torch.optim.Optimizer instances, got {type(opt).__name__}")
        algorithm = get_algorithm(algorithm)
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be a positive int (bytes), got {bucket_bytes!r}")
        if sync_point not in ("backward", "step"):
            raise ValueError(f"sync_point must be 'backward' or 'step', got {sync_point!r}")
        if sync_point == "step" and not optimizers:
            raise ValueError("sync_point='step' waits in the optimizer's step, so pass the optimizers to the wrapper")
        if not isinstance(broadcast_buffers, bool):
            raise TypeError(f"broadcast_buffers must be a bool, got {broadcast_buffers!r}")

        self.module = module
        self.algorithm: Algorithm = algorithm
        self.optimizers: tuple[torch.optim.Optimizer, ...] = optimizers
        self.sync_point: SyncPoint = sync_point
        self.broadcast_buffers = broadcast_buffers
        self.bucket_bytes = bucket_bytes
        self.events: list[tuple[str, int, float]] | None = None
        self.communicators: Communicators = communicators_from(process_group)
        world = self.communicators.world

        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        for name, p in module.named_parameters():
            if p.is_sparse:
                raise TypeError(f"parameter {name} is sparse; sparse parameters are not supported")
        for name, p in named:
            if not p.dtype.is_floating_point:
                raise TypeError(
                    f"parameter {name} has dtype {p.dtype}; data-parallel algorithms train real "
                    "floating-point parameters only"
                )
        devices = {p.device for _, p in module.named_parameters()} | {b.device for _, b in module.named_buffers()}
        if len(devices) > 1:
            raise ValueError(
                f"the model's parameters and buffers are on several devices ({sorted(map(str, devices))}); "
                "each process must train a model on one device"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        self._check_optimizers(named)

        # Same model, algorithm and settings everywhere? (mismatches would hang or corrupt silently)
        leaves = [(n if p.requires_grad else f"{n} (frozen)", p.shape, p.dtype) for n, p in module.named_parameters()]
        leaves += [(f"buffer {n}", b.shape, b.dtype) for n, b in module.named_buffers()]
        config = algorithm_config(algorithm, bucket_bytes=bucket_bytes, sync_point=sync_point)

        def allgather(x: np.ndarray) -> np.ndarray:
            return world.allgather(torch.from_numpy(x).to(self.device)).cpu().numpy()

        check_same_job(JobSignature.of(leaves, config), allgather)

        _broadcast(world, [p for _, p in module.named_parameters()] + [b for _, b in module.named_buffers()])

        self.buckets: tuple[Bucket, ...] = tuple(make_buckets(named, bucket_bytes, pad_to=world.size))
        self._grad_views = [bucket.views(bucket.grad) for bucket in self.buckets]  # per parameter, in each bucket
        self._slot: dict[int, tuple[int, int]] = {
            id(p): (bucket.index, i) for bucket in self.buckets for i, p in enumerate(bucket.params)
        }
        context = AlgorithmContext(
            module=module,
            optimizers=optimizers,
            communicators=self.communicators,
            buckets=self.buckets,
            named_parameters=tuple(named),
            device=self.device,
            bucket_bytes=bucket_bytes,
        )
        impl = algorithm.reify(context)
        if not isinstance(impl, AlgorithmImpl):
            raise TypeError(
                f"{type(algorithm).__name__}.reify() must return an AlgorithmImpl, got {type(impl).__name__}"
            )
        self.algorithm_impl: AlgorithmImpl = impl

        # Iteration state, guarded by _lock (hooks may run on autograd's threads).
        self._lock = threading.RLock()
        self._require_sync = True  # False inside no_sync()
        self._sync_enabled = bool(impl.need_gradient_hooks)  # decided at each forward
        self._in_iteration = False
        self._backward_done = False
        self._ready = [[False] * len(b.params) for b in self.buckets]
        self._missing = [len(b.params) for b in self.buckets]
        self._next_launch = 0
        self._works: list[Work | None] = [None] * len(self.buckets)
        self._closed = False

        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready) for _, p in named]
        for opt in optimizers:
            self._handles.append(opt.register_step_pre_hook(self._before_step))
            self._handles.append(opt.register_step_post_hook(self._after_step))

    def _check_optimizers(self, named: list[tuple[str, nn.Parameter]]) -> None:
        ours = {id(p) for _, p in named}
        for k, opt in enumerate(self.optimizers):
            for group in opt.param_groups:
                for p in group["params"]:
                    if id(p) not in ours:
                        warnings.warn(
                            f"optimizer {k} holds a tensor of shape {list(p.shape)} that is not a trainable parameter "
                            "of the wrapped model; it is not synchronized across ranks",
                            stacklevel=4,
                        )
                        return

    # --- forward ----------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            raise RuntimeError("this BaguaModule has been closed")
        if self.training and torch.is_grad_enabled():
            self.wait_gradients()  # finish a reduction still pending from the last iteration
            self._sync_enabled = self._require_sync and bool(self.algorithm_impl.need_gradient_hooks)
            if self.broadcast_buffers:
                _broadcast(self.communicators.world, list(self.module.buffers()))
            self.algorithm_impl.before_forward(self.module)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside it, forward/backward passes only accumulate local gradients (no communication).

        As with torch's DDP, put the forward pass inside the context: the first iteration
        whose forward runs outside it reduces the gradients accumulated so far.
        """
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    # --- backward: gradients become ready, buckets launch in order ---------------------

    def _record(self, kind: str, index: int) -> None:
        if self.events is not None:
            self.events.append((kind, index, time.perf_counter()))

    def _grad_ready(self, param: torch.Tensor) -> None:
        if not self._sync_enabled:
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
            with torch.no_grad():
                self._grad_views[k][i].copy_(grad)
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
            if self.sync_point == "backward":
                self._finish()

    def _finish(self) -> None:
        """Wait for every bucket in order and write the results into ``.grad``."""
        self._fill_missing()
        try:
            for k, work in enumerate(self._works):
                result = work.wait() if work is not None else None
                if result is not None:
                    self.buckets[k].unflatten_to_grads(result)
                self._record("done", k)
        finally:
            self._in_iteration = False
            self._backward_done = False
            self._works = [None] * len(self.buckets)

    def wait_gradients(self) -> None:
        """Finish any pending gradient reduction and write the results into ``.grad`` (a no-op if none)."""
        with self._lock:
            if self._in_iteration:
                self._finish()

    # --- optimizer step ---------------------------------------------------------------

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.wait_gradients()
        self.algorithm_impl.before_step(optimizer)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.algorithm_impl.after_step(optimizer)

    # --- checkpoints ------------------------------------------------------------------

    def get_extra_state(self) -> dict[str, Any]:
        """The algorithm's name and state, saved by ``state_dict()`` as ``_extra_state``."""
        self.wait_gradients()
        return {
            "format": _EXTRA_STATE_FORMAT,
            "algorithm": self.algorithm.name,
            "world_size": self.communicators.world.size,
            "bucket_sizes": [b.size for b in self.buckets],
            "algorithm_state": self.algorithm_impl.state_dict(),
        }

    def set_extra_state(self, state: Any) -> None:
        """Restore what :meth:`get_extra_state` saved (called by ``load_state_dict()``)."""
        if not isinstance(state, dict) or state.get("format") != _EXTRA_STATE_FORMAT:
            raise ValueError("the checkpoint's _extra_state was not written by a bagua_torch BaguaModule")
        if state["algorithm"] != self.algorithm.name:
            raise ValueError(
                f"the checkpoint holds the state of algorithm {state['algorithm']!r}, but this model is wrapped with "
                f"{self.algorithm.name!r}"
            )
        if state["world_size"] != self.communicators.world.size:
            raise ValueError(
                f"the checkpoint was written by {state['world_size']} ranks; this job has "
                f"{self.communicators.world.size}"
            )
        if list(state["bucket_sizes"]) != [b.size for b in self.buckets]:
            raise ValueError(
                f"the checkpoint's buckets ({list(state['bucket_sizes'])} elements) differ from this model's "
                f"({[b.size for b in self.buckets]}); wrap the same model with the same bucket_bytes"
            )
        self.wait_gradients()
        self.algorithm_impl.load_state_dict(state["algorithm_state"])

    # --- lifetime ---------------------------------------------------------------------

    def close(self) -> None:
        """Finish pending work, remove the hooks from the model and optimizers, and stop the algorithm's threads."""
        if self._closed:
            return
        self.wait_gradients()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.algorithm_impl.close()
        self._closed = True

    def extra_repr(self) -> str:
        return (
            f"algorithm={self.algorithm!r}, buckets={len(self.buckets)}, bucket_bytes={self.bucket_bytes}, "
            f"sync_point={self.sync_point!r}, world_size={self.communicators.world.size}"
        )


def with_bagua(
    model: nn.Module,
    optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
    algorithm: str | Algorithm = "gradient_allreduce",
    *,
    process_group: Any = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    sync_point: SyncPoint = "backward",
    broadcast_buffers: bool = False,
) -> BaguaModule:
    """Wrap ``model`` for data-parallel training with ``algorithm`` (a name or an Algorithm instance).

    Bagua's ``model.with_bagua(optimizers, algorithm)`` as a function (torch classes are
    not patched): ``model = bagua_torch.with_bagua(model, [optimizer], algorithm)``, then
    train with ``model(x)``, ``loss.backward()``, ``optimizer.step()`` as usual. Collective:
    every rank must call it, with the same model, in the same order. ``process_group``
    defaults to the one from :func:`bagua_torch.init_process_group`; ``bucket_bytes`` (default
    10 MiB) bounds each communication bucket; ``sync_point`` and ``broadcast_buffers``
    (each forward; buffers are always broadcast once on wrap) are described in
    :class:`BaguaModule` and the module docstring.
    """
    return BaguaModule(
        model,
        optimizers,
        algorithm,
        process_group=process_group,
        bucket_bytes=bucket_bytes,
        sync_point=sync_point,
        broadcast_buffers=broadcast_buffers,
    )


class DistributedDataParallel(BaguaModule):
    """``torch.nn.parallel.DistributedDataParallel``'s arguments, Bagua's algorithms underneath.

    ``DistributedDataParallel(model)`` averages gradients in full precision as torch's
    DDP does (GradientAllReduce); ``algorithm=`` picks another (by name or instance).
    Buffers are broadcast from rank 0 at every forward (``broadcast_buffers=True``, as in
    DDP). ``bucket_cap_mb`` sets the bucket size (default 10 MiB). Unused parameters are
    always handled, so ``find_unused_parameters`` is accepted for compatibility only, as
    are ``check_reduction``, ``gradient_as_bucket_view`` and ``static_graph``.
    ``device_ids`` / ``output_device`` may name the model's single device (one device
    per process). ``optimizers`` and ``sync_point="step"`` are Bagua extras: with them the
    wrapper waits for the gradients in the optimizer's step instead of at the end of
    the backward pass, and weight-communicating algorithms get their step hooks.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        *,
        algorithm: str | Algorithm = "gradient_allreduce",
        optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] = (),
        sync_point: SyncPoint = "backward",
    ):
        if not isinstance(module, nn.Module):
            raise TypeError(f"the model must be a torch.nn.Module, got {type(module).__name__}")
        if bucket_cap_mb is None:
            bucket_bytes = DEFAULT_BUCKET_BYTES
        else:
            if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
                raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
            bucket_bytes = max(1, int(bucket_cap_mb * 1024 * 1024))
        if dim != 0:
            raise ValueError(f"dim={dim}: this wrapper runs one device per process and does not scatter inputs")
        devices = {p.device for p in module.parameters()}
        for what, ids in (
            ("device_ids", device_ids),
            ("output_device", None if output_device is None else [output_device]),
        ):
            if ids is None:
                continue
            if len(ids) != 1:
                raise ValueError(f"{what} must name exactly one device (one device per process), got {list(ids)}")
            wanted = torch.device("cuda", ids[0]) if isinstance(ids[0], int) else torch.device(ids[0])
            if devices and wanted not in devices:
                raise ValueError(f"{what}={list(ids)} but the model is on {sorted(map(str, devices))}")
        for key, value in (
            ("find_unused_parameters", find_unused_parameters),
            ("check_reduction", check_reduction),
            ("gradient_as_bucket_view", gradient_as_bucket_view),
            ("static_graph", static_graph),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{key} must be a bool, got {value!r}")
        super().__init__(
            module,
            optimizers,
            algorithm,
            process_group=process_group,
            bucket_bytes=bucket_bytes,
            sync_point=sync_point,
            broadcast_buffers=broadcast_buffers,
        )

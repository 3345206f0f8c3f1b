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
  the same algorithm and bucket size as rank 0, then parameters, buffers and the
  optimizers' state are broadcast from rank 0 (:mod:`bagua_torch.broadcast`), the
  trainable parameters are grouped into buckets (:mod:`bagua_torch.bucketing`) and the
  algorithm is built for them.
* Backward: each gradient goes into its bucket as autograd produces it, and a full bucket
  is handed to the algorithm at once, buckets in the same order on every rank
  (:mod:`bagua_torch.reducer`; unused parameters count as zero gradients).
* Sync point: the reduced gradients are written into ``.grad`` at the end of the backward
  pass (``sync_point="backward"``, the default, as with torch's DDP) or in the optimizer's
  step pre-hook (``sync_point="step"``, overlapping whatever runs in between; call
  :meth:`BaguaModule.wait_gradients` before reading ``.grad`` yourself).
* ``no_sync()``: forwards inside it run backwards that only accumulate local gradients;
  the first backward after it reduces the accumulated gradients.
* ``state_dict()`` / ``load_state_dict()``: the model's entries (prefixed ``module.``,
  as with DDP) plus ``_extra_state``: the algorithm's name and state (residuals,
  neighbour copies, step counters), so a checkpointed run resumes identically (save
  the optimizer's ``state_dict()`` too).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from bagua_common.algorithms.registry import algorithm_facts
from bagua_common.comm.bucket_plan import check_bucket_bytes
from bagua_common.comm.topology import Communicators
from bagua_common.job.signature import JobSignature, algorithm_config, check_same_job
from bagua_common.moved import moved_names
from bagua_torch.algorithms import get_algorithm
from bagua_torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
)
from bagua_torch.autotune import set_mpi_ring_min_bytes, tuner_for
from bagua_torch.broadcast import broadcast_optimizer_state, broadcast_tensors
from bagua_torch.bucketing import DEFAULT_BUCKET_BYTES, Bucket, make_buckets
from bagua_torch.job import communicators_from, fault_tolerance_of
from bagua_torch.reducer import Reducer

__getattr__ = moved_names(__name__)  # DistributedDataParallel, now in bagua_torch.distributed_data_parallel

SyncPoint = Literal["backward", "step"]
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]
"""One optimizer or several, as the wrapper and the checkpoints take them."""
_EXTRA_STATE_FORMAT = 1


_WRAPPER_OF: weakref.WeakKeyDictionary[torch.optim.Optimizer, BaguaModule] = weakref.WeakKeyDictionary()
"""Each wrapped optimizer -> the live wrapper whose step hooks it carries (see :func:`wrapper_of`)."""


def wrapper_of(optimizer: torch.optim.Optimizer) -> BaguaModule | None:
    """The live :class:`BaguaModule` that ``optimizer`` was given to, or None.

    Whoever steps another optimizer in ``optimizer``'s place (:func:`bagua_torch.fuse_optimizer`)
    hands it over with :meth:`BaguaModule.replace_optimizer`, so the algorithm's step hooks go on.
    """
    return _WRAPPER_OF.get(optimizer)


class BaguaModule(nn.Module):
    """A model trained data-parallel with a Bagua algorithm (see the module docstring).

    Build it with :func:`with_bagua` or :class:`DistributedDataParallel`; a named ``algorithm`` takes its
    options as further keywords (``algorithm_options``, see :func:`with_bagua`). Attributes:
    ``module`` (the user's model), ``algorithm`` (the configuration),
    ``algorithm_impl`` (its :class:`~bagua_torch.algorithms.AlgorithmImpl`),
    ``buckets`` (launch order), ``reducer`` (their launch state, a
    :class:`~bagua_torch.reducer.Reducer`), ``communicators``, ``optimizers``, ``sync_point``.
    Setting ``events = []`` records the reducer's events (see :class:`~bagua_torch.reducer.Reducer`).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Optimizers = (),
        algorithm: str | Algorithm = "gradient_allreduce",
        *,
        process_group: Any = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        sync_point: SyncPoint = "backward",
        broadcast_buffers: bool = False,
        autotune: str | None = None,
        **algorithm_options: Any,
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
        if isinstance(algorithm, str) and algorithm_facts(algorithm).is_optimizer and len(optimizers) == 1:
            algorithm_options.setdefault("optimizer", optimizers[0])  # QAdam's and 1-bit Adam's own optimizer
        algorithm = get_algorithm(algorithm, **algorithm_options)
        check_bucket_bytes(bucket_bytes, "BaguaModule")
        if sync_point not in ("backward", "step"):
            raise ValueError(f"sync_point must be 'backward' or 'step', got {sync_point!r}")
        if sync_point == "step" and not optimizers:
            raise ValueError("sync_point='step' waits in the optimizer's step, so pass the optimizers to the wrapper")
        if not isinstance(broadcast_buffers, bool):
            raise TypeError(f"broadcast_buffers must be a bool, got {broadcast_buffers!r}")

        self.module = module
        self.algorithm: Algorithm = algorithm
        self.optimizers: tuple[torch.optim.Optimizer, ...] = optimizers
        self._stepping = list(optimizers)  # each, or what replaced it (replace_optimizer)
        self.sync_point: SyncPoint = sync_point
        self.broadcast_buffers = broadcast_buffers
        self.communicators: Communicators = communicators_from(process_group)
        fault_tolerance = self._fault_tolerance = fault_tolerance_of(process_group)

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

        signature = self._signature = JobSignature.of(leaves, config)
        # A fault-tolerant job wraps alone and synchronizes when its loop starts, where a lost rank is survived.
        if fault_tolerance is None:
            self.synchronize_replicas()

        self._named = tuple(named)
        self.bucket_tuner = tuner_for(
            autotune,
            algorithm=algorithm,
            total_bytes=sum(p.numel() * p.element_size() for _, p in named),
            start_bytes=bucket_bytes,
            communicators=self.communicators,
            device=self.device,
            job_digest=signature.digest().hex(),
        )
        self._build(bucket_bytes)
        if self.bucket_tuner is not None and self.bucket_tuner.cached is not None:
            self._retune(self.bucket_tuner.cached)
        self._require_sync = True  # False inside no_sync()
        self._closed = False
        self._step_hooks = [self._hook_steps(opt, opt) for opt in optimizers]
        for opt in optimizers:
            _WRAPPER_OF[opt] = self
        if fault_tolerance is not None:
            fault_tolerance.attach(self)

    def synchronize_replicas(self) -> None:
        """Check that every rank wraps the same model with the same algorithm and settings, then overwrite the
        parameters, buffers and optimizers' state with rank 0's (collective; the wrapper does it when it wraps)."""
        world = self.communicators.world

        def allgather(x: np.ndarray) -> np.ndarray:
            return world.allgather(torch.from_numpy(x).to(self.device)).cpu().numpy()

        check_same_job(self._signature, allgather)
        broadcast_tensors(world, [p for _, p in self.module.named_parameters()] + list(self.module.buffers()))
        for optimizer in self.stepping_optimizers:
            broadcast_optimizer_state(optimizer, world, self.device)

    def _build(self, bucket_bytes: int) -> None:
        """Group the trainable parameters into buckets of at most ``bucket_bytes``; build the algorithm and reducer."""
        self.bucket_bytes = bucket_bytes
        self.buckets: tuple[Bucket, ...] = tuple(
            make_buckets(list(self._named), bucket_bytes, pad_to=self.communicators.world.size)
        )
        context = AlgorithmContext(
            module=self.module,
            optimizers=self.optimizers,
            communicators=self.communicators,
            buckets=self.buckets,
            named_parameters=self._named,
            device=self.device,
            bucket_bytes=bucket_bytes,
            fault_tolerance=self._fault_tolerance,
        )
        impl = self.algorithm.reify(context)
        if not isinstance(impl, AlgorithmImpl):
            raise TypeError(
                f"{type(self.algorithm).__name__}.reify() must return an AlgorithmImpl, got {type(impl).__name__}"
            )
        self.algorithm_impl: AlgorithmImpl = impl
        self.reducer = Reducer(self.buckets, impl, wait_at_backward_end=self.sync_point == "backward")

    def _retune(self, setting: Mapping[str, Any]) -> None:
        """Switch to a tuned ``setting`` between steps (no communication is pending): set the MPI ring
        threshold, and rebuild the buckets and algorithm if the bucket size or ``hierarchical`` changed."""
        if "mpi_ring_min_bytes" in setting:
            set_mpi_ring_min_bytes(self.communicators, setting["mpi_ring_min_bytes"])
        algorithm = self.algorithm
        if "hierarchical" in setting:
            algorithm = algorithm.replace(hierarchical=setting["hierarchical"])
        bucket_bytes = setting.get("bucket_bytes", self.bucket_bytes)
        if (bucket_bytes, algorithm) == (self.bucket_bytes, self.algorithm):
            return
        if self.reducer.gradients_in_buckets:
            raise RuntimeError(
                "autotune cannot re-bucket a model whose optimizer was fused onto its buckets "
                "(fuse_optimizer(..., module=model)); tune first, or fuse without the module"
            )
        events = self.reducer.events
        self.reducer.close()
        self.algorithm_impl.close()
        self.algorithm = algorithm
        self._build(bucket_bytes)
        self.reducer.events = events

    def rebuild(self, communicators: Communicators) -> None:
        """Rebuild the buckets, algorithm and reducer for ``communicators`` (the members of a fault-tolerant job
        changed): the iteration in flight is dropped, the algorithm keeps its carried state (as of the last
        commit) and restarts the rest by its rule, and the gradients are cleared."""
        carried = self.algorithm_impl.carried_state()
        events = self.reducer.events
        self.reducer.discard()
        try:
            self.algorithm_impl.close()
        except RuntimeError:  # its threads' last collectives were abandoned with the old members
            pass
        self.communicators = communicators
        self._build(self.bucket_bytes)
        self.algorithm_impl.load_carried_state(carried)
        self.reducer.events = events
        self.module.zero_grad(set_to_none=True)

    @property
    def events(self) -> list[tuple[str, int, float]] | None:
        """The reducer's event record (None: not recording); set it to ``[]`` to start recording."""
        return self.reducer.events

    @events.setter
    def events(self, events: list[tuple[str, int, float]] | None) -> None:
        self.reducer.events = events

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
            if self.bucket_tuner is not None and (setting := self.bucket_tuner.step()) is not None:
                self._retune(setting)
            self.reducer.enabled = self._require_sync and bool(self.algorithm_impl.need_gradient_hooks)
            if self.broadcast_buffers:
                broadcast_tensors(self.communicators.world, list(self.module.buffers()))
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

    def wait_gradients(self) -> None:
        """Finish any pending gradient reduction and write the results into ``.grad`` (a no-op if none)."""
        self.reducer.wait()

    # --- optimizer step ---------------------------------------------------------------

    def _hook_steps(self, stepping: torch.optim.Optimizer, wrapped: torch.optim.Optimizer) -> list[Any]:
        """Hook ``stepping``'s steps as ``wrapped``'s (a fault-tolerant job votes in the last unless the impl did)."""

        def before(_optimizer: Any, args: Any, kwargs: Any) -> None:
            self.wait_gradients()
            job = self._fault_tolerance
            votes = job is not None and job.optimizer_stepping()
            self.algorithm_impl.before_step(wrapped)
            if votes and wrapped is self.optimizers[-1] and self.algorithm_impl.transaction_per_step:
                job.commit_step()

        def after(_optimizer: Any, args: Any, kwargs: Any) -> None:
            self.algorithm_impl.after_step(wrapped)

        return [stepping.register_step_pre_hook(before), stepping.register_step_post_hook(after)]

    def replace_optimizer(self, original: torch.optim.Optimizer, replacement: torch.optim.Optimizer) -> None:
        """Step ``replacement`` (the same parameters; a fused optimizer, :func:`bagua_torch.fuse_optimizer`) in the
        place of ``original``, one of the optimizers given to the wrapper, never stepped again: the step hooks move to
        it, and the algorithm sees its steps as ``original``'s (the optimizer it was built with), so
        weight-communicating algorithms keep averaging; its state is the training's (:attr:`stepping_optimizers`)."""
        index = next((i for i, opt in enumerate(self.optimizers) if opt is original), None)
        if index is None:
            raise ValueError("replace_optimizer: the original optimizer was not given to this wrapper")
        if self._closed:
            raise RuntimeError("replace_optimizer: this BaguaModule has been closed")
        params = [{id(p) for group in opt.param_groups for p in group["params"]} for opt in (original, replacement)]
        if params[0] != params[1]:
            raise ValueError("replace_optimizer: the replacement must hold the original optimizer's parameters")
        for handle in self._step_hooks[index]:
            handle.remove()
        self._step_hooks[index] = self._hook_steps(replacement, original)
        self._stepping[index] = replacement
        _WRAPPER_OF.pop(original, None)
        _WRAPPER_OF[replacement] = self

    @property
    def stepping_optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        """The optimizers that step the model (their state is the training's): the wrapper's, or what replaced each."""
        return tuple(self._stepping)

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
        self.reducer.close()
        for handle in (h for hooks in self._step_hooks for h in hooks):
            handle.remove()
        self._step_hooks = []
        for optimizer, wrapper in list(_WRAPPER_OF.items()):
            if wrapper is self:
                del _WRAPPER_OF[optimizer]
        self.algorithm_impl.close()
        self._closed = True

    def extra_repr(self) -> str:
        return (
            f"algorithm={self.algorithm!r}, buckets={len(self.buckets)}, bucket_bytes={self.bucket_bytes}, "
            f"sync_point={self.sync_point!r}, world_size={self.communicators.world.size}"
        )


def with_bagua(
    model: nn.Module,
    optimizers: Optimizers = (),
    algorithm: str | Algorithm = "gradient_allreduce",
    **options: Any,
) -> BaguaModule:
    """Wrap ``model`` for data-parallel training with ``algorithm`` (a name or an Algorithm instance).

    Bagua's ``model.with_bagua(optimizers, algorithm)`` as a function (torch classes are
    not patched): ``model = bagua_torch.with_bagua(model, [optimizer], algorithm)``, then
    train with ``model(x)``, ``loss.backward()``, ``optimizer.step()`` as usual. Collective:
    every rank must call it, with the same model, in the same order. With a name, the
    algorithm's options follow as keywords: ``with_bagua(model, [optimizer], "diloco", sync_every=5)``
    (an unknown one raises a TypeError listing the algorithm's options; QAdam and 1-bit Adam,
    named, take the one optimizer given, which must be their own). The other
    ``options`` are :class:`BaguaModule`'s keywords: ``process_group`` (default: the one from
    :func:`bagua_torch.init_process_group`), ``bucket_bytes`` (default 10 MiB) bounding each
    communication bucket, ``sync_point`` and ``broadcast_buffers`` (each forward; buffers are
    always broadcast once on wrap), and ``autotune`` (``off``, ``once``, ``cached``; default
    ``BAGUA_AUTOTUNE``), which tunes the bucket size, and where they have an effect ``hierarchical``
    and the MPI ring threshold, over the first steps (:mod:`bagua_torch.autotune`; gradient
    allreduce only).
    """
    return BaguaModule(model, optimizers, algorithm, **options)

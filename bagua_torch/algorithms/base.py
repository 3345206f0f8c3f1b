"""The interface between the data-parallel wrapper and the algorithms.

Two objects per algorithm:

* an :class:`Algorithm` is a small configuration object the user creates
  (``ByteGradAlgorithm(hierarchical=False)``) or names (``"bytegrad"``). It has a
  ``name`` and one method, :meth:`Algorithm.reify`, which builds
* an :class:`AlgorithmImpl` for one wrapped model, given an
  :class:`AlgorithmContext`: the model, its optimizers, the communicators and the
  model's buckets. The impl holds the algorithm's state (residuals, neighbour copies,
  step counters) and is driven by the wrapper (:class:`bagua_torch.BaguaModule`)
  through a few hooks.

What the wrapper does, per training iteration, and which hook it calls:

1. ``forward`` (training mode, grad enabled): the wrapper finishes any gradient
   reduction still pending from the last iteration, reads
   :attr:`AlgorithmImpl.need_gradient_hooks` (and the ``no_sync()`` flag) to decide
   whether this iteration's backward reduces gradients, broadcasts buffers if asked,
   then calls :meth:`AlgorithmImpl.before_forward`.
2. backward: if gradient hooks are on, each parameter's gradient is copied into its
   bucket's flat buffer (:attr:`Bucket.grad`) as soon as autograd has accumulated it.
   When every gradient of bucket ``k`` has arrived *and* buckets ``0..k-1`` have been
   launched, the wrapper calls :meth:`AlgorithmImpl.reduce_bucket` for bucket ``k``;
   so every rank launches the buckets in the same fixed order (0, 1, 2, ...), while
   the backward pass goes on. At the end of the backward pass, buckets with gradients
   that never arrived (parameters unused in this iteration on this rank) are launched
   with zeros in place of the missing gradients, so every rank issues the same
   collectives.
3. sync point: at the end of backward (``sync_point="backward"``, the default, as in
   DDP) or just before the optimizer step (``sync_point="step"``), the wrapper waits on
   each bucket's work in order and writes the results into the parameters' ``.grad``.
4. ``optimizer.step()``: in a step pre-hook the wrapper calls
   :meth:`AlgorithmImpl.before_step`, the optimizer runs, then in a step post-hook
   :meth:`AlgorithmImpl.after_step`.

Gradient-communicating algorithms (GradientAllReduce, ByteGrad; QAdam and 1-bit Adam
after their warm-up, which average momentum instead) implement ``reduce_bucket``.
Weight-communicating algorithms (Decentralized, LowPrecisionDecentralized,
AsyncModelAverage after its warm-up) set ``need_gradient_hooks = False`` and work in
``before_forward`` / ``before_step`` / ``after_step`` on the parameters, using
:meth:`Bucket.flatten_params` and :meth:`Bucket.unflatten_to_params`.

Rules every implementation must keep:

* Every rank must issue the same collectives in the same order. Decide anything that
  changes the communication pattern (warm-up over, communication interval, peer
  choice) from values that are identical on every rank, such as a step counter the
  impl keeps itself.
* Collectives issued from :meth:`reduce_bucket` (directly, or on the impl's worker
  thread via :meth:`AlgorithmImpl.run_async`) must all be issued in launch order;
  collectives issued from the other hooks run on the training thread after every
  bucket's work has been waited on, so they cannot interleave with them.
* ``state_dict()`` must return everything needed to resume identically (tensors are
  copied by the caller's ``torch.save``; return clones, not live buffers, if the
  impl mutates them in place), and ``load_state_dict()`` must validate it and raise a
  clear ``ValueError`` on mismatch.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import torch

from bagua_common.algorithms.compressed_allreduce import Levels, allreduce_over
from bagua_common.algorithms.option_checks import check_flags
from bagua_common.algorithms.registry import AlgorithmRegistry, as_config
from bagua_common.comm.topology import Communicators
from bagua_torch.bucketing import DEFAULT_BUCKET_BYTES, Bucket
from bagua_torch.communicator import Communicator, DoneWork, ReduceOp, Work
from bagua_torch.ordered_worker import OrderedWorker

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "REGISTRY",
    "Algorithm",
    "AlgorithmContext",
    "AlgorithmImpl",
    "Bucket",
    "Communicators",
    "DoneWork",
    "WeighedOut",
    "check_flags",
    "implements",
]

REGISTRY = AlgorithmRegistry("bagua_torch")
"""This front end's algorithm classes, by configuration class and by name."""

implements = REGISTRY.implements
"""The class decorator that registers a torch algorithm against its shared configuration (see
:mod:`bagua_common.algorithms.registry` for how a new algorithm registers)."""


@dataclass(frozen=True)
class AlgorithmContext:
    """What an algorithm sees of the wrapped model (see :meth:`Algorithm.reify`).

    * ``module``: the user's model (not the wrapper);
    * ``optimizers``: the optimizers given to the wrapper (possibly empty), in order;
    * ``communicators``: world (and intra/inter for hierarchical topologies);
    * ``buckets``: the buckets in launch order, padded to a multiple of ``world.size``;
    * ``named_parameters``: the trainable parameters (``requires_grad``), in
      registration order, with their names in ``module``;
    * ``device``: the device of the parameters;
    * ``bucket_bytes``: the bucket size the buckets were built with;
    * ``ordered_worker``: the thread the impl's asynchronous jobs run on, when several impls must
      issue their collectives in one order (the impls of one DDP communication hook state);
      None: the world's own (a native communicator) or one of the impl's.
    * ``fault_tolerance``: the :class:`~bagua_torch.fault_tolerance.FaultTolerance` of a fault-tolerant
      job, None otherwise.
    """

    module: torch.nn.Module
    optimizers: tuple[torch.optim.Optimizer, ...]
    communicators: Communicators
    buckets: tuple[Bucket, ...]
    named_parameters: tuple[tuple[str, torch.nn.Parameter], ...]
    device: torch.device
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ordered_worker: OrderedWorker | None = None
    fault_tolerance: Any = None

    @property
    def world(self) -> Communicator:
        """The communicator of all ranks."""
        return self.communicators.world


class Algorithm:
    """A data-parallel algorithm's configuration; subclasses implement :meth:`reify`.

    A built-in algorithm is registered with ``@implements(ItsConfig)``, which sets :attr:`name` and
    ``config_class``; it holds its shared configuration (:mod:`bagua_common.algorithms.configs`,
    which checked its own fields) as :attr:`config`, built from the fields,
    ``ByteGradAlgorithm(hierarchical=False)``, or given, ``ByteGradAlgorithm(ByteGradConfig(...))``;
    the fields read through (``algorithm.hierarchical``). A custom algorithm may instead be any
    subclass that sets :attr:`name` (a dataclass of its own options, say). The same object may
    be used to wrap several models; all state lives in the :class:`AlgorithmImpl` that
    :meth:`reify` returns.
    """

    name: ClassVar[str] = ""
    """The registry name, e.g. ``"bytegrad"`` (see :func:`bagua_torch.algorithms.get_algorithm`)."""

    config_class: ClassVar[type | None] = None
    """The shared configuration class of a registered algorithm (set by ``@implements``)."""

    fault_tolerant: ClassVar[bool] = False
    """Whether a fault-tolerant job (:mod:`bagua_torch.fault_tolerance`) trains it: its impl carries its state
    across a change of members by its rule, tested by killing, stopping or failing a rank
    (``tests/test_fault_tolerance_torch.py``); any other is refused when wrapped, naming the elastic restart."""

    def __init__(self, *args: Any, **options: Any):
        if self.config_class is None:
            if args or options:
                raise TypeError(f"{type(self).__name__} takes no options")
            return
        self.config = as_config(self.config_class, *args, **options)

    def __getattr__(self, key: str) -> Any:
        config_class = type(self).config_class
        if config_class is not None and key in {field.name for field in dataclasses.fields(config_class)}:
            return getattr(self.config, key)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash((type(self), getattr(self, "config", None)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({getattr(self, 'config', '')!r})"

    def replace(self, **changes: Any) -> Algorithm:
        """A copy with ``changes`` to the configuration's fields."""
        new = copy.copy(self)
        new.config = dataclasses.replace(self.config, **changes)
        return new

    def reify(self, context: AlgorithmContext) -> AlgorithmImpl:
        """Build this algorithm's implementation for one wrapped model.

        Called once, collectively (on every rank, in the same order), after the
        parameters have been broadcast from rank 0 and the buckets built. May
        communicate (e.g. to create peer groups) and should raise a clear error for a
        configuration the model or topology cannot run (odd world size with
        ``shift_one``, parameters of a dtype the algorithm cannot compress, ...).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement reify()")


class WeighedOut(NamedTuple):
    """How a fault-tolerant job's step in flight weighs this rank: joiners take part in it while their state arrives,
    contributing zeros (:meth:`AlgorithmImpl.weighed_out_scale`)."""

    contributes: bool
    """False on a joiner: its gradients are replaced by zeros before they are reduced."""
    scale: float
    """The factor applied to every reduced bucket, which makes the average one over the ranks that contribute."""


class AlgorithmImpl:
    """An algorithm running on one wrapped model; the wrapper calls its hooks (see the module docstring).

    Subclasses call ``super().__init__(context)`` and override what they need; every hook
    has a do-nothing default except :meth:`reduce_bucket`.
    """

    need_gradient_hooks: bool = True
    """Whether the wrapper reduces gradients through :meth:`reduce_bucket` in the next backward pass.

    Read at each ``forward`` in training mode (so it may change between iterations, e.g.
    when a warm-up ends, as long as it changes identically on every rank). When False the
    wrapper installs no work in the backward pass and ``.grad`` stays this rank's local
    gradient.
    """

    results_are_fresh: bool = False
    """Whether the tensors :meth:`reduce_bucket`'s work returns are new and not kept by the impl.

    When True and the parameters' gradients are views of their buckets (a fused optimizer
    stepping on the buckets), the wrapper makes a returned tensor the bucket's buffer instead
    of copying it.
    """

    transaction_per_step: bool = True
    """Whether, in a fault-tolerant job, each step is one transaction committed by agreement in the last
    optimizer's step pre-hook (after the gradients are reduced, before anything replicated changes); False for an
    algorithm that delimits its own transactions (DiLoCo's outer exchanges, through :attr:`fault_tolerance`).
    An algorithm that changes replicated state in its step hooks calls :meth:`commit` between its last collective
    and its first change."""

    def __init__(self, context: AlgorithmContext):
        self.context = context
        self.fault_tolerance = context.fault_tolerance
        """The :class:`~bagua_torch.fault_tolerance.FaultTolerance` of a fault-tolerant job (None otherwise)."""
        # The context's thread if given; else the world's own where it has one (a native communicator), so that
        # the pipelines' collectives run inline there; over torch.distributed, which issues from any thread, one
        # of this impl's own.
        shared = context.ordered_worker or getattr(context.communicators.world, "ordered_worker", None)
        self._owns_worker = shared is None
        self._worker = OrderedWorker(type(self).__name__, context.device) if shared is None else shared
        self.weighed_out: WeighedOut | None = None
        """Set by a fault-tolerant job for the step in flight when joiners take part in it weighed out; the reducer
        applies it and clears it when the step's reduction is done."""

    # --- conveniences ---------------------------------------------------------------

    @property
    def communicators(self) -> Communicators:
        """The run's communicators (``self.context.communicators``)."""
        return self.context.communicators

    @property
    def world(self) -> Communicator:
        """The communicator of all ranks."""
        return self.context.communicators.world

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """The buckets, in launch order."""
        return self.context.buckets

    def run_async(self, fn: Callable[[], Any]) -> Work:
        """Run ``fn()`` on this impl's ordered thread (jobs in submission order); return its handle.

        For multi-stage pipelines (compress, all-to-all, reduce, allgather, ...) that must
        not block the backward pass: ``fn`` may call blocking collectives and kernels, and
        ``wait()`` returns what ``fn`` returned (re-raising its exception). All jobs of one
        impl run one after another in submission order, so collectives issued from them
        keep the launch order. Over a native world the thread is the communicator's own
        (:attr:`~bagua_torch.NativeCommunicator.ordered_worker`), after every collective issued
        before, and the collectives ``fn`` issues there run inline. For CUDA parameters ``fn``
        runs on a side stream that first waits for the submitting thread's current stream, and
        ``wait()`` makes the waiting thread's current stream wait for it (no host synchronization).
        """
        return self._worker.submit(lambda stream: fn())

    def allreduce_async(self, flat: torch.Tensor, levels: Levels, op: ReduceOp = ReduceOp.AVG) -> Work:
        """Start :func:`~bagua_common.algorithms.compressed_allreduce.allreduce_over` on ``flat``: the world's
        asynchronous allreduce, or with ``levels`` (``(intra, inter)``) the two-level pipeline on the ordered
        thread (:meth:`run_async`)."""
        if levels is None:
            return self.world.allreduce_async(flat, op)
        return self.run_async(lambda: allreduce_over(flat, self.world, levels, op))

    # --- hooks ------------------------------------------------------------------------

    def reduce_bucket(self, bucket: Bucket) -> Work:
        """Start reducing ``bucket.grad`` (this rank's gradients, padded) over the ranks; return a handle.

        Called from the autograd thread during the backward pass, once per bucket per
        iteration, in bucket order (see the module docstring). Must not block on
        communication: return an asynchronous handle (a communicator's ``*_async``
        result, :meth:`run_async`, or :class:`DoneWork`). Its ``wait()`` (called at the
        sync point, buckets in order) returns either a 1-D tensor of ``bucket.size`` (or
        ``bucket.numel``) elements, which the wrapper copies into the parameters'
        ``.grad``, or None if the impl has dealt with the result itself (e.g. QAdam
        writing averaged momentum into its optimizer's state).
        """
        raise NotImplementedError(
            f"{type(self).__name__} sets need_gradient_hooks but does not implement reduce_bucket()"
        )

    def before_forward(self, module: torch.nn.Module) -> None:
        """Called at the start of each ``forward`` in training mode with grad enabled (after pending gradient
        reductions are finished and buffers are broadcast). ``module`` is the user's model. Weight-communicating
        algorithms may start an asynchronous exchange of the weights here (they do not change until the step)."""

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called in ``optimizer.step()``'s pre-hook, for each wrapped optimizer, after all gradient reductions
        have been waited on and written into ``.grad``. Runs on the training thread."""

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called in ``optimizer.step()``'s post-hook, for each wrapped optimizer. Runs on the training thread."""

    def state_dict(self) -> dict[str, Any]:
        """The algorithm's state (tensors, lists of tensors, ints, floats, strings), to resume identically.

        Saved by the wrapper's ``state_dict()`` (through ``get_extra_state``), after any
        pending gradient reduction has finished.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (on a freshly wrapped model of the same shape and world
        size); raise a ValueError naming what does not match."""
        if state:
            raise ValueError(f"{type(self).__name__} has no state, but the checkpoint holds {sorted(state)}")

    def commit(self) -> None:
        """In a fault-tolerant job, vote for the step in flight now (its collectives are done, nothing replicated
        has changed yet) and raise MembershipChanged unless it committed; nothing otherwise. Once per step: the
        wrapper votes after the step pre-hooks if the algorithm did not."""
        if self.fault_tolerance is not None:
            self.fault_tolerance.commit_step()

    def on_commit(self) -> None:
        """Called in a fault-tolerant job after each commit: keep what :meth:`carried_state` must return."""

    def carried_state(self) -> dict[str, Any]:
        """What a rebuild for other members keeps (and a joiner receives), as of the last commit: tensors, lists of
        tensors, ints. Leaves the algorithm's rule resets (error-feedback residuals, copies of the neighbours'
        weights) are left out. Default: nothing."""
        return {}

    def load_carried_state(self, state: dict[str, Any]) -> None:
        """Take what :meth:`carried_state` returned, on an impl freshly built for the new members."""
        if state:
            raise ValueError(f"{type(self).__name__} carries no state, but was given {sorted(state)}")

    def received(self) -> None:
        """In a fault-tolerant job, on a rank given another's state, after :meth:`load_carried_state`: drop what was
        the sender's own, not the replicas' (DiLoCo: its pseudo-gradients not yet applied). Default: nothing."""

    def after_change(self) -> None:
        """After a change of members, once rebuilt: finish what the change interrupted (DiLoCo retries its
        exchanges among the survivors). Collective over the new members. Default: nothing."""

    def steps_to_next_exchange(self) -> int | None:
        """In a fault-tolerant job, for a rank given the state now: how many steps it can sit out, then join the
        algorithm's next exchange without having trained (DiLoCo's round), so that its peers need not wait for the
        state; None when it needs the state before the next step (its peers wait while it is sent). Default: None."""
        return None

    def weighed_out_scale(self, trainers: int) -> float | None:
        """In a fault-tolerant job: the factor that makes this algorithm's reduced gradients the average over
        ``trainers`` ranks when the others contributed zeros (joiners taking part in their first step while their
        state arrives), or None: a rank given the state needs it before the next step (its peers wait). Every rank
        asks it before the joiner has any state, so the answer must not depend on the impl's state. Default: None."""
        return None

    def mean_over(self, trainers: int) -> float:
        """The factor that turns a mean over the world into one over ``trainers`` ranks, the others contributing
        zeros: what :meth:`weighed_out_scale` returns for an algorithm that averages."""
        return self.world.size / trainers

    def sit_out(self, steps: int) -> None:
        """Skip ``steps`` steps (:meth:`steps_to_next_exchange`) and contribute nothing to the exchange after them."""
        raise NotImplementedError(f"{type(self).__name__} has no exchange to join without having trained")

    def others_sit_out(self, steps: int) -> None:
        """On a member, when the ranks given the state sit out the next ``steps`` steps
        (:meth:`steps_to_next_exchange`): train those steps without them. Default: nothing (DiLoCo's exchange counts
        the ranks that trained)."""

    def replicated_tensors(self) -> list[torch.Tensor]:
        """The algorithm's own tensors that are identical on every rank (hashed by the replica check)."""
        return []

    def close(self) -> None:
        """Release threads and other resources (the wrapper's ``close()`` calls it). Idempotent."""
        if self._owns_worker:
            self._worker.close()


# ----------------------------------------------------------------------------- checks


def check_dtypes(buckets: Sequence[Bucket], allowed: Sequence[torch.dtype], algorithm: str, what: str) -> None:
    """Raise a TypeError naming the first parameter whose dtype is not in ``allowed``."""
    for bucket in buckets:
        if bucket.dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise TypeError(f"{algorithm}: parameter {bucket.names[0]} has dtype {bucket.dtype}; {what} {names} only")


def check_tensor_list(
    state: dict[str, Any], key: str, expected: Sequence[int], algorithm: str, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Validate ``state[key]``: a list of 1-D ``dtype`` tensors of the ``expected`` sizes; return it."""
    if key not in state:
        raise ValueError(f"{algorithm}: the checkpoint has no '{key}' (holds {sorted(state)})")
    tensors = state[key]
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError(f"{algorithm}: '{key}' must be a list of tensors")
    got = [int(t.numel()) for t in tensors]
    if got != list(expected) or any(t.dtype != dtype for t in tensors):
        raise ValueError(
            f"{algorithm}: the checkpoint's '{key}' has sizes {got} ({[str(t.dtype) for t in tensors]}) but this "
            f"model needs {list(expected)} ({dtype}); was it saved from another model, bucket size or world size?"
        )
    return list(tensors)

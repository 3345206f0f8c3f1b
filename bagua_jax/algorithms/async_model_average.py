"""Asynchronous model averaging: local steps, with the weights averaged in the background.

During the first ``warmup_steps`` steps the gradients are allreduce-averaged as in
:mod:`~bagua_jax.algorithms.gradient_allreduce`, so every rank starts from the same model.
After warm-up every rank steps on its own gradients, and a background thread averages the
weights with all ranks without ever making the training loop wait (SPEC section 3): it takes
a snapshot ``s`` of this rank's weights, allreduce-sums the snapshots on a communicator of
its own, and the training loop then applies ``x += sum / n - s`` between two steps, which
moves ``x`` by exactly the correction that would have turned ``s`` into the average, so the
local progress made while the round was on the wire is kept.

The work is split in two because a round runs outside the compiled step:

- :func:`async_model_average` (and :meth:`AsyncModelAverage.transformation`) is the part
  inside the jitted step: gradient allreduce during warm-up, the identity afterwards.
- :class:`AsyncModelAverager` (from :meth:`AsyncModelAverage.averager`) is the part between
  steps: ``params = averager.apply(params)`` after every step, ``abort()`` and ``resume()``.

A typical loop, one process per rank under ``mpiexec``::

    algo = AsyncModelAverage(sync_interval_ms=100, warmup_steps=50)
    tx = algo.transformation(optax.sgd(0.1), Communicators(NativeCommunicator.mpi_world()))
    averager = algo.averager(params, NativeCommunicator.mpi_world())  # a second, dedicated one
    for batch in data:
        params, opt_state = train_step(params, opt_state, batch)  # jitted, uses tx
        params = averager.apply(params)
    averager.abort()  # on every rank, before the process exits

Under :class:`~bagua_jax.fault_tolerance.FaultTolerantTrainer` the trainer makes and drives the averager instead
(:mod:`bagua_jax.averaging_across_changes`): its loop calls only ``ft.step``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from bagua_common.algorithms.averaging_rounds import AveragingRounds, RoundsControl
from bagua_common.algorithms.configs import AsyncModelAverageConfig
from bagua_common.algorithms.option_checks import check_bucket_bytes
from bagua_common.algorithms.registry import as_config
from bagua_common.comm.collectives import ReduceOp
from bagua_common.comm.topology import Communicators
from bagua_jax import ops
from bagua_jax.algorithms.base import (
    ConfiguredAlgorithm,
    check_communicators,
    check_float_params,
    implements,
    step_counter_init,
    varying_like,
)
from bagua_jax.algorithms.gradient_allreduce import gradient_allreduce
from bagua_jax.bucketing import DEFAULT_BUCKET_BYTES, BucketPlan, plan_buckets
from bagua_jax.communicator import innermost
from bagua_jax.native_communicator import NativeCommunicator


class AsyncModelAverageState(NamedTuple):
    """State of :func:`async_model_average`: ``step`` counts update calls (an int32 scalar)."""

    step: jax.Array


def async_model_average(
    comms: Communicators, *config: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **options: Any
) -> optax.GradientTransformationExtraArgs:
    """The in-step part of asynchronous model averaging, to chain *before* the optimizer.

    While ``step < warmup_steps`` the gradients are allreduce-averaged over ``comms.world`` in
    buckets of at most ``bucket_bytes`` (exactly :func:`gradient_allreduce`: ``2 (n-1)/n`` of
    the gradient bytes per rank, the fp32 allreduce baseline); afterwards they pass through
    untouched and nothing is communicated inside the step (the weights are averaged by
    :class:`AsyncModelAverager` between steps). With ``warmup_steps=0`` no collective is even
    compiled into the step. Choose it through :class:`AsyncModelAverage`, when stragglers or
    a slow network make every synchronous collective costly.
    """
    config = as_config(AsyncModelAverageConfig, *config, **options)
    name, warmup_steps = config.name, config.warmup_steps
    comms = check_communicators(comms, name)
    allreduce = gradient_allreduce(comms, bucket_bytes=check_bucket_bytes(bucket_bytes, name))

    def update_fn(
        updates: Any, state: AsyncModelAverageState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, AsyncModelAverageState]:
        del params, extra_args
        if warmup_steps > 0:
            # Every rank holds the same step, so all take the same branch, and after warm-up the
            # allreduce is not executed at all (not computed and discarded). Under shard_map the
            # allreduced gradients are typed invariant over the mesh and the local ones varying;
            # cond needs one type, so the allreduced ones are cast (types only, values untouched).
            updates = lax.cond(
                state.step < warmup_steps,
                lambda u: varying_like(allreduce.update(u, optax.EmptyState())[0], u),
                lambda u: u,
                updates,
            )
        return updates, AsyncModelAverageState(step=optax.safe_int32_increment(state.step))

    return optax.GradientTransformationExtraArgs(step_counter_init(AsyncModelAverageState), update_fn)


@functools.lru_cache(maxsize=8)
def _round_functions(plan: BucketPlan, size: int) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """A round's jitted snapshot (``plan``'s float32 buckets; fresh buffers, so it outlives weights donated to the next
    step) and correction among ``size`` ranks (the fused kernel takes their number as an attribute): made once per
    layout and number of ranks, so an averager made again for a number seen before compiles nothing."""

    def correct(params: Any, sums: list[jax.Array], snapshot: list[jax.Array]) -> Any:
        new = [ops.async_average(x, r, s, size) for x, r, s in zip(plan.flatten(params), sums, snapshot)]
        return jax.tree.map(lambda y, x: y.astype(x.dtype), plan.unflatten(new), params)

    return jax.jit(plan.flatten), jax.jit(correct)


def compiled_rounds(
    params: Any, size: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The snapshot and correction of a round among ``size`` ranks for weights like ``params``, compiled for a round's
    kinds of arguments (the sums arrive as NumPy arrays) by running them once; their second call for the same layout
    and number of ranks compiles nothing (a fault-tolerant job compiles them ahead for the members a change brings)."""
    # Buckets in float32 whatever the parameter dtypes: that is what the host buffers hold.
    as_f32 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.float32), params)
    plan = plan_buckets(as_f32, bucket_bytes)
    take_snapshot, correct = _round_functions(plan, size)
    host_sums = [np.zeros(bucket.size, np.float32) for bucket in plan.buckets]
    jax.block_until_ready(correct(params, host_sums, take_snapshot(params)))
    return take_snapshot, correct


class AsyncModelAverager(RoundsControl):
    """The background averaging rounds of :class:`AsyncModelAverage`, driven between steps.

    Call :meth:`apply` once after every training step (``steps_done`` steps have already run,
    e.g. after restoring a checkpoint). After ``warmup_steps`` steps a thread starts that runs
    rounds, each at least ``sync_interval_ms`` after the previous one finished. A round: the
    next :meth:`apply` hands the thread a copy of the weights ``s`` (a device copy, so donated
    buffers are safe); the thread allreduces a stop flag (4 bytes, MAX) so that all ranks agree
    whether round k happens, then allreduce-sums ``s`` in float32 buckets on host memory; the
    next :meth:`apply` after that returns ``x + sum / n - s``. Per round that is one fp32
    allreduce of the model (the bytes of one fp32 gradient allreduce, for bfloat16 or float16
    weights twice their size) plus the flag, and nothing inside the training step.

    ``comm`` must be a :class:`~bagua_jax.NativeCommunicator` over the MPI engine used by
    nothing else (e.g. a second ``NativeCommunicator.mpi_world()``, which duplicates
    ``MPI_COMM_WORLD``): MPI needs the collectives of one communicator in the same order on
    every rank, and the thread's calls interleave with the training step's differently on each
    rank. The thread calls the engine's DLPack binding on NumPy buffers directly, not jitted
    collectives: those calls release the GIL and wait on MPI alone, whereas a jitted native
    collective takes JAX's ordered-effect token, which JAX threads through every computation
    with native collectives in the process, the training step included, so a slow round would
    hold up the next step. ``comm``'s timeout bounds each wait of the thread: ranks that stop
    calling :meth:`apply` for longer (a long evaluation) make the others' rounds fail, and
    their next :meth:`apply` raises the error; ``failed``, if given, is told it from the thread
    as it happens (a fault-tolerant job fails its epoch then: a member that left may leave the
    others waiting in a vote that no collective of theirs would end).

    Rounds need every rank: a rank's thread enters round k only once that rank's loop has
    called :meth:`apply` (or :meth:`abort`), so call :meth:`abort` on every rank before exiting
    and call :meth:`abort`/:meth:`resume` the same number of times on every rank.
    """

    def __init__(
        self,
        params: Any,
        comm: NativeCommunicator,
        config: AsyncModelAverageConfig = AsyncModelAverageConfig(),
        *,
        steps_done: int = 0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        failed: Callable[[BaseException], None] | None = None,
    ) -> None:
        name = "AsyncModelAverager"
        check_float_params(params)
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):
            if jnp.asarray(leaf).dtype not in ops.KERNEL_FLOATS:
                raise TypeError(
                    f"{name}: parameter {jax.tree_util.keystr(path)} has dtype {jnp.asarray(leaf).dtype}; "
                    "asynchronous averaging takes float32, float16 or bfloat16 parameters"
                )
        comm = innermost(comm)  # a wrapper's (e.g. a CountingCommunicator's) engine: the rounds run on the host
        if not isinstance(comm, NativeCommunicator):
            raise TypeError(
                f"{name}: comm must be a NativeCommunicator over MPI (e.g. a second "
                f"NativeCommunicator.mpi_world()), got {type(comm).__name__}"
            )
        # The thread communicates host buffers, which only the host engines take.
        if not comm.on_host:
            raise ValueError(f"{name}: the averaging rounds need a host engine (MPI, TCP), got {comm.kind}")
        if isinstance(steps_done, bool) or not isinstance(steps_done, (int, np.integer)) or steps_done < 0:
            raise ValueError(f"{name}: steps_done must be a non-negative int, got {steps_done!r}")
        self._engine, self._handle, self._size = comm.engine, comm.handle, comm.size

        # Compiled now: compiling inside the first apply() calls would stall the training loop.
        self._take_snapshot, self._correct = compiled_rounds(params, self._size, check_bucket_bytes(bucket_bytes, name))

        self._params: Any = None  # the weights of the apply() call in progress
        self._protocol = AveragingRounds(
            config.name,
            config.sync_interval_ms / 1000.0,
            config.warmup_steps,
            int(steps_done),
            take_snapshot=lambda: self._take_snapshot(self._params),
            agree_to_stop=self._agree_to_stop,
            allreduce_sum=self._allreduce_sum,
            apply=self._apply_round,
            failed=failed,
        )

    def apply(self, params: Any) -> Any:
        """Call after every training step: ``params`` corrected by the last finished round, if any.

        If a round has finished since the last call, returns ``params + sum / n - s`` (fused in
        one kernel, computed in float32, in the parameters' dtypes); otherwise ``params``
        unchanged. Never waits for communication: it at most dispatches the correction and, when
        the thread asks for one, a device copy of the weights for the next round. Raises the
        thread's error if a round failed.
        """
        self._params = params
        try:
            self._protocol.after_step()
            return self._params
        finally:
            self._params = None

    def _apply_round(self, sums: list[np.ndarray], snapshot: list[jax.Array]) -> None:
        self._params = self._correct(self._params, sums, snapshot)

    def _agree_to_stop(self, stop: bool) -> bool:
        flag, agreed = np.array([int(stop)], np.int32), np.zeros(1, np.int32)
        self._engine.allreduce(self._handle, flag, agreed, ReduceOp.MAX.code)
        return bool(agreed[0])

    def _allreduce_sum(self, snapshot: list[jax.Array]) -> list[np.ndarray]:
        sums = []
        for bucket in snapshot:
            send = np.asarray(bucket)
            sums.append(np.empty_like(send))
            self._engine.allreduce(self._handle, send, sums[-1], ReduceOp.SUM.code)
        return sums


@implements(AsyncModelAverageConfig)
class AsyncModelAverage(ConfiguredAlgorithm):
    """Asynchronous model averaging (SPEC section 3): gradient allreduce for ``warmup_steps``
    steps, then local steps while a background thread averages the weights every
    ``sync_interval_ms`` without blocking training.

    :meth:`transformation` is the in-step part (:func:`async_model_average` chained before the
    optimizer: the fp32 gradient allreduce during warm-up, nothing after); :meth:`averager`
    makes the between-steps part (:class:`AsyncModelAverager`: one fp32 allreduce of the
    weights per round, on its own connection). Choose it when ranks run at uneven speeds or
    the network is slow enough that any per-step synchronization stalls training, and slightly
    diverging replicas are acceptable.
    """

    _transform = staticmethod(async_model_average)
    fault_tolerant = True

    def averager(
        self,
        params: Any,
        comm: NativeCommunicator,
        *,
        steps_done: int = 0,
        failed: Callable[[BaseException], None] | None = None,
    ) -> AsyncModelAverager:
        """The background rounds for weights shaped like ``params`` over the dedicated MPI ``comm`` (``failed``: told
        a round's error from the thread as it happens, as :class:`AsyncModelAverager` says)."""
        return AsyncModelAverager(
            params, comm, self.config, steps_done=steps_done, bucket_bytes=self.bucket_bytes, failed=failed
        )

"""The Adam engine shared by QAdam and 1-bit Adam: Adam whose momentum, not its gradients, is averaged after a
warm-up.

The first ``warmup_steps`` steps are plain Adam on gradients averaged in full precision
(:func:`~bagua_jax.algorithms.gradient_allreduce.gradient_allreduce`), computed with
optax's own ``scale_by_adam`` and ``scale_by_learning_rate``: the very operations of
``optax.adam`` fed the averaged gradients, so the results are bit-identical wherever XLA
compiles them alike (on a CPU with FMA, XLA may fuse a multiply-add in one program and not
in another, a last-bit difference; without FMA they are identical, as the tests check).
From then on the second moment ``v`` is frozen: each rank folds its local gradient into the
momentum, ``m = b1 * m + (1 - b1) * g_local``, the momentum is averaged over all ranks by the
algorithm's exchange (QAdam's 8-bit codes, 1-bit Adam's signs), the average becomes every
rank's ``m``, and the step is ``-lr * (m / bc1) / (sqrt(v / bc2) + eps)`` with
``bc_i = 1 - b_i**t`` from the running step count ``t``. That is optax's formula shape, and
it equals the SPEC's ``p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)`` in exact arithmetic
(divide the numerator and denominator by ``sqrt(bc2)``); in float32 it differs by a rounding.
In both, ``v`` is the frozen second moment floored per leaf,
``max(v, VARIANCE_FLOOR * mean(v))`` (:mod:`bagua_common.algorithms.frozen_variance`): a
coordinate whose ``v`` froze at zero (a dead unit, an embedding row unseen in the warm-up) but
whose averaged momentum is not zero would otherwise step by ``m / eps`` and diverge. Unless
``step_bound`` is None (Bagua's formula), ``bc2`` is then that of the warm-up's last step, the count ``v``
stopped at (:attr:`~bagua_common.algorithms.configs.QAdamConfig.frozen_variance_count`), and the direction
is clipped per coordinate to ``[-step_bound, step_bound]``
(:data:`~bagua_common.algorithms.frozen_variance.STEP_BOUND`).

The phase is chosen at run time from the step counter in the state with ``lax.cond``,
which executes one branch only: every rank holds the same counter, so every rank issues
the same collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from bagua_common.algorithms.configs import QAdamConfig
from bagua_common.algorithms.frozen_variance import NEGLIGIBLE_VARIANCE, VARIANCE_FLOOR
from bagua_common.algorithms.option_checks import check_bucket_bytes
from bagua_common.comm.topology import Communicators
from bagua_jax import ops
from bagua_jax.algorithms.base import (
    ConfiguredAlgorithm,
    check_communicators,
    check_float_grads,
    check_float_params,
    varying_like,
)
from bagua_jax.algorithms.gradient_allreduce import gradient_allreduce
from bagua_jax.bucketing import BucketPlan, plan_buckets
from bagua_jax.communicator import Communicator

Levels = tuple[Communicator, Communicator] | None
"""``(intra, inter)`` for a two-level exchange, or None for a flat one over ``world``."""

MomentumExchange = Callable[[list[jax.Array], tuple, Levels], tuple[list[jax.Array], tuple]]
"""Averages the momentum buckets over all ranks: ``(buckets, extra_state, levels) -> (averaged, extra_state)``."""


def variance_floors(nu: Any) -> Any:
    """Per leaf of the frozen second moment, the floor under it (see
    :mod:`bagua_common.algorithms.frozen_variance`): ``VARIANCE_FLOOR`` times the leaf's mean, or the whole
    model's mean where the leaf's is zero; computed in float32, a scalar of the leaf's dtype."""
    leaves, structure = jax.tree.flatten(nu)
    means = [jnp.sum(v, dtype=jnp.float32) / max(v.size, 1) for v in leaves]  # 0 for an empty leaf
    total = max(sum(v.size for v in leaves), 1)
    overall = sum(mean * v.size for mean, v in zip(means, leaves)) / total
    return jax.tree.unflatten(
        structure,
        [(VARIANCE_FLOOR * jnp.where(mean > 0, mean, overall)).astype(v.dtype) for mean, v in zip(means, leaves)],
    )


def momentum_plan(tree: Any, comms: Communicators, bucket_bytes: int, name: str) -> BucketPlan:
    """The bucket plan of the momentum: ``tree``'s leaves in buckets padded to a multiple of the world size, so that
    both the flat exchange (one chunk per rank) and the two-level one (``intra.size x inter.size`` chunks) split
    them evenly. Raises a TypeError for a dtype the compression kernels cannot take."""
    plan = plan_buckets(tree, bucket_bytes, pad_to=comms.world.size)
    for i, dtype in enumerate(plan.dtypes):
        if dtype not in ops.KERNEL_FLOATS:
            raise TypeError(
                f"{name}: leaf {i} has dtype {dtype}; momentum compression takes float32, float16 and bfloat16"
            )
    return plan


def held_unused(momentum: Any, nu: Any) -> Any:
    """``momentum`` with zeros for every parameter whose frozen second moment ``nu`` is negligible: its mean at most
    ``NEGLIGIBLE_VARIANCE`` times the whole model's (it had no gradient in the whole warm-up, as when the loss does not
    use it or it is frozen, or only rounding: :data:`~bagua_common.algorithms.frozen_variance.NEGLIGIBLE_VARIANCE`).
    A sign code cannot send a zero, so the exchange would hand its coordinates ``+-scale`` and it would move
    (DeepSpeed's 1-bit Adam asks the user for such a mask). A parameter with some gradient keeps its momentum
    everywhere, so its rows first used after the warm-up still learn."""
    leaves = jax.tree.leaves(nu)
    sums = [jnp.sum(v, dtype=jnp.float32) for v in leaves]
    overall = sum(sums) / max(sum(v.size for v in leaves), 1)
    used = jax.tree.unflatten(
        jax.tree.structure(nu), [total > NEGLIGIBLE_VARIANCE * overall * v.size for total, v in zip(sums, leaves)]
    )
    return jax.tree.map(lambda m, keep: jnp.where(keep, m, jnp.zeros_like(m)), momentum, used)


def adam_with_averaged_momentum(
    comms: Communicators,
    config: QAdamConfig,
    bucket_bytes: int,
    *,
    init_extra: Callable[[Any], tuple],
    exchange: MomentumExchange,
    make_state: Callable[..., Any],
    hold_unused: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """The engine of QAdam and 1-bit Adam: warm-up Adam on averaged gradients, then Adam with frozen ``v`` and a
    momentum averaged by ``exchange``. The state is ``make_state(adam, schedule, *extra)`` where ``extra`` starts
    as ``init_extra(momentum)`` (a zero momentum tree, for sizing) and is threaded through ``exchange``; the warm-up
    leaves it untouched. ``config`` (QAdam's or 1-bit Adam's) names the algorithm in errors. ``hold_unused``, for an
    exchange that cannot send a zero (1-bit signs), holds the momentum at zero, before and after the exchange, for
    every parameter whose frozen ``v`` is zero throughout (no gradient in the whole warm-up): those never move."""
    name, warmup_steps, hierarchical = config.name, config.warmup_steps, config.hierarchical
    b1, b2, eps, step_bound = config.b1, config.b2, config.eps, config.step_bound
    comms = check_communicators(comms, name)
    check_bucket_bytes(bucket_bytes, name)
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
    schedule = optax.scale_by_learning_rate(config.learning_rate)
    allreduce = gradient_allreduce(comms, hierarchical=hierarchical, bucket_bytes=bucket_bytes)

    def init_fn(params: Any) -> Any:
        check_float_params(params)
        adam_state = adam.init(params)
        return make_state(adam_state, schedule.init(params), *init_extra(adam_state.mu))

    def warmup(grads: Any, adam_state: optax.ScaleByAdamState, extra: tuple) -> tuple[Any, Any, tuple]:
        averaged, _ = allreduce.update(grads, optax.EmptyState())
        direction, adam_state = adam.update(averaged, adam_state)
        return direction, adam_state, extra

    def compressed(grads: Any, adam_state: optax.ScaleByAdamState, extra: tuple) -> tuple[Any, Any, tuple]:
        count = optax.safe_increment(adam_state.count)
        local = optax.tree.update_moment(grads, adam_state.mu, b1, 1)
        if hold_unused:
            local = held_unused(local, adam_state.nu)
        plan = momentum_plan(adam_state.mu, comms, bucket_bytes, name)
        averaged, extra = exchange(plan.flatten(local), extra, comms.levels(hierarchical, name))
        mu = plan.unflatten(averaged)
        if hold_unused:
            mu = held_unused(mu, adam_state.nu)
        # optax's bias correction and formula shape (see the module docstring), with v frozen.
        mu_hat = optax.tree.bias_correction(mu, b1, count)
        # The frozen v, floored where it is (near) zero, and bias-corrected by its own count: see
        # bagua_common.algorithms.frozen_variance.
        floored = jax.tree.map(jnp.maximum, adam_state.nu, variance_floors(adam_state.nu))
        # The frozen count is reached from the run-time count (already past it): a constant count compiles to
        # other last bits.
        frozen = config.frozen_variance_count
        variance_count = count if frozen is None else jnp.minimum(count, frozen)
        nu_hat = optax.tree.bias_correction(floored, b2, variance_count)
        direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        if step_bound is not None:  # see bagua_common.algorithms.frozen_variance.STEP_BOUND
            direction = jax.tree.map(lambda d: jnp.clip(d, -step_bound, step_bound), direction)
        return direction, optax.ScaleByAdamState(count=count, mu=mu, nu=adam_state.nu), extra

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
        del params, extra_args
        check_float_grads(updates, name)
        adam_state, schedule_state, *extra = state
        # lax.cond needs both branches to return the same types, and under shard_map that includes the mesh axes
        # a value varies over: a momentum averaged by a collective is invariant in one branch and mixed with this
        # rank's state in the other. Type every output as varying over every axis an input varies over.
        inputs = (updates, state)
        # Only the taken branch runs, and so communicates; all ranks share the counter, so all take the same one.
        direction, adam_state, extra = jax.lax.cond(
            adam_state.count < warmup_steps,
            lambda *args: varying_like(warmup(*args), inputs),
            lambda *args: varying_like(compressed(*args), inputs),
            updates,
            adam_state,
            tuple(extra),
        )
        updates, schedule_state = schedule.update(direction, schedule_state)
        return updates, make_state(adam_state, schedule_state, *extra)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def forbid_optimizer(optimizer: Any, algorithm: str) -> None:
    """Raise a ValueError when an optimizer is passed to an algorithm that is an optimizer itself."""
    if optimizer is not None:
        raise ValueError(
            f"{algorithm} is an optimizer itself: call transformation(None, comms) and give the learning rate, "
            f"betas and eps to {algorithm}(...) instead of passing {type(optimizer).__name__}"
        )


class AdamWithAveragedMomentum(ConfiguredAlgorithm):
    """What QAdam and OneBitAdam add to their shared configuration. Both replace the optimizer, so
    :meth:`transformation` takes ``optimizer=None``.
    """

    fault_tolerant = True
    replicas_identical = True
    """Every rank applies the same update, so all replicas of the parameters stay bit-identical."""

    def transformation(
        self, optimizer: optax.GradientTransformation | None, comms: Communicators
    ) -> optax.GradientTransformationExtraArgs:
        """This algorithm's transform with this configuration; ``optimizer`` must be None (it is the optimizer)."""
        forbid_optimizer(optimizer, type(self).__name__)
        return self.transform(comms)

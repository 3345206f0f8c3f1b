"""QAdam: Adam whose momentum, not its gradients, is averaged with 8-bit codes after a warm-up.

The first ``warmup_steps`` steps are plain Adam on gradients averaged in full precision
(:func:`~bagua_jax.algorithms.gradient_allreduce.gradient_allreduce`), computed with
optax's own ``scale_by_adam`` and ``scale_by_learning_rate``: the very operations of
``optax.adam`` fed the averaged gradients, so the results are bit-identical wherever XLA
compiles them alike (on a CPU with FMA, XLA may fuse a multiply-add in one program and not
in another, a last-bit difference; without FMA they are identical, as the tests check).
From then on the second moment ``v`` is
frozen: each rank folds its local gradient into the momentum,
``m = b1 * m + (1 - b1) * g_local``, the momentum is averaged over all ranks through the
ByteGrad pipeline (:func:`bagua_common.algorithms.compressed_allreduce.CompressedAllreduce.minmax_allreduce`, per bucket
padded to a multiple of the rank count), the average becomes every rank's ``m``, and the
step is ``-lr * (m / bc1) / (sqrt(v / bc2) + eps)`` with ``bc_i = 1 - b_i**t`` from the
running step count ``t``. That is optax's formula shape, and it equals the SPEC's
``p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)`` in exact arithmetic (divide the
numerator and denominator by ``sqrt(bc2)``); in float32 it differs by a rounding.
In both, ``v`` is the frozen second moment floored per leaf,
``max(v, VARIANCE_FLOOR * mean(v))`` (:mod:`bagua_common.algorithms.frozen_variance`): a coordinate
whose ``v`` froze at zero (a dead unit, an embedding row unseen in the warm-up) but whose
averaged momentum is not zero would otherwise step by ``m / eps`` and diverge.

The phase is chosen at run time from the step counter in the state with ``lax.cond``,
which executes one branch only: every rank holds the same counter, so every rank issues
the same collectives in the same order. The machinery here is shared with 1-bit Adam
(:mod:`bagua_jax.algorithms.onebit_adam`), which differs only in how the momentum is
averaged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bagua_common.algorithms.configs import QAdamConfig, config_options
from bagua_common.algorithms.frozen_variance import VARIANCE_FLOOR
from bagua_common.algorithms.option_checks import check_bucket_bytes
from bagua_jax.algorithms.base import (
    Communicators,
    ConfiguredAlgorithm,
    check_communicators,
    check_float_grads,
    check_float_params,
    varying_like,
)
from bagua_jax.algorithms.gradient_allreduce import gradient_allreduce
from bagua_jax.bucketing import DEFAULT_BUCKET_BYTES, BucketPlan, plan_buckets
from bagua_jax.communicator import Communicator
from bagua_jax.compressed_allreduce import PIPELINES

_COMPRESSIBLE = (np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))

Levels = tuple[Communicator, Communicator] | None
"""``(intra, inter)`` for a two-level exchange, or None for a flat one over ``world``."""

MomentumExchange = Callable[[list[jax.Array], tuple, Levels], tuple[list[jax.Array], tuple]]
"""Averages the momentum buckets over all ranks: ``(buckets, extra_state, levels) -> (averaged, extra_state)``."""


class QAdamState(NamedTuple):
    """QAdam's state: ``adam`` is optax's ``ScaleByAdamState`` (``count``: int32 steps taken, which also selects
    the phase; ``mu``: the momentum, identical on every rank; ``nu``: the second moment, frozen after the warm-up)
    and ``schedule`` the state of ``optax.scale_by_learning_rate`` (``EmptyState`` for a constant rate)."""

    adam: optax.ScaleByAdamState
    schedule: optax.OptState


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
        if dtype not in _COMPRESSIBLE:
            raise TypeError(
                f"{name}: leaf {i} has dtype {dtype}; momentum compression takes float32, float16 and bfloat16"
            )
    return plan


def adam_with_averaged_momentum(
    comms: Communicators,
    config: QAdamConfig,
    bucket_bytes: int,
    *,
    init_extra: Callable[[Any], tuple],
    exchange: MomentumExchange,
    make_state: Callable[..., Any],
) -> optax.GradientTransformationExtraArgs:
    """The engine of QAdam and 1-bit Adam: warm-up Adam on averaged gradients, then Adam with frozen ``v`` and a
    momentum averaged by ``exchange``. The state is ``make_state(adam, schedule, *extra)`` where ``extra`` starts
    as ``init_extra(momentum)`` (a zero momentum tree, for sizing) and is threaded through ``exchange``; the warm-up
    leaves it untouched. ``config`` (QAdam's or 1-bit Adam's) names the algorithm in errors."""
    name, warmup_steps, hierarchical = config.name, config.warmup_steps, config.hierarchical
    b1, b2, eps = config.b1, config.b2, config.eps
    comms = check_communicators(comms, name)
    check_bucket_bytes(bucket_bytes, name)
    adam = optax.scale_by_adam(b1=b1, b2=b2, eps=eps)
    schedule = optax.scale_by_learning_rate(config.learning_rate)
    allreduce = gradient_allreduce(comms, average=True, hierarchical=hierarchical, bucket_bytes=bucket_bytes)

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
        plan = momentum_plan(adam_state.mu, comms, bucket_bytes, name)
        averaged, extra = exchange(plan.flatten(local), extra, comms.levels(hierarchical, name))
        mu = plan.unflatten(averaged)
        # optax's bias correction and formula shape (see the module docstring), with v frozen.
        mu_hat = optax.tree.bias_correction(mu, b1, count)
        # The frozen v, floored where it is (near) zero: see bagua_common.algorithms.frozen_variance.
        floored = jax.tree.map(jnp.maximum, adam_state.nu, variance_floors(adam_state.nu))
        nu_hat = optax.tree.bias_correction(floored, b2, count)
        direction = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
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


def qadam(
    comms: Communicators,
    learning_rate: optax.ScalarOrSchedule,
    *,
    warmup_steps: int = 100,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    hierarchical: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> optax.GradientTransformationExtraArgs:
    """QAdam as one optax transform: local gradients in, parameter updates out (it is the optimizer itself).

    For the first ``warmup_steps`` steps each bucket of gradients is allreduced in full precision (1x an fp32
    allreduce) and the update is ``optax.adam(learning_rate, b1, b2, eps)``'s on the averaged gradients (its very
    operations; see the module docstring for XLA's fused multiply-adds).
    After that ``v`` is frozen and each rank's updated momentum goes through the ByteGrad pipeline instead: per
    bucket one all-to-all of the 8-bit-compressed bucket and one allgather of one compressed chunk, ``2 (n-1)/n``
    of a quarter of the fp32 bytes plus a 16-byte header per chunk, i.e. ~1/4 of an fp32 allreduce. With
    ``hierarchical=True`` and both ``comms.intra`` and ``comms.inter`` set, the momentum is averaged in full
    precision inside the node (both warm-up and after) and only this rank's ``1/intra.size`` slice is exchanged
    compressed between nodes; otherwise it falls back to the flat exchange over ``world``. Every rank ends each
    step with the same momentum bits, so the replicas stay identical. Choose it over ByteGrad + Adam when training
    with Adam on bandwidth-bound links: compressing the momentum, a smoothed quantity, loses less than compressing
    raw gradients, provided the warm-up is long enough for ``v`` to settle. After the warm-up the frozen ``v`` is
    floored at 1% of its leaf's mean (:mod:`bagua_common.algorithms.frozen_variance`), so coordinates whose ``v`` froze at
    zero (dead units, embedding rows unseen in the warm-up) take bounded steps.
    """

    def exchange(buckets: list[jax.Array], extra: tuple, levels: Levels) -> tuple[list[jax.Array], tuple]:
        return [PIPELINES.minmax_over(bucket, comms.world, levels)[0] for bucket in buckets], extra

    config = QAdamConfig(learning_rate, warmup_steps, b1, b2, eps, hierarchical)
    return adam_with_averaged_momentum(
        comms,
        config,
        bucket_bytes,
        init_extra=lambda momentum: (),
        exchange=exchange,
        make_state=QAdamState,
    )


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

    replicas_identical = True
    """Every rank applies the same update, so all replicas of the parameters stay bit-identical."""

    def transformation(
        self, optimizer: optax.GradientTransformation | None, comms: Communicators
    ) -> optax.GradientTransformationExtraArgs:
        """This algorithm's transform with this configuration; ``optimizer`` must be None (it is the optimizer)."""
        forbid_optimizer(optimizer, type(self).__name__)
        return type(self)._transform(comms, **config_options(self))


@dataclass(frozen=True)
class QAdam(AdamWithAveragedMomentum, QAdamConfig):
    """The :class:`~bagua_jax.algorithms.base.Algorithm` form of :func:`qadam`: Adam with full-precision gradient
    averaging for ``warmup_steps`` steps (1x an fp32 allreduce per step), then frozen ``v`` and 8-bit compressed
    momentum averaging (~1/4 of an fp32 allreduce; with ``hierarchical`` only between nodes). It replaces the
    optimizer, so :meth:`transformation` takes ``optimizer=None``. Choose it for Adam training whose gradient
    exchange is bandwidth-bound.
    """

    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    _transform = staticmethod(qadam)

"""1-bit Adam: QAdam's scheme with the momentum averaged through 1-bit signs and error feedback.

Beyond the original Bagua; DeepSpeed's 1-bit Adam (Tang et al., 2021) is the reference.
The warm-up is QAdam's: ``warmup_steps`` steps of plain Adam on gradients averaged in
full precision, with ``optax.adam``'s own operations. After it the second moment is frozen
and each rank's momentum ``m = b1 * m + (1 - b1) * g_local`` is averaged with
:func:`bagua_common.algorithms.compressed_allreduce.CompressedAllreduce.sign_allreduce`, per bucket padded to a multiple
of the rank count: the worker adds its residual, compresses the bucket into one chunk
per rank (each element ``+-mean|chunk|``) and keeps the compression error as its new
residual; after the all-to-all each rank averages the ``n`` decoded chunks of its slot,
adds its server residual, compresses that chunk again and keeps that error; an
allgather hands everyone every reduced chunk. The update is QAdam's,
``-lr * (m / bc1) / (sqrt(v / bc2) + eps)`` (DeepSpeed omits the bias corrections; they
are kept here so that 1-bit Adam and QAdam differ only in the momentum exchange), with
QAdam's floor under the frozen ``v`` (:mod:`bagua_common.algorithms.frozen_variance`).

The one departure from QAdam's step (beyond SPEC section 3, which leaves it open): sign
compression cannot send a zero, so a coordinate whose momentum is zero would receive
``+-scale`` and move. DeepSpeed asks the user for a momentum mask of such coordinates; here
the mask comes from the frozen second moment: for a parameter whose ``v`` is zero or negligible
(it had no gradient in the whole warm-up, or only rounding: the loss does not use it, or it is frozen), the
momentum is held at zero before and after the exchange
(:func:`~bagua_jax.algorithms.adam_engine.held_unused`), so that parameter never moves (and does
not learn if its gradient first appears after the warm-up; QAdam's 8-bit codes send exact
zeros and need no mask). Every other parameter steps as before, including its coordinates
whose ``v`` froze at zero (embedding rows first seen later), which the floor bounds.

Residuals start at zero and only the compressed phase writes them, so they are zero
when compression starts, as in DeepSpeed; they are not reset afterwards. Because each
error is fed into the next compression, what the exchange loses is carried forward,
not dropped: summed over steps, the averaged momentum differs from the exact average
of the local momenta only by the current residuals.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from bagua_common.algorithms.configs import OneBitAdamConfig
from bagua_common.algorithms.registry import as_config
from bagua_common.comm.topology import Communicators
from bagua_jax.algorithms.adam_engine import (
    AdamWithAveragedMomentum,
    Levels,
    adam_with_averaged_momentum,
    momentum_plan,
)
from bagua_jax.algorithms.base import check_communicators, implements
from bagua_jax.bucketing import DEFAULT_BUCKET_BYTES
from bagua_jax.compressed_allreduce import PIPELINES


class OneBitAdamState(NamedTuple):
    """1-bit Adam's state: ``adam`` and ``schedule`` as in :class:`~bagua_jax.algorithms.qadam.QAdamState`, plus
    per bucket the float32 error-feedback residuals, zeros until compression starts. ``worker_residuals[i]`` has
    bucket i's padded size, or ``1/intra.size`` of it when hierarchical (this rank's node slice);
    ``server_residuals[i]`` has ``1/n`` of the bucket's size (this rank's reduced chunk)."""

    adam: optax.ScaleByAdamState
    schedule: optax.OptState
    worker_residuals: tuple[jax.Array, ...]
    server_residuals: tuple[jax.Array, ...]


def onebit_adam(
    comms: Communicators, *config: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **options: Any
) -> optax.GradientTransformationExtraArgs:
    """1-bit Adam as one optax transform: local gradients in, parameter updates out (it is the optimizer itself).

    For the first ``warmup_steps`` steps each bucket of gradients is allreduced in full precision (1x an fp32
    allreduce) and the update is ``optax.adam(learning_rate, b1, b2, eps)``'s on the averaged gradients (its very
    operations, as in :func:`~bagua_jax.algorithms.qadam.qadam`).
    After that ``v`` is frozen and each rank's momentum is averaged with 1-bit signs and error feedback on both the
    worker and the server side: per bucket one all-to-all of the sign-compressed bucket and one allgather of one
    sign-compressed chunk, ``2 (n-1)/n`` of a thirty-second of the fp32 bytes plus a 16-byte header per chunk, i.e.
    ~1/32 of an fp32 allreduce. With ``hierarchical=True`` and both ``comms.intra`` and ``comms.inter`` set, the
    momentum is averaged in full precision inside the node and only this rank's ``1/intra.size`` slice is
    exchanged in signs between nodes; otherwise it falls back to the flat exchange over ``world``. The state holds
    float32 residuals sized from the communicators, so ``init`` must see their sizes (call it inside the per-rank
    step, or give ``LaxCommunicator`` its ``size``). Every rank ends each step with the same momentum bits. Choose
    it over QAdam when bandwidth is scarcer still and the model tolerates a noisier momentum (the residuals carry
    each step's error into the next, so none is lost); keep the warm-up long enough for ``v`` to settle.
    """
    config = as_config(OneBitAdamConfig, *config, **options)
    name = config.name
    # The closures below read ``comms.world``: a bare communicator must be wrapped first.
    comms = check_communicators(comms, name)

    def init_extra(momentum: Any) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
        plan = momentum_plan(momentum, comms, bucket_bytes, name)
        levels = comms.levels(config.hierarchical, name)
        # The worker compresses what this rank sends between nodes: the whole bucket, or its node slice.
        share = levels[0].size if levels else 1
        workers = tuple(jnp.zeros(b.size // share, jnp.float32) for b in plan.buckets)
        servers = tuple(jnp.zeros(b.size // comms.world.size, jnp.float32) for b in plan.buckets)
        return workers, servers

    def exchange(buckets: list[jax.Array], extra: tuple, levels: Levels) -> tuple[list[jax.Array], tuple]:
        workers, servers = extra
        if [b.size for b in buckets] != [w.size * (levels[0].size if levels else 1) for w in workers]:
            raise ValueError(
                f"{name}: the state's residuals were sized for other parameters or another communicator layout"
            )
        averaged, new_workers, new_servers = [], [], []
        for bucket, worker, server in zip(buckets, workers, servers):
            result, worker, server = PIPELINES.sign_allreduce(bucket, comms.world, worker, server, levels=levels)
            averaged.append(result)
            new_workers.append(worker)
            new_servers.append(server)
        return averaged, (tuple(new_workers), tuple(new_servers))

    return adam_with_averaged_momentum(
        comms,
        config,
        bucket_bytes,
        init_extra=init_extra,
        exchange=exchange,
        make_state=OneBitAdamState,
        hold_unused=True,
    )


@implements(OneBitAdamConfig)
class OneBitAdam(AdamWithAveragedMomentum):
    """The :class:`~bagua_jax.algorithms.base.Algorithm` form of :func:`onebit_adam`: Adam with full-precision
    gradient averaging for ``warmup_steps`` steps (1x an fp32 allreduce per step), then frozen ``v`` and 1-bit
    momentum averaging with error feedback on both sides (~1/32 of an fp32 allreduce; with ``hierarchical`` only
    between nodes). It replaces the optimizer, so :meth:`transformation` takes ``optimizer=None``. Choose it for
    Adam training on the slowest links, where even QAdam's 8-bit momentum is too many bytes.
    """

    _transform = staticmethod(onebit_adam)

"""QAdam: Adam whose momentum, not its gradients, is averaged with 8-bit codes after a warm-up.

The warm-up, the frozen second moment, its floor and the update are the Adam engine's
(:mod:`bagua_jax.algorithms.adam_engine`, shared with 1-bit Adam); what is QAdam's own is the
exchange: after the warm-up each rank's momentum is averaged through the ByteGrad pipeline
(:func:`bagua_common.algorithms.compressed_allreduce.CompressedAllreduce.minmax_allreduce`, per
bucket padded to a multiple of the rank count), so every rank ends each step with the same
momentum bits.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import optax

from bagua_common.algorithms.configs import QAdamConfig
from bagua_common.algorithms.registry import as_config
from bagua_common.comm.topology import Communicators
from bagua_jax.algorithms.adam_engine import AdamWithAveragedMomentum, Levels, adam_with_averaged_momentum
from bagua_jax.algorithms.base import check_communicators, implements
from bagua_jax.bucketing import DEFAULT_BUCKET_BYTES
from bagua_jax.compressed_allreduce import PIPELINES


class QAdamState(NamedTuple):
    """QAdam's state: ``adam`` is optax's ``ScaleByAdamState`` (``count``: int32 steps taken, which also selects
    the phase; ``mu``: the momentum, identical on every rank; ``nu``: the second moment, frozen after the warm-up)
    and ``schedule`` the state of ``optax.scale_by_learning_rate`` (``EmptyState`` for a constant rate)."""

    adam: optax.ScaleByAdamState
    schedule: optax.OptState


def qadam(
    comms: Communicators, *config: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **options: Any
) -> optax.GradientTransformationExtraArgs:
    """QAdam as one optax transform: local gradients in, parameter updates out (it is the optimizer itself).

    ``config`` holds the learning rate (a number or an optax schedule) and Adam's hyperparameters. For the first
    ``warmup_steps`` steps each bucket of gradients is allreduced in full precision (1x an fp32
    allreduce) and the update is ``optax.adam(learning_rate, b1, b2, eps)``'s on the averaged gradients (its very
    operations; see :mod:`bagua_jax.algorithms.adam_engine` for XLA's fused multiply-adds).
    After that ``v`` is frozen and each rank's updated momentum goes through the ByteGrad pipeline instead: per
    bucket one all-to-all of the 8-bit-compressed bucket and one allgather of one compressed chunk, ``2 (n-1)/n``
    of a quarter of the fp32 bytes plus a 16-byte header per chunk, i.e. ~1/4 of an fp32 allreduce. With
    ``hierarchical=True`` and both ``comms.intra`` and ``comms.inter`` set, the momentum is averaged in full
    precision inside the node (both warm-up and after) and only this rank's ``1/intra.size`` slice is exchanged
    compressed between nodes; otherwise it falls back to the flat exchange over ``world``. Every rank ends each
    step with the same momentum bits, so the replicas stay identical. Choose it over ByteGrad + Adam when training
    with Adam on bandwidth-bound links: compressing the momentum, a smoothed quantity, loses less than compressing
    raw gradients, provided the warm-up is long enough for ``v`` to settle. After the warm-up the frozen ``v`` is
    floored at 1% of its leaf's mean (:mod:`bagua_common.algorithms.frozen_variance`), so coordinates
    whose ``v`` froze at zero (dead units, embedding rows unseen in the warm-up) take bounded steps.
    """
    config = as_config(QAdamConfig, *config, **options)
    # The exchange below reads ``comms.world``: a bare communicator must be wrapped first.
    comms = check_communicators(comms, config.name)

    def exchange(buckets: list[jax.Array], extra: tuple, levels: Levels) -> tuple[list[jax.Array], tuple]:
        return [PIPELINES.minmax_allreduce(bucket, comms.world, levels=levels)[0] for bucket in buckets], extra

    return adam_with_averaged_momentum(
        comms,
        config,
        bucket_bytes,
        init_extra=lambda momentum: (),
        exchange=exchange,
        make_state=QAdamState,
    )


@implements(QAdamConfig)
class QAdam(AdamWithAveragedMomentum):
    """The :class:`~bagua_jax.algorithms.base.Algorithm` form of :func:`qadam`: Adam with full-precision gradient
    averaging for ``warmup_steps`` steps (1x an fp32 allreduce per step), then frozen ``v`` and 8-bit compressed
    momentum averaging (~1/4 of an fp32 allreduce; with ``hierarchical`` only between nodes). It replaces the
    optimizer, so :meth:`transformation` takes ``optimizer=None``. Choose it for Adam training whose gradient
    exchange is bandwidth-bound.
    """

    _transform = staticmethod(qadam)

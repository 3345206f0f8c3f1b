"""ByteGrad: gradient allreduce with 8-bit min-max codes on the wire.

Per step each rank's gradients are flattened into buckets padded to a multiple of the
world size ``n``, and each bucket goes through the pipeline of
:func:`bagua_common.algorithms.compressed_allreduce.CompressedAllreduce.minmax_allreduce`: compress into ``n`` chunks,
all-to-all, decode and average the ``n`` chunks of this rank's slot in float32,
compress that average as one chunk, allgather, decode. Every rank ends with the same
bits, so the replicas stay identical, at about a quarter of the bytes of an fp32
allreduce. The hierarchical variant reduces in full precision inside the node and
compresses only between nodes (:func:`bagua_common.algorithms.compressed_allreduce.hierarchical`).

Error feedback (an option beyond the original Bagua) adds the previous step's
compression error to the gradients before the first compression, so that error is
not lost but sent later; its float32 residuals, one per bucket, live in the state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from bagua_common.algorithms.configs import ByteGradConfig
from bagua_common.algorithms.option_checks import check_bucket_bytes
from bagua_common.algorithms.registry import as_config
from bagua_common.comm.topology import Communicators
from bagua_jax import ops
from bagua_jax.algorithms.base import (
    ConfiguredAlgorithm,
    check_communicators,
    check_float_grads,
    check_float_params,
    implements,
)
from bagua_jax.bucketing import DEFAULT_BUCKET_BYTES, BucketPlan, plan_buckets
from bagua_jax.compressed_allreduce import PIPELINES


class ByteGradState(NamedTuple):
    """ByteGrad's state: with error feedback, one float32 residual per bucket (its padded size, or the size of this
    rank's intra-node slice, ``1/intra.size`` of it, when hierarchical); without, an empty tuple."""

    residuals: tuple[jax.Array, ...]


def _check_compressible(plan: BucketPlan, algorithm: str) -> None:
    for i, dtype in enumerate(plan.dtypes):
        if dtype not in ops.KERNEL_FLOATS:
            raise TypeError(
                f"{algorithm}: leaf {i} has dtype {dtype}; the 8-bit codes compress float32, float16 and bfloat16 only"
            )


def bytegrad(
    comms: Communicators, *config: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **options: Any
) -> optax.GradientTransformationExtraArgs:
    """Average (or with ``average=False`` sum) the gradients over all ranks through 8-bit min-max compression.

    Per step and bucket (padded to a multiple of ``n = comms.world.size``) each rank sends the compressed bucket
    through one all-to-all and one compressed chunk through one allgather: about ``2 (n-1)/n`` of a quarter of the
    gradient bytes plus a 16-byte header per chunk, i.e. ~1/4 of an fp32 allreduce. With ``hierarchical=True`` and
    both ``comms.intra`` and ``comms.inter`` set, the node reduces in full precision (an intra reduce-scatter and
    allgather, ``2 (a-1)/a`` of the gradient bytes over the fast links) and only this rank's ``1/a`` slice is
    exchanged compressed between nodes; without both levels it falls back to the flat pipeline
    over ``world`` (a hierarchical sum is the node mean scaled by the node size after the exchange). The
    per-element error is at most ``(hi-lo)/508`` of each chunk, twice, plus float32 rounding; ``error_feedback``
    carries the first compression's error into the next step (a float32 residual per bucket in the state, so
    ``init`` must see the communicators' sizes: call it inside the per-rank step, or give ``LaxCommunicator`` its
    ``size``). Choose it when gradient allreduce is bandwidth-bound and models tolerate 8-bit gradients (most do,
    error feedback helps the rest); results are bit-identical across ranks.
    """
    config = as_config(ByteGradConfig, *config, **options)
    name, average, hierarchical, error_feedback = (
        config.name,
        config.average,
        config.hierarchical,
        config.error_feedback,
    )
    comms = check_communicators(comms, name)
    bucket_bytes = check_bucket_bytes(bucket_bytes, name)

    def residual_sizes(plan: BucketPlan) -> list[int]:
        levels = comms.levels(hierarchical, name)
        share = levels[0].size if levels else 1
        return [bucket.size // share for bucket in plan.buckets]

    def init_fn(params: Any) -> ByteGradState:
        check_float_params(params)
        if not error_feedback:
            return ByteGradState(residuals=())
        plan = plan_buckets(params, bucket_bytes, pad_to=comms.world.size)
        _check_compressible(plan, name)
        return ByteGradState(residuals=tuple(jnp.zeros(size, jnp.float32) for size in residual_sizes(plan)))

    def update_fn(
        updates: Any, state: ByteGradState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, ByteGradState]:
        del params, extra_args
        check_float_grads(updates, name)
        levels = comms.levels(hierarchical, name)
        plan = plan_buckets(updates, bucket_bytes, pad_to=comms.world.size)
        _check_compressible(plan, name)
        buckets = plan.flatten(updates)
        if error_feedback:
            expected = residual_sizes(plan)
            got = [int(r.size) for r in state.residuals]
            if got != expected:
                raise ValueError(
                    f"{name}: the state holds residuals of sizes {got} but these gradients need {expected}; "
                    "was the state initialised with other parameters or another communicator layout?"
                )
            residuals: list[jax.Array | None] = list(state.residuals)
        else:
            residuals = [None] * len(buckets)
        reduced, new_residuals = [], []
        for bucket, residual in zip(buckets, residuals):
            result, residual = PIPELINES.minmax_allreduce(
                bucket, comms.world, levels=levels, average=average, residual=residual
            )
            reduced.append(result)
            new_residuals.append(residual)
        new_state = ByteGradState(residuals=tuple(new_residuals)) if error_feedback else state
        return plan.unflatten(reduced), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@implements(ByteGradConfig)
class ByteGrad(ConfiguredAlgorithm):
    """The :class:`~bagua_jax.algorithms.base.Algorithm` form of :func:`bytegrad`: 8-bit compressed gradient
    averaging (about 1/4 of an fp32 allreduce's bytes per rank per step; with ``hierarchical`` only the inter-node
    exchange is compressed and intra-node traffic stays full precision) followed by the user's optimizer, so every
    rank applies the same update. ``error_feedback`` keeps per-bucket float32 residuals in the state. Choose it when
    gradient communication is bandwidth-bound, in particular between nodes.
    """

    fault_tolerant = True
    replicas_identical = True
    """Every rank applies the same update, so all replicas of the parameters stay bit-identical."""

    _transform = staticmethod(bytegrad)

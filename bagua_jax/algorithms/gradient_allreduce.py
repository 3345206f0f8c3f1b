"""GradientAllReduce: full-precision allreduce of the gradients before the optimizer.

Every step each rank's local gradients are flattened into buckets (see
:mod:`bagua_jax.bucketing`) and every bucket is allreduced (averaged or summed) over
all ranks, so every rank feeds the same gradients to the same optimizer and the
replicas stay bit-identical. This is the baseline the other algorithms are measured
against: per rank it sends ``2 (n-1)/n`` times the gradient bytes, the ring allreduce
cost.

The hierarchical variant (SPEC: reduce inside the node, allreduce between nodes,
broadcast inside the node) is :func:`bagua_common.algorithms.compressed_allreduce.allreduce_over`'s
two-level form, shared with ``bagua_torch``: an intra-node reduce-scatter, an inter-node
allreduce of this rank's slice and an intra-node allgather. Its intra-node legs are also
bandwidth-optimal over :class:`~bagua_jax.LaxCommunicator`, which has no rooted
collectives (a reduce plus a broadcast would cost a full allreduce each there).
"""

from __future__ import annotations

from typing import Any

import optax

from bagua_common.algorithms.compressed_allreduce import allreduce_over
from bagua_common.algorithms.configs import GradientAllReduceConfig
from bagua_common.algorithms.option_checks import check_bucket_bytes
from bagua_common.algorithms.registry import as_config
from bagua_common.comm.topology import Communicators
from bagua_jax.algorithms.base import (
    ConfiguredAlgorithm,
    check_communicators,
    check_float_grads,
    check_float_params,
    implements,
)
from bagua_jax.bucketing import DEFAULT_BUCKET_BYTES, plan_buckets
from bagua_jax.step_means import StepMeans


def gradient_allreduce(
    comms: Communicators, *config: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **options: Any
) -> optax.GradientTransformationExtraArgs:
    """Allreduce the gradients in full precision, averaging (``average=True``) or summing them over all ranks.

    Per step each bucket of at most ``bucket_bytes`` is allreduced once over ``comms.world``: ``2 (n-1)/n`` of the
    gradient bytes per rank, exactly an fp32 ring allreduce (the reference every other algorithm is compared to),
    and every rank gets bit-identical results. With ``hierarchical=True`` and both ``comms.intra`` and
    ``comms.inter`` set, each bucket is reduce-scattered inside the node, this rank's slice is allreduced between
    nodes and the slices are allgathered inside the node: the same total bytes per rank, of which only
    ``2 (b-1)/(a b)`` of the gradient crosses nodes (``a`` ranks per node, ``b`` nodes); without both levels it
    falls back to the flat allreduce over ``world``. Choose it when bandwidth is not the bottleneck or when exact
    synchronous SGD is required; choose the hierarchical form when links between nodes are much slower than inside
    them. The state is ``optax.EmptyState``; ``init`` checks that the parameters are floating point.
    """
    config = as_config(GradientAllReduceConfig, *config, **options)
    name, hierarchical = config.name, config.hierarchical
    comms = check_communicators(comms, name)
    bucket_bytes = check_bucket_bytes(bucket_bytes, name)
    op = "avg" if config.average else "sum"

    def init_fn(params: Any) -> optax.EmptyState:
        check_float_params(params)
        return optax.EmptyState()

    def update_fn(
        updates: Any, state: optax.EmptyState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, optax.EmptyState]:
        del params
        check_float_grads(updates, name)
        levels = comms.levels(hierarchical, name)
        plan = plan_buckets(updates, bucket_bytes, pad_to=levels[0].size if levels else 1)
        step_means: StepMeans | None = extra_args.get("step_means")
        if step_means is not None and not levels and op == "avg":
            reduced = step_means.averaged_with(plan, updates, lambda bucket: comms.world.allreduce(bucket, op))
        else:
            reduced = [allreduce_over(bucket, comms.world, levels, op) for bucket in plan.flatten(updates)]
        return plan.unflatten(reduced), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@implements(GradientAllReduceConfig)
class GradientAllReduce(ConfiguredAlgorithm):
    """The :class:`~bagua_jax.algorithms.base.Algorithm` form of :func:`gradient_allreduce`: full-precision gradient
    allreduce (``2 (n-1)/n`` of the gradient bytes per rank per step, the fp32 baseline) followed by the user's
    optimizer, so every rank applies the same update. ``hierarchical`` reduces inside the node first and only
    sends a ``1/a`` slice between nodes (when ``comms`` has both levels); ``average=False`` sums instead of
    averaging. Choose it as the exact, simple default; switch to ByteGrad or a decentralized algorithm when
    gradient communication dominates the step time.
    """

    fault_tolerant = True
    replicas_identical = True
    """Every rank applies the same update, so all replicas of the parameters stay bit-identical."""

    _transform = staticmethod(gradient_allreduce)

"""GradientAllReduce: full-precision allreduce of the gradients before the optimizer.

Every step each rank's local gradients are flattened into buckets (see
:mod:`bagua_jax.bucketing`) and every bucket is allreduced (averaged or summed) over
all ranks, so every rank feeds the same gradients to the same optimizer and the
replicas stay bit-identical. This is the baseline the other algorithms are measured
against: per rank it sends ``2 (n-1)/n`` times the gradient bytes, the ring allreduce
cost.

The hierarchical variant (SPEC: reduce inside the node, allreduce between nodes,
broadcast inside the node) is implemented as an intra-node reduce-scatter, an
inter-node allreduce of this rank's slice and an intra-node allgather. The math is the
same (an intra-node sum, then a sum over nodes), but every rank of a node carries
``1/intra.size`` of the inter-node traffic instead of one root carrying all of it, the
intra-node legs are bandwidth-optimal (a reduce plus a broadcast would cost a full
allreduce each over :class:`~bagua_jax.LaxCommunicator`, which has no rooted
collectives), and no rank waits on a root.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax

from bagua_jax.algorithms.base import Communicators, check_float_params
from bagua_jax.bucketing import DEFAULT_BUCKET_BYTES, plan_buckets
from bagua_jax.communicator import Communicator


def check_communicators(comms: Any, algorithm: str) -> Communicators:
    """Return ``comms`` if it is a :class:`Communicators`, else raise a TypeError that says how to build one."""
    if not isinstance(comms, Communicators):
        raise TypeError(
            f"{algorithm}: comms must be a bagua_jax.algorithms.base.Communicators, got {type(comms).__name__}; "
            "wrap a single communicator as Communicators(world=comm)"
        )
    return comms


def check_bucket_bytes(bucket_bytes: Any, algorithm: str) -> int:
    """Return ``bucket_bytes`` as an int if it is a positive integer, else raise a ValueError."""
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ValueError(f"{algorithm}: bucket_bytes must be a positive int, got {bucket_bytes!r}")
    return bucket_bytes


def check_flags(algorithm: str, **flags: Any) -> None:
    """Raise a TypeError unless every keyword argument is a bool (catches e.g. ``average="sum"``)."""
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{algorithm}: {key} must be a bool, got {value!r}")


def check_float_grads(grads: Any, algorithm: str) -> None:
    """Raise a TypeError naming the first non-floating gradient leaf (integer gradients cannot be averaged)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(
                f"{algorithm}: gradient {jax.tree_util.keystr(path)} has dtype {leaf.dtype}; "
                "gradients must be floating point"
            )


def two_levels(comms: Communicators, hierarchical: bool, algorithm: str) -> tuple[Communicator, Communicator] | None:
    """``(intra, inter)`` when ``hierarchical`` is asked for and both levels are set, else None (flat over ``world``).

    Called while tracing, where every size is known; raises a ValueError if the two levels do not tile ``world``.
    """
    if not (hierarchical and comms.hierarchical):
        return None
    intra, inter = comms.intra, comms.inter
    if intra.size * inter.size != comms.world.size:
        raise ValueError(
            f"{algorithm}: intra ({intra.size} ranks) x inter ({inter.size} ranks) must equal world "
            f"({comms.world.size} ranks)"
        )
    return intra, inter


def gradient_allreduce(
    comms: Communicators,
    *,
    average: bool = True,
    hierarchical: bool = False,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
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
    name = "gradient_allreduce"
    comms = check_communicators(comms, name)
    bucket_bytes = check_bucket_bytes(bucket_bytes, name)
    check_flags(name, average=average, hierarchical=hierarchical)
    op = "avg" if average else "sum"

    def init_fn(params: Any) -> optax.EmptyState:
        check_float_params(params)
        return optax.EmptyState()

    def update_fn(
        updates: Any, state: optax.EmptyState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, optax.EmptyState]:
        del params, extra_args
        check_float_grads(updates, name)
        levels = two_levels(comms, hierarchical, name)
        plan = plan_buckets(updates, bucket_bytes, pad_to=levels[0].size if levels else 1)
        reduced = []
        for bucket in plan.flatten(updates):
            if levels is None:
                reduced.append(comms.world.allreduce(bucket, op))
            else:
                intra, inter = levels
                mine = intra.reduce_scatter(bucket.reshape(intra.size, -1), op)
                reduced.append(intra.allgather(inter.allreduce(mine, op)).reshape(-1))
        return plan.unflatten(reduced), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@dataclass(frozen=True)
class GradientAllReduce:
    """The :class:`~bagua_jax.algorithms.base.Algorithm` form of :func:`gradient_allreduce`: full-precision gradient
    allreduce (``2 (n-1)/n`` of the gradient bytes per rank per step, the fp32 baseline) followed by the user's
    optimizer, so every rank applies the same update. ``hierarchical`` reduces inside the node first and only
    sends a ``1/a`` slice between nodes (when ``comms`` has both levels); ``average=False`` sums instead of
    averaging. Choose it as the exact, simple default; switch to ByteGrad or a decentralized algorithm when
    gradient communication dominates the step time.
    """

    hierarchical: bool = False
    average: bool = True
    bucket_bytes: int = DEFAULT_BUCKET_BYTES

    def transformation(
        self, optimizer: optax.GradientTransformation, comms: Communicators
    ) -> optax.GradientTransformationExtraArgs:
        """``optax.chain(gradient_allreduce(comms, ...), optimizer)``: communicate, then run the optimizer."""
        return optax.chain(
            gradient_allreduce(
                comms, average=self.average, hierarchical=self.hierarchical, bucket_bytes=self.bucket_bytes
            ),
            optimizer,
        )

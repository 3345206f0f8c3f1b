"""Low-precision decentralized SGD: ring averaging of 8-bit compressed weight differences.

The ranks form a ring (``left = (r - 1) mod n``, ``right = (r + 1) mod n``). After the local
optimizer step gives weights ``x``, each rank, every ``communication_interval`` steps, computes
``z = x + L/3 + R/3 - (5/3) w`` from its last communicated weights ``w`` and its copies ``L``
and ``R`` of its neighbours' ``w``; sends ``Q(z)`` (MinMaxUInt8, one chunk per bucket) to both
neighbours; and sets ``L += deQ(from left)``, ``R += deQ(from right)``, ``x = w + deQ(Q(z))``,
``w = x`` (SPEC section 3). Since every rank adds exactly the decoded message its neighbours
add to their copies, ``L`` and ``R`` stay bit-identical to the neighbours' ``w``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from bagua_common.algorithms.configs import LowPrecisionDecentralizedConfig
from bagua_common.algorithms.option_checks import check_bucket_bytes
from bagua_common.algorithms.registry import as_config
from bagua_common.comm.topology import Communicators, ring_peers
from bagua_jax import ops
from bagua_jax.algorithms.base import (
    ConfiguredAlgorithm,
    check_communicators,
    check_float_params,
    check_weights_given,
    implements,
)
from bagua_jax.algorithms.decentralized import WithoutAveraging, counting_only
from bagua_jax.bucketing import DEFAULT_BUCKET_BYTES, BucketPlan, plan_buckets
from bagua_jax.communicator import Communicator

Buckets = tuple[jax.Array, ...]
Copies = tuple[Buckets, Buckets, Buckets]  # (w, L, R)


class LowPrecisionDecentralizedState(NamedTuple):
    """State of :func:`low_precision_decentralized`, one float32 array per bucket for the copies.

    ``step`` counts update calls (int32 scalar); ``weights`` is ``w`` (this rank's last
    communicated weights), ``left`` and ``right`` are ``L`` and ``R`` (the ring neighbours'
    last communicated weights, as this rank has reconstructed them).
    """

    step: jax.Array
    weights: Buckets
    left: Buckets
    right: Buckets


def low_precision_decentralized(
    comms: Communicators, *config: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **options: Any
) -> optax.GradientTransformationExtraArgs:
    """Low-precision decentralized SGD as an optax transform to chain *after* the optimizer.

    ``update(updates, state, params)`` takes the optimizer's ``updates`` and the pre-step
    weights ``params``; on steps ``t`` with ``t % communication_interval == 0`` it returns
    ``x_new - params``, where ``x_new`` is the ring-averaged result of the local step
    ``params + updates`` (see the module docstring), and on other steps ``updates`` unchanged.
    ``init`` sets ``w``, ``L`` and ``R`` to the initial weights, so every rank must start from
    the same weights (broadcast them first). Per communication step each rank sends the 8-bit
    codes of each bucket (``B / 4`` plus a 16-byte header, for ``B`` fp32 bytes) to its two
    neighbours: ``B / 2``, i.e. ``n / (4(n-1))`` of a ring allreduce of ``B`` (a quarter for
    ``n = 2``, where both neighbours are one rank and it is sent once). With
    :class:`~bagua_jax.LaxCommunicator` the same, as one ``ppermute`` per neighbour. Hierarchical
    (``hierarchical=True`` and ``comms`` has ``intra`` and ``inter``):
    the local step's weights are first averaged inside the node at full precision (the bytes of
    an intra-node allreduce), then each of the node's ``k`` ranks runs the ring across nodes on
    its ``1/k`` slice of every bucket (one MinMaxUInt8 chunk per slice), so a node sends ``B /
    2`` across nodes in all; otherwise the ring is ``comms.world``. Choose it on slow,
    high-latency networks where even decentralized full-precision exchange is too expensive.
    """
    config = as_config(LowPrecisionDecentralizedConfig, *config, **options)
    name, communication_interval = config.name, config.communication_interval
    comms = check_communicators(comms, name)
    check_bucket_bytes(bucket_bytes, name)
    use_hierarchy = config.hierarchical and comms.hierarchical

    def init_fn(params: Any) -> LowPrecisionDecentralizedState:
        check_float_params(params)
        copies = _float32_buckets(plan_buckets(params, bucket_bytes), params)
        return LowPrecisionDecentralizedState(jnp.zeros([], jnp.int32), copies, copies, copies)

    def update_fn(
        updates: Any, state: LowPrecisionDecentralizedState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, LowPrecisionDecentralizedState]:
        del extra_args
        check_weights_given(params, name)
        plan = plan_buckets(params, bucket_bytes)
        if len(state.weights) != len(plan.buckets) or any(
            w.shape != (b.size,) for w, b in zip(state.weights, plan.buckets)
        ):
            raise ValueError(
                f"{name}: the state was built for other parameter shapes or "
                "another bucket_bytes; call init with these parameters"
            )
        local = optax.apply_updates(params, updates)

        def communicate(copies: Copies) -> tuple[Any, Copies]:
            x = _float32_buckets(plan, local)
            if use_hierarchy:
                new_x, new_copies = _hierarchical_exchange(x, copies, comms.intra, comms.inter)
            elif comms.world.size == 1:  # a ring of one has no neighbours; the copies are never read
                new_x, new_copies = x, copies
            else:
                new_x, new_copies = _ring_exchange(x, copies, comms.world)
            averaged = plan.unflatten(list(new_x))
            return jax.tree.map(lambda a, p, u: (a - p).astype(u.dtype), averaged, params, updates), new_copies

        def skip(copies: Copies) -> tuple[Any, Copies]:
            return updates, copies

        # Every rank holds the same step, so all take the same branch, and off steps send nothing.
        # Returning x_new - params means optax's params + updates is x_new up to one rounding
        # (a few ulps); w keeps the exact x_new, which is what the neighbours' copies track.
        new_updates, (w, left, right) = lax.cond(
            state.step % communication_interval == 0,
            communicate,
            skip,
            (state.weights, state.left, state.right),
        )
        return new_updates, LowPrecisionDecentralizedState(optax.safe_int32_increment(state.step), w, left, right)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _float32_buckets(plan: BucketPlan, tree: Any) -> Buckets:
    # The copies and the ring arithmetic are float32 whatever the parameters' dtype, as the
    # kernels compute; the weights round to their own dtype only when unflattened.
    return tuple(b.astype(jnp.float32) for b in plan.flatten(tree))


def _ring_exchange(x: Buckets, copies: Copies, ring: Communicator) -> tuple[Buckets, Copies]:
    """One ring round on every bucket (``ring.size >= 2``): the new ``x`` and ``(w, L, R)``."""
    n = ring.size
    # With two ranks both neighbours are the same rank, and every rank sends the same Q(z) to
    # both, so one message serves as both the left and the right one: half the bytes.
    schedule = np.array([ring_peers(rank, n) for rank in range(n)])[None]
    new_x, new_left, new_right = [], [], []
    for xb, wb, lb, rb in zip(x, *copies):
        m = xb.size
        packed = ops.minmax_uint8_compress(ops.lowprec_decentralized_diff(xb, wb, lb, rb), 1)
        # Row i came from peers[i]; the last row is the right neighbour's (row 0 when n == 2).
        received = ring.send_recv_scheduled(packed, schedule, 0)
        from_left = ops.minmax_uint8_decompress(received[0], m, 1)
        from_right = ops.minmax_uint8_decompress(received[-1], m, 1) if n > 2 else from_left
        new_x.append(wb + ops.minmax_uint8_decompress(packed, m, 1))
        new_left.append(lb + from_left)
        new_right.append(rb + from_right)
    return tuple(new_x), (tuple(new_x), tuple(new_left), tuple(new_right))


def _hierarchical_exchange(
    x: Buckets, copies: Copies, intra: Communicator, inter: Communicator
) -> tuple[Buckets, Copies]:
    """Average inside the node, run the ring across nodes, reassemble inside the node.

    The node average is reduce-scattered: with ``k`` ranks per node, local rank ``j`` owns
    slice ``j`` of every bucket (zero-padded to a multiple of ``k``) and runs the ring on it
    with the ranks of local index ``j`` on the other nodes, one MinMaxUInt8 chunk per slice; an
    allgather reassembles the node's weights. Bagua reduces to a leader that exchanges the
    whole bucket and broadcasts; splitting it spreads the inter-node bytes over the node's
    ranks. Each rank's copies stay full-sized (so ``init`` needs no communicator) and only its
    own slice of them is read or written.
    """
    k, me = intra.size, intra.rank()
    slices = tuple(intra.reduce_scatter(_rows(b, k), "avg") for b in x)
    if inter.size == 1:  # one node: the node average is the result, the copies are never read
        new_copies = copies
    else:
        own = tuple(tuple(_rows(b, k)[me] for b in buckets) for buckets in copies)
        slices, new_own = _ring_exchange(slices, own, inter)
        new_copies = tuple(
            tuple(_rows(b, k).at[me].set(row).reshape(-1)[: b.size] for b, row in zip(buckets, rows))
            for buckets, rows in zip(copies, new_own)
        )
    return tuple(intra.allgather(row).reshape(-1)[: b.size] for row, b in zip(slices, x)), new_copies


def _rows(bucket: jax.Array, k: int) -> jax.Array:
    """``bucket`` zero-padded to a multiple of ``k`` elements, as ``k`` rows (one per local rank)."""
    return jnp.pad(bucket, (0, -bucket.size % k)).reshape(k, -1)


@implements(LowPrecisionDecentralizedConfig)
class LowPrecisionDecentralized(WithoutAveraging, ConfiguredAlgorithm):
    """Low-precision decentralized SGD (SPEC section 3): ``optax.chain(optimizer, transform)``.

    After each local optimizer step, every ``communication_interval`` steps, each rank sends
    8-bit min-max codes of a weight difference to its two ring neighbours (``B / 2`` bytes per
    ``B`` fp32 bytes of weights, about a quarter of a ring allreduce for many ranks) and mixes
    its weights with theirs. ``hierarchical`` averages inside each node at full precision first
    and runs the ring across nodes. All ranks must start from identical weights. Choose it on
    the slowest networks; see :func:`low_precision_decentralized`.
    """

    _transform = staticmethod(low_precision_decentralized)
    after_optimizer = fault_tolerant = True

    def transform(self, comms: Communicators) -> optax.GradientTransformationExtraArgs:
        """:func:`low_precision_decentralized` with this configuration (one that only counts the steps, its copies
        left as they are, without averaging)."""
        exchanging = low_precision_decentralized(comms, self.config, bucket_bytes=self.bucket_bytes)
        return exchanging if self.averages else counting_only(exchanging.init)

"""Decentralized SGD: average the weights with every rank or with one peer, then step locally.

Every ``communication_interval`` steps, before the optimizer's update is applied, each rank
replaces its weights by an average: over all ranks (``peer_selection_mode="all"``) or over a
pair of ranks (``"shift_one"``, a perfect matching that changes every communication round).
The optimizer's update, computed from this rank's own gradient at its pre-average weights, is
then applied to the average: ``x_{t+1} = avg(x_t) - lr * g(x_t)`` for SGD (SPEC section 3).

In optax terms the transform goes after the user's optimizer and needs ``params``: it turns
the optimizer's ``updates`` into ``(avg(params) - params) + updates``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from bagua_common.algorithms.compressed_allreduce import hierarchical as hierarchical_exchange
from bagua_common.algorithms.configs import DecentralizedConfig
from bagua_common.algorithms.option_checks import check_bucket_bytes
from bagua_common.algorithms.registry import as_config
from bagua_common.comm.topology import (
    Communicators,
    PeerSelectionMode,
    check_pairable,
    check_peer_selection_mode,
    shift_one_schedule,
)
from bagua_jax import ops
from bagua_jax.algorithms.base import (
    ConfiguredAlgorithm,
    check_communicators,
    check_weights_given,
    implements,
    step_counter_init,
)
from bagua_jax.bucketing import DEFAULT_BUCKET_BYTES, plan_buckets
from bagua_jax.communicator import Communicator


class DecentralizedState(NamedTuple):
    """State of :func:`decentralized`: ``step`` counts update calls (an int32 scalar)."""

    step: jax.Array


def shift_one_peer(rank: jax.Array, round_index: jax.Array, size: int) -> jax.Array:
    """The rank that ``rank`` averages with in communication round ``round_index`` (``shift_one``).

    A lookup in :func:`bagua_common.comm.topology.shift_one_schedule` (every rank paired with exactly
    one other, a new peer each round). ``rank`` and ``round_index`` may be traced int32 arrays,
    so one compiled step serves every round. Nothing is communicated; a ``size`` that is odd or
    below 2 raises.
    """
    schedule = jnp.asarray(shift_one_schedule(size))
    return schedule[jnp.asarray(round_index, jnp.int32) % schedule.shape[0], jnp.asarray(rank, jnp.int32)]


def decentralized_average(
    params: Any,
    comms: Communicators,
    round_index: jax.Array,
    *,
    peer_selection_mode: PeerSelectionMode = "all",
    hierarchical: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    average_all_when_odd: bool = False,
) -> Any:
    """This rank's averaged weights for communication round ``round_index`` (a pytree like ``params``).

    ``"all"`` allreduce-averages the weights (every rank gets the same bits); ``"shift_one"``
    exchanges them with :func:`shift_one_peer` through ``send_recv_scheduled`` and averages the pair in
    float32 (both ranks of a pair get the same bits). Hierarchical (``hierarchical=True`` and
    ``comms`` has ``intra`` and ``inter``): the weights are averaged inside the node first and
    only then exchanged across nodes; otherwise all ranks of ``comms.world`` take part. Per rank
    and bucket of ``B`` bytes this sends, in ``"all"``, an allreduce of ``B`` (the bytes of an
    fp32 gradient allreduce), in ``"shift_one"`` ``B`` to one peer (``n / (2(n-1))`` of a ring
    allreduce). Hierarchical: an intra-node allreduce of ``B``
    plus the same exchange across nodes of ``B / k`` per rank (``k`` ranks per node), i.e. one
    ``B`` per node in total. An odd number of ranks (or nodes) to pair raises, or with ``average_all_when_odd`` (a
    fault-tolerant job's, which a lost member may leave with an odd number) averages over all instead. Choose it to
    average models explicitly, e.g. at the end of
    decentralized training, or to build a custom schedule.
    """
    check_peer_selection_mode(peer_selection_mode, DecentralizedConfig.name)
    across_nodes = hierarchical and comms.hierarchical
    group: Communicator = comms.inter if across_nodes else comms.world
    n = group.size
    if peer_selection_mode == "shift_one" and n % 2 and average_all_when_odd:
        peer_selection_mode = "all"
    if peer_selection_mode == "shift_one" and n > 1:
        check_pairable(n, DecentralizedConfig.name, across_nodes)
        # Every pairing of the n/2 rounds a shift_one cycle has, as a static table, so that JAX's
        # collectives can send to the one peer instead of gathering from everyone.
        schedule = shift_one_schedule(n)[..., None]

    def exchange(bucket: jax.Array, comm: Communicator) -> jax.Array:
        if n == 1:  # one rank (or one node) in the group: nothing to exchange
            return bucket
        if peer_selection_mode == "all":
            return comm.allreduce(bucket, "avg")
        return ops.average2(bucket, comm.send_recv_scheduled(bucket, schedule, round_index)[0])

    if not across_nodes:
        plan = plan_buckets(params, bucket_bytes)
        return plan.unflatten([exchange(b, group) for b in plan.flatten(params)])
    # The node average is reduce-scattered, each local rank exchanges its 1/k slice with the
    # ranks of the same local index on other nodes, and an allgather reassembles the node's
    # result. Bagua reduces to a leader, which exchanges everything and broadcasts: the same
    # numbers, but here the inter-node traffic is split over the node's ranks.
    plan = plan_buckets(params, bucket_bytes, pad_to=comms.intra.size)
    return plan.unflatten([hierarchical_exchange(exchange, b, comms.intra, comms.inter) for b in plan.flatten(params)])


def decentralized(
    comms: Communicators,
    *config: Any,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    average_all_when_odd: bool = False,
    **options: Any,
) -> optax.GradientTransformationExtraArgs:
    """Decentralized SGD as an optax transform to chain *after* the optimizer, with ``params``.

    On steps ``t`` with ``t % communication_interval == 0`` it returns
    ``(avg(params) - params) + updates``, where ``avg`` is :func:`decentralized_average` for
    communication round ``t // communication_interval`` (so ``shift_one`` gets a new peer every
    round, whatever the interval); on other steps it returns ``updates`` unchanged. Weights are
    communicated, not gradients: per communication step, ``"all"`` sends as much as an fp32
    gradient allreduce, ``"shift_one"`` the weights once to one peer (about half of a ring
    allreduce for many ranks); averaged over steps, divide by the interval.
    Hierarchical communication falls back to ``comms.world`` when ``comms`` has no
    ``intra``/``inter``; ``average_all_when_odd`` as in :func:`decentralized_average`. Choose it when allreduce
    latency dominates (many ranks, slow network)
    and exact agreement of the replicas at every step is not required.
    """
    config = as_config(DecentralizedConfig, *config, **options)
    name, peer_selection_mode = config.name, config.peer_selection_mode
    communication_interval, hierarchical = config.communication_interval, config.hierarchical
    comms = check_communicators(comms, name)
    check_bucket_bytes(bucket_bytes, name)

    def update_fn(
        updates: Any, state: DecentralizedState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, DecentralizedState]:
        del extra_args
        check_weights_given(params, name)

        def averaging_delta(params: Any) -> Any:
            averaged = decentralized_average(
                params,
                comms,
                state.step // communication_interval,
                peer_selection_mode=peer_selection_mode,
                hierarchical=hierarchical,
                bucket_bytes=bucket_bytes,
                average_all_when_odd=average_all_when_odd,
            )
            return jax.tree.map(lambda a, p: a - p, averaged, params)

        def no_delta(params: Any) -> Any:
            return jax.tree.map(jnp.zeros_like, params)

        # Every rank holds the same step, so all take the same branch: on off steps the
        # collectives are skipped, not computed and discarded.
        delta = lax.cond(state.step % communication_interval == 0, averaging_delta, no_delta, params)
        # Why a difference and not the average itself: optax applies updates additively, so the
        # new weights are params + ((avg - params) + updates), rounded twice in float. They equal
        # avg + updates only up to a few ulps, and with "all" the replicas' weights may differ in
        # the last bits after the step even though the averages they were built from are
        # bit-identical across ranks.
        new_updates = jax.tree.map(lambda d, u: (d + u).astype(u.dtype), delta, updates)
        return new_updates, DecentralizedState(step=optax.safe_int32_increment(state.step))

    return optax.GradientTransformationExtraArgs(step_counter_init(DecentralizedState), update_fn)


def counting_only(init: Callable[[Any], Any]) -> optax.GradientTransformationExtraArgs:
    """A transform with ``init``'s state (a named tuple with a ``step``) that leaves the updates as they are and
    counts the step: a weight-exchanging algorithm's step without its exchange (:class:`WithoutAveraging`)."""

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
        del params, extra_args
        return updates, state._replace(step=optax.safe_int32_increment(state.step))

    return optax.GradientTransformationExtraArgs(init, update_fn)


class WithoutAveraging:
    """A variant of the algorithms that exchange weights (decentralized, low-precision decentralized) whose steps
    exchange nothing and count themselves, so that the exchanges' schedule goes on: the step a fault-tolerant job's
    members train while a joiner, with no weights to exchange yet, sits it out (:mod:`bagua_jax.unaveraged_step`)."""

    averages = True
    """Whether the steps exchange the weights at all (:meth:`without_averaging`)."""

    def without_averaging(self) -> Any:
        """A copy whose steps exchange nothing and count themselves."""
        return self.replace()._variant(averages=False)


@implements(DecentralizedConfig)
class Decentralized(WithoutAveraging, ConfiguredAlgorithm):
    """Decentralized SGD (SPEC section 3): ``optax.chain(optimizer, decentralized(...))``.

    Every ``communication_interval`` steps the weights are averaged with all ranks
    (``peer_selection_mode="all"``: the bytes of an fp32 allreduce, but of the weights) or with
    one peer that changes every round (``"shift_one"``: the weights sent once, about half of a
    ring allreduce for many ranks; even rank counts only), then the optimizer's step from this
    rank's own gradient is applied. ``hierarchical`` averages inside each node first and
    exchanges across nodes only. Choose it on high-latency networks, where not waiting for a
    global allreduce every step pays for slightly noisier replicas; see :func:`decentralized`.
    """

    after_optimizer = fault_tolerant = True
    average_all_when_odd = False
    """Whether ``shift_one`` averages over all ranks when their number is odd (:meth:`averaging_all_when_odd`)."""

    def transform(self, comms: Communicators) -> optax.GradientTransformationExtraArgs:
        """:func:`decentralized` with this configuration (a transform that only counts the steps, without
        averaging)."""
        if not self.averages:
            return counting_only(step_counter_init(DecentralizedState))
        return decentralized(
            comms, self.config, bucket_bytes=self.bucket_bytes, average_all_when_odd=self.average_all_when_odd
        )

    def averaging_all_when_odd(self) -> Decentralized:
        """A copy whose ``shift_one`` rounds average over all ranks while their number is odd, as the torch front
        end's do in a fault-tolerant job: one that a lost member leaves with an odd number goes on."""
        return self.replace()._variant(average_all_when_odd=True)

"""What a change of members does to each leaf of a fault-tolerant JAX job's state (``docs/guides/fault_tolerance.md``,
"Each algorithm's state").

Every leaf of a :class:`~bagua_jax.train_state.TrainState` has one role, from the algorithm's declared facts
(:class:`~bagua_common.algorithms.registry.AlgorithmConfig`: ``replicated``, ``world_sized_state``, read through the
rule of :mod:`bagua_common.job.reshard`, the same rule a checkpoint restored into another world size follows):

* :data:`REPLICATED`: identical on every member (parameters, optimizer state, QAdam's and 1-bit Adam's moments,
  PowerSGD's ``Q``, the step counters). The replica check hashes it, a change keeps it, a joiner receives it.
* :data:`RESET`: restarts at the value a fresh state for the new members has: the error-feedback residuals
  (ByteGrad, 1-bit Adam, PowerSGD), laid out per rank and meaningful only for the ranks they were made with.
* :data:`OWN`: this member's own, kept and never compared: a model state the trainer does not average.

:func:`refuse_unsurvivable` refuses the algorithms that do not declare ``fault_tolerant``.

Decentralized training's replicas drift at every step, so there the parameters and the optimizer's state are
:data:`OWN` (a joiner receives the first member's) and only the step counters :data:`REPLICATED`; low-precision
decentralized training's copies of its own and its ring neighbours' weights are :data:`RESET`, then
:func:`ring_copies_resumed` gives each member its new neighbours'.

DiLoCo's replicas drift inside a round, so there the parameters and the inner optimizer's state are :data:`OWN`; the
round start, the outer optimizer's state and the step counters are :data:`REPLICATED` (equal on every member at
every step: they change only at an exchange), and its residuals :data:`RESET`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bagua_common.algorithms.diloco import DiLoCoConfig
from bagua_common.comm.topology import ring_peers
from bagua_common.fault_tolerance import ReplicaDigest
from bagua_common.job.reshard import RESET as RESHARD_RESET
from bagua_common.job.reshard import config_rule
from bagua_jax.algorithms import REGISTRY
from bagua_jax.algorithms.diloco import DiLoCoState
from bagua_jax.algorithms.low_precision_decentralized import LowPrecisionDecentralizedState
from bagua_jax.checkpoint import leaf_rule
from bagua_jax.train_state import TrainState, rewrap_state, unwrap_state
from bagua_jax.trainer import DataParallel

__all__ = [
    "OWN",
    "DIGEST_PARTS",
    "PARTS",
    "REPLICATED",
    "RESET",
    "carried_algorithms",
    "carry_over",
    "refuse_unsurvivable",
    "replica_digest",
    "replicated_leaves",
    "ring_copies_resumed",
    "roles",
]

REPLICATED = "replicated"
"""The role of a leaf identical on every member: kept on a change, hashed, sent to a joiner."""
RESET = "reset"
"""The role of a leaf laid out per rank (error-feedback residuals): taken from a fresh state on a change."""
OWN = "own"
"""The role of a leaf that is the member's own (an unaveraged model state): kept, never compared."""

PARTS = {"params": "parameters", "opt_state": "optimizer", "step": "step", "model_state": "model state"}
"""The parts of the replica check, by :class:`~bagua_jax.train_state.TrainState` field."""
DIGEST_PARTS = (*PARTS.values(), "position")
"""The parts a member's :func:`replica_digest` hashes: the state's, then the data position."""


def carried_algorithms() -> list[str]:
    """The algorithms a fault-tolerant job trains on through a change of members, by name: those declaring
    ``fault_tolerant`` (their state is carried by the rules of this module, and tested), as the torch front end's
    :func:`bagua_torch.survivable.carried_algorithms`."""
    return [name for name in REGISTRY.names() if REGISTRY.by_name(name).fault_tolerant]


def refuse_unsurvivable(trainer: DataParallel) -> None:
    """Raise ValueError naming the fallback unless ``trainer``'s algorithm is one of :func:`carried_algorithms`, and
    for DiLoCo with an overlapped exchange of compressed pseudo-gradients (its step follows the world size, and a copy
    compiled ahead for another would make its exchange's communicator from a thread). Autotuning is refused too: a
    joiner would tune alone."""
    algorithm = trainer.algorithm
    config = algorithm.config
    if trainer._autotune != "off":
        raise ValueError(
            "FaultTolerantTrainer cannot autotune: a process that joins the job initializes alone, before it is "
            "admitted, and would choose its own bucket size. Tune in a run without fault tolerance, then pass the "
            "bucket size it chose (trainer.bucket_tuning.bucket_bytes) as DataParallel(..., bucket_bytes=...), with "
            "autotune='off' (BAGUA_AUTOTUNE=off)"
        )
    if isinstance(config, DiLoCoConfig) and config.fragment_sync_delay and config.outer_exchange != "fp32":
        raise ValueError(
            f"FaultTolerantTrainer cannot continue {config.name} with fragment_sync_delay="
            f"{config.fragment_sync_delay} and outer_exchange={config.outer_exchange!r} after a lost member: the "
            "overlapped exchange of compressed pseudo-gradients is laid out for the world size, and its step cannot "
            "be compiled ahead for another. Use outer_exchange='fp32' or fragment_sync_delay=0, or train it with the "
            "elastic restart instead (bagua-launch --nnodes MIN:MAX, restoring the last checkpoint into the new world "
            "size)"
        )
    if not getattr(algorithm, "fault_tolerant", False):
        raise ValueError(
            f"FaultTolerantTrainer cannot continue {type(algorithm).__name__} after a change of members yet (it can: "
            f"{', '.join(carried_algorithms())}). Train it with the elastic restart instead (bagua-launch --nnodes "
            "MIN:MAX, restoring the last checkpoint into the new world size)"
        )


def roles(trainer: DataParallel, state: TrainState) -> TrainState:
    """``state``'s structure with each leaf's role (:data:`REPLICATED`, :data:`RESET` or :data:`OWN`) in place of
    the leaf, for ``trainer``'s algorithm (one of :func:`carried_algorithms`)."""
    rule = config_rule(trainer.algorithm.config_class)
    shared_model_state = trainer._average_model_state

    def role(path: Any, leaf: Any) -> str:
        key = jax.tree_util.keystr(path)
        if leaf_rule(rule, key, np.asarray(leaf).dtype) == RESHARD_RESET:
            return RESET
        if key.startswith(".model_state") and not shared_model_state:
            return OWN
        return REPLICATED

    role_tree = jax.tree_util.tree_map_with_path(role, state)
    if isinstance(trainer.algorithm.config, DiLoCoConfig):
        return role_tree._replace(params=_all(OWN, state.params), opt_state=_diloco_roles(state.opt_state))
    if not getattr(trainer.algorithm, "replicas_identical", False):  # decentralized: every step drifts them
        own_but_reset = jax.tree.map(lambda kind: kind if kind == RESET else OWN, role_tree.opt_state)
        return role_tree._replace(params=_all(OWN, state.params), opt_state=own_but_reset)
    return role_tree


def _is_diloco(node: Any) -> bool:
    return isinstance(node, DiLoCoState)


def _is_ring_copies(node: Any) -> bool:
    return isinstance(node, LowPrecisionDecentralizedState)


def _all(kind: str, tree: Any) -> Any:
    return jax.tree.map(lambda _: kind, tree)


def _diloco_roles(opt_state: Any) -> Any:
    """The roles of DiLoCo's optimizer state: the inner optimizer's leaves are the member's own (they drift with its
    parameters); DiLoCo's round start, outer states and step are replicated, its residuals reset, and the
    pseudo-gradients awaiting an overlapped exchange (empty without one) and whether it trains the round its own."""

    def of(node: Any) -> Any:
        if not _is_diloco(node):
            return _all(OWN, node)
        return DiLoCoState(
            step=REPLICATED,
            round_start=_all(REPLICATED, node.round_start),
            outer_states=_all(REPLICATED, node.outer_states),
            pending=_all(OWN, node.pending),
            residuals=_all(RESET, node.residuals),
            trained=OWN,
        )

    return jax.tree.map(of, opt_state, is_leaf=_is_diloco)


def replica_digest(role_tree: TrainState, state: TrainState, position: Any) -> np.ndarray:
    """This member's digest of ``state``'s replicated leaves (on the host) and of the data ``position``, part by part
    (:data:`DIGEST_PARTS`), to compare across the members (:func:`~bagua_common.fault_tolerance.check_digests`)."""
    digest = ReplicaDigest(DIGEST_PARTS)
    for part, leaf in replicated_leaves(role_tree, state):
        digest.add(part, leaf)
    digest.add("position", np.asarray(position, np.int64))
    return digest.digest()


def replicated_leaves(role_tree: TrainState, state: TrainState) -> list[tuple[str, np.ndarray]]:
    """The replicated leaves of ``state`` on the host, in tree order, each with its part of the replica check
    (:data:`PARTS`)."""
    out = []
    for field in PARTS:  # TrainState's fields, in order
        leaves = jax.tree.leaves(getattr(state, field))
        kinds = jax.tree.leaves(getattr(role_tree, field))
        if len(leaves) != len(kinds):
            raise ValueError(f"fault tolerance: the state's {field} does not have the layout of its algorithm")
        out += [(PARTS[field], np.asarray(leaf)) for kind, leaf in zip(kinds, leaves) if kind == REPLICATED]
    return out


def carry_over(role_tree: TrainState, state: TrainState, fresh: TrainState) -> TrainState:
    """``state`` after a change of members: its :data:`RESET` leaves from ``fresh`` (a state made for the new
    members), the others kept. A kept leaf whose shape or dtype the new members change is an error."""

    def pick(kind: str, own: Any, new: Any) -> Any:
        if kind == RESET:
            return new
        if jnp.shape(own) != jnp.shape(new) or jnp.asarray(own).dtype != jnp.asarray(new).dtype:
            raise ValueError(
                f"fault tolerance: a {kind} state leaf of {jnp.asarray(own).dtype}{list(jnp.shape(own))} would have "
                f"to become {jnp.asarray(new).dtype}{list(jnp.shape(new))} with the new members"
            )
        return own

    return jax.tree.map(pick, role_tree, state, fresh)


def ring_copies_resumed(
    state: Any, exchange: Callable[[np.ndarray, list[int]], np.ndarray], rank: int, size: int
) -> Any:
    """``state`` (of member ``rank`` of ``size``, after :func:`carry_over`) with low-precision decentralized training's
    copies started again on the new ring, as the torch front end's ``resume``: ``w`` stays this member's weights (a
    fresh state's), ``L`` and ``R`` become its new neighbours' ``w``, sent in full precision by the neighbours alone
    (``exchange(w, peers)``: row j from ``peers[j]``, as :meth:`HostCommunicator.send_recv`, called once per bucket on
    every member), so that each copy is again the bits its neighbour holds (its own on a ring of one, never read). A
    state without such copies comes back as it is."""
    own = unwrap_state(state)

    def resumed(node: Any) -> Any:
        if not isinstance(node, LowPrecisionDecentralizedState):
            return node
        if size == 1:
            return node._replace(left=node.weights, right=node.weights)
        rows = [np.asarray(exchange(np.asarray(w), ring_peers(rank, size))) for w in node.weights]
        left, right = (tuple(jnp.asarray(r[end]) for r in rows) for end in (0, -1))  # the right's is row 0 of two
        return node._replace(left=left, right=right)

    opt_state = jax.tree.map(resumed, own.opt_state, is_leaf=_is_ring_copies)
    return rewrap_state(None if isinstance(state, TrainState) else state, own._replace(opt_state=opt_state))

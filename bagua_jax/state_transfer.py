"""A fault-tolerant JAX job's state, sent by the member that holds it to those that need it (joiners, or survivors
behind the others) over the job's own communicator, never through a file.

The transferred leaves (parameters, optimizer state with the algorithm's, step) travel as their bytes in one
broadcast of host buffers: nothing to compile, so it may run from a thread while the members train (DiLoCo's round
that a joiner sits out), and the joiner lays the bytes out as its own state's leaves. While the members take steps
that use the job's communicator (a joiner weighed out of its first step), it travels over a communicator of the
holder and the joiners alone (:func:`transfer_in_group`); the algorithm's replicated state, which it needs to take
part at once, goes first through the job's store (:func:`algorithm_state_bytes`).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from bagua_common.fault_tolerance import Epoch
from bagua_common.fault_tolerance.background import in_background, wait_unless
from bagua_common.job.signature import check_same_job
from bagua_jax.host_communicator import HostCommunicator
from bagua_jax.native_communicator import NativeCommunicator
from bagua_jax.state_rules import REPLICATED
from bagua_jax.train_state import TrainState, unwrap_state

__all__ = [
    "algorithm_state_bytes",
    "broadcast_state",
    "in_background",
    "state_from_bytes",
    "transfer_group",
    "transfer_in_group",
    "transferred_leaves",
    "with_algorithm_state",
]


def transferred_leaves(state: Any) -> tuple[list[np.ndarray], Any]:
    """The leaves a joiner receives (parameters, optimizer state, step) on the host, and their tree."""
    own = unwrap_state(state)
    leaves, tree = jax.tree.flatten((own.params, own.opt_state, own.step))
    return [np.asarray(leaf) for leaf in leaves], tree


def _concatenated(leaves: list[np.ndarray]) -> np.ndarray:
    """The bytes of ``leaves`` (host arrays), one after another."""
    return np.concatenate([np.asarray(leaf).reshape(-1).view(np.uint8) for leaf in leaves] or [np.zeros(0, np.uint8)])


def _laid_out(raw: np.ndarray, leaves: list[np.ndarray]) -> list[jax.Array]:
    """:func:`_concatenated`'s bytes ``raw`` as arrays on the device, each laid out as its leaf of ``leaves``."""
    values, offset = [], 0
    for leaf in leaves:
        values.append(jax.device_put(raw[offset : offset + leaf.nbytes].view(leaf.dtype).reshape(leaf.shape)))
        offset += leaf.nbytes
    if offset != raw.size:
        raise ValueError(f"fault tolerance: {raw.size} bytes of state received, {offset} laid out here")
    return values


def broadcast_state(host: HostCommunicator, state: Any, root: int) -> np.ndarray:
    """Rank ``root``'s transferred leaves of ``state``, their bytes concatenated: one broadcast of host buffers
    (nothing to compile, and callable from a thread while the members train)."""
    return np.asarray(host.broadcast(_concatenated(transferred_leaves(state)[0]), root))


def state_from_bytes(received: np.ndarray, state: Any) -> TrainState:
    """The :class:`TrainState` whose transferred leaves are ``received`` (:func:`broadcast_state`), laid out as
    ``state``'s, with ``state``'s own model state."""
    leaves, tree = transferred_leaves(state)
    return TrainState(*jax.tree.unflatten(tree, _laid_out(received, leaves)), unwrap_state(state).model_state)


def transfer_group(communicator: NativeCommunicator, epoch: Epoch) -> NativeCommunicator | None:
    """The communicator of ``epoch``'s state holder (:attr:`Epoch.state_holder`, its rank 0) and joiners, split
    from ``communicator`` (the job's) by every member at the same point, the training thread waiting for it
    (MembershipChanged if the epoch closes first); None on the other members. Split while every member is there: a
    communicator accepted on a thread instead (``MPI_Comm_accept``) holds MPICH's lock, and with it the holder's
    collectives on the job's communicator, until its peer connects."""
    holder = epoch.rank == epoch.state_holder
    takes_part = holder or epoch.is_joiner()
    key = 0 if holder else epoch.rank + 1
    splitting = in_background(lambda: communicator.split(0 if takes_part else 1, key, "state"), "bagua-ft-split")
    why = f"epoch {epoch.number} closed while the state's communicator was being split (a member died)"
    group = wait_unless(splitting, epoch.closed, why)  # MPI_Comm_split never returns once a member died
    if takes_part:
        return group
    group.close()
    return None


def transfer_in_group(group: NativeCommunicator, epoch: Epoch, state: Any, signature: np.ndarray) -> np.ndarray:
    """The holder (``group``'s rank 0, :func:`transfer_group`) sends ``state``'s transferred leaves to the joiners
    (its other ranks), having checked with them that they train the same job (``signature``); every rank of
    ``group`` calls it (from a thread: the members may meanwhile train on the job's communicator), and the joiners
    get the bytes (:func:`state_from_bytes`). The group's collectives fail at once when the epoch closes; the group
    is closed on return."""
    group.revoke_when(epoch.closed, f"the job's membership changed (epoch {epoch.number} closed)")
    try:
        host = HostCommunicator(group)
        check_same_job(signature, lambda x: np.asarray(host.allgather(x)))
        return broadcast_state(host, state, 0)
    finally:
        group.close()


def _algorithm_leaves(role_tree: TrainState, state: Any) -> tuple[list[Any], list[bool], Any]:
    """The leaves of the algorithm's own state in ``state`` (the optimizer chain's first), whether each is replicated
    (by ``role_tree``, :func:`bagua_jax.state_rules.roles`), and their tree."""
    kinds = jax.tree.leaves(role_tree.opt_state[0])
    leaves, tree = jax.tree.flatten(unwrap_state(state).opt_state[0])
    if len(kinds) != len(leaves):
        raise ValueError("fault tolerance: the algorithm's state does not have the layout of its roles")
    return leaves, [kind == REPLICATED for kind in kinds], tree


def algorithm_state_bytes(role_tree: TrainState, state: Any) -> bytes:
    """The replicated leaves (by ``role_tree``, :func:`bagua_jax.state_rules.roles`) of the algorithm's own state in
    ``state`` (the optimizer chain's first: PowerSGD's step count and ``Q``), their bytes concatenated: what a joiner
    weighed out of its first step needs before the rest of the state arrives."""
    leaves, replicated, _ = _algorithm_leaves(role_tree, state)
    return _concatenated([np.asarray(leaf) for leaf, kept in zip(leaves, replicated) if kept]).tobytes()


def with_algorithm_state(raw: bytes, role_tree: TrainState, state: Any) -> TrainState:
    """``state`` whose algorithm's replicated leaves are ``raw`` (:func:`algorithm_state_bytes`), laid out as its own;
    the rest kept."""
    own = unwrap_state(state)
    leaves, replicated, tree = _algorithm_leaves(role_tree, own)
    shared = [np.asarray(leaf) for leaf, kept in zip(leaves, replicated) if kept]
    received = iter(_laid_out(np.frombuffer(raw, np.uint8), shared))
    values = [next(received) if kept else leaf for leaf, kept in zip(leaves, replicated)]
    return own._replace(opt_state=(jax.tree.unflatten(tree, values), *own.opt_state[1:]))

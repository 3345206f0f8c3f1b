"""A fault-tolerant JAX job's state, sent by the member that holds it to those that need it (joiners, or survivors
behind the others) over the job's own communicator, never through a file.

The transferred leaves (parameters, optimizer state with the algorithm's, step) travel as their bytes in one
broadcast of host buffers: nothing to compile, so it may run from a thread while the members train (DiLoCo's round
that a joiner sits out), and the joiner lays the bytes out as its own state's leaves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import jax
import numpy as np

from bagua_jax.host_communicator import HostCommunicator
from bagua_jax.train_state import TrainState, unwrap_state

__all__ = ["broadcast_state", "in_background", "state_from_bytes", "transferred_leaves"]


def transferred_leaves(state: Any) -> tuple[list[np.ndarray], Any]:
    """The leaves a joiner receives (parameters, optimizer state, step) on the host, and their tree."""
    own = unwrap_state(state)
    leaves, tree = jax.tree.flatten((own.params, own.opt_state, own.step))
    return [np.asarray(leaf) for leaf in leaves], tree


def broadcast_state(host: HostCommunicator, state: Any, root: int) -> np.ndarray:
    """Rank ``root``'s transferred leaves of ``state``, their bytes concatenated: one broadcast of host buffers
    (nothing to compile, and callable from a thread while the members train)."""
    leaves, _ = transferred_leaves(state)
    flat = np.concatenate([leaf.reshape(-1).view(np.uint8) for leaf in leaves])
    return np.asarray(host.broadcast(flat, root))


def state_from_bytes(received: np.ndarray, state: Any) -> TrainState:
    """The :class:`TrainState` whose transferred leaves are ``received`` (:func:`broadcast_state`), laid out as
    ``state``'s, with ``state``'s own model state."""
    leaves, tree = transferred_leaves(state)
    values, offset = [], 0
    for leaf in leaves:
        values.append(jax.device_put(received[offset : offset + leaf.nbytes].view(leaf.dtype).reshape(leaf.shape)))
        offset += leaf.nbytes
    return TrainState(*jax.tree.unflatten(tree, values), unwrap_state(state).model_state)


def in_background(work: Callable[[], Any], name: str) -> Future:
    """``work()`` on a daemon thread (one stuck in a collective never holds up the process's exit)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits for the result
            future.set_exception(error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future

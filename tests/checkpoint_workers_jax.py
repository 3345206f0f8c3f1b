"""Rank bodies for test_checkpoint_jax.py's native-mode test: one process per rank over the native MPI engine."""

from __future__ import annotations

import jax
import numpy as np
import optax
from test_checkpoint_jax import LR, batch, initial_params, loss_fn

from bagua_jax import DataParallel, NativeCommunicator
from bagua_jax.algorithms import Decentralized
from bagua_jax.checkpoint import restore, save


def train_save_restore(root: str, seed: int) -> dict:
    """Decentralized training (the ranks' parameters drift apart), a checkpoint, then a restore into a new trainer."""
    comm = NativeCommunicator.mpi_world(timeout=60)
    rank = int(comm.rank())
    rng = np.random.default_rng([seed, rank])
    dp = DataParallel(loss_fn, optax.adam(LR), Decentralized(hierarchical=False), communicator=comm)
    state = dp.init(initial_params(np.random.default_rng(seed)))
    for _ in range(3):
        state, _ = dp.step(state, batch(rng))
    save(root, state, dp)
    restored = restore(
        root,
        DataParallel(loss_fn, optax.adam(LR), Decentralized(hierarchical=False), communicator=comm),
        initial_params(rng),
    )
    return {"saved": _host(state), "restored": _host(restored)}


def _host(tree) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(tree)]

"""Data parallelism inside the user's own train step: an optax optimizer and a batch slice per process.

For scripts that own their train step (flax's linen and NNX examples, ``nnx.Optimizer``), where
:class:`~bagua_jax.DataParallel` would mean rewriting the step: one process per device (launched
with ``bagua-launch --mpi`` or ``mpiexec``), the optimizer wrapped by
:func:`data_parallel_optimizer` and each global batch cut to this process's part with
:func:`rank_slice`. Every process runs the unchanged step on its part; the algorithm communicates
inside ``optimizer.update`` over :class:`~bagua_jax.NativeCommunicator`'s world.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
import optax

from bagua_jax.algorithms import make_algorithm
from bagua_jax.algorithms.base import Algorithm
from bagua_jax.native_communicator import NativeCommunicator


@functools.cache
def world() -> NativeCommunicator:
    """This job's world communicator (:meth:`NativeCommunicator.world`), made once per process."""
    return NativeCommunicator.world()


def data_parallel_optimizer(
    optimizer: optax.GradientTransformation | None,
    algorithm: Algorithm | str = "gradient_allreduce",
    communicator: NativeCommunicator | None = None,
) -> optax.GradientTransformationExtraArgs:
    """``optimizer`` made data-parallel with ``algorithm`` (an algorithm or a registry name) over ``communicator``.

    The result is an optax transformation for this process's rank: local gradients in, updates out,
    communicating inside ``update`` (so ``update`` needs ``params``, as ``nnx.Optimizer`` and flax's
    ``TrainState.apply_gradients`` give it). ``communicator`` defaults to :func:`world`. The algorithms
    that are optimizers themselves (QAdam, OneBitAdam) take ``optimizer=None`` and an algorithm object
    built with their learning rate (and a ``warmup_steps`` shorter than the run).
    """
    if isinstance(algorithm, str):
        algorithm = make_algorithm(algorithm)
    return algorithm.transformation(optimizer, communicator if communicator is not None else world())


def rank_slice(batch: Any, communicator: NativeCommunicator | None = None) -> Any:
    """This rank's part of a global ``batch`` (every leaf's leading axis cut into equal, contiguous parts).

    Every process passes the same global batch; a leading axis that does not split evenly across
    the ranks raises a ValueError rather than leaving a rank with a different batch size.
    """
    communicator = communicator if communicator is not None else world()
    rank, size = int(communicator.rank()), communicator.size

    def part(leaf: Any) -> Any:
        rows = np.shape(leaf)[0]
        if rows % size:
            raise ValueError(f"rank_slice: a batch of {rows} does not split evenly across {size} ranks")
        share = rows // size
        return leaf[rank * share : (rank + 1) * share]

    return jax.tree.map(part, batch)

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
import logging
from typing import Any

import jax
import numpy as np
import optax

from bagua_common.algorithms.registry import algorithm_facts
from bagua_jax.algorithms import make_algorithm
from bagua_jax.algorithms.base import Algorithm
from bagua_jax.native_communicator import NativeCommunicator

_log = logging.getLogger(__name__)


@functools.cache
def world() -> NativeCommunicator:
    """This job's world communicator (:meth:`NativeCommunicator.world`), made once per process."""
    return NativeCommunicator.world()


def data_parallel_optimizer(
    optimizer: optax.GradientTransformation | None,
    algorithm: Algorithm | str = "gradient_allreduce",
    communicator: NativeCommunicator | None = None,
    *,
    learning_rate: float | None = None,
    **options: Any,
) -> optax.GradientTransformationExtraArgs:
    """``optimizer`` made data-parallel with ``algorithm`` (an algorithm or a registry name) over ``communicator``.

    The result is an optax transformation for this process's rank: local gradients in, updates out,
    communicating inside ``update`` (so ``update`` needs ``params``, as ``nnx.Optimizer`` and flax's
    ``TrainState.apply_gradients`` give it). ``communicator`` defaults to :func:`world`. A name takes the
    algorithm's ``options`` as keywords (:func:`~bagua_jax.algorithms.make_algorithm`). The algorithms that are
    optimizers themselves (QAdam, OneBitAdam) replace ``optimizer``: by name they take ``learning_rate`` (ignored
    by the others, so a script passes its configuration's rate whatever the name), and a line is logged
    saying that ``optimizer`` is replaced when one was given.
    """
    algorithm = make_algorithm(algorithm, learning_rate, **options)
    communicator = communicator if communicator is not None else world()
    name = getattr(algorithm, "name", "")
    if optimizer is not None and algorithm_facts(name).is_optimizer:
        _log.warning(
            "bagua_jax: %s is an optimizer itself (Adam with averaged momentum, learning rate %s): it replaces the "
            "optimizer given to data_parallel_optimizer",
            name,
            algorithm.learning_rate,
        )
        optimizer = None
    return algorithm.transformation(optimizer, communicator)


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

"""Data parallelism for flax NNX: an ``nnx.Optimizer`` that trains data-parallel, and per-rank dropout keys.

:class:`DataParallelOptimizer` is an ``nnx.Optimizer`` whose transformation is the algorithm's
(:func:`~bagua_jax.data_parallel_optimizer`) and whose ``update(model, grads)`` also averages the
model's ``nnx.BatchStat`` variables (BatchNorm's running statistics) over the ranks, so a script
that owns its train step (flax's NNX example) swaps its optimizer and keeps the step.
:func:`rank_rngs` gives each rank its own ``nnx.Rngs``. :class:`~bagua_jax.DataParallel` trains
an NNX module with both (:func:`nnx_rank_step`). Native mode: one process per device, launched
with ``bagua-launch --mpi`` or ``mpiexec``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from bagua_jax.algorithms.base import Algorithm
from bagua_jax.communicator import Communicator
from bagua_jax.native_data_parallel import data_parallel_optimizer, world
from bagua_jax.step_means import StepMeans


class DataParallelOptimizer(nnx.Optimizer):
    """``nnx.Optimizer(model, tx, wrt=wrt)`` made data-parallel with ``algorithm`` (an algorithm or a registry name).

    ``update(model, grads)`` applies the algorithm's update (which communicates the gradients or
    weights) as ``nnx.Optimizer`` does and averages ``model``'s ``nnx.BatchStat`` variables over the
    ranks, in the same message as the gradients where the algorithm can. ``communicator`` defaults
    to :func:`bagua_jax.native_data_parallel.world`.
    A name takes the algorithm's ``options`` as keywords; QAdam and OneBitAdam replace ``tx`` and take
    ``learning_rate`` (see :func:`~bagua_jax.data_parallel_optimizer`).
    """

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation | None,
        algorithm: Algorithm | str = "gradient_allreduce",
        *,
        communicator: Communicator | None = None,
        wrt: Any = nnx.Param,
        learning_rate: float | None = None,
        **options: Any,
    ):
        communicator = communicator if communicator is not None else world()
        transformation = data_parallel_optimizer(tx, algorithm, communicator, learning_rate=learning_rate, **options)
        super().__init__(model, transformation, wrt=wrt)
        self.communicator = communicator

    def update(self, model: nnx.Module, grads: Any, /, **kwargs) -> optax.Updates:
        """Update ``model`` with ``grads`` (this rank's) and average its BatchNorm statistics over the ranks."""
        return self.update_averaging(model, grads, None, **kwargs)[0]

    def update_averaging(self, model: nnx.Module, grads: Any, values: Any, /, **kwargs) -> tuple[optax.Updates, Any]:
        """:meth:`update`, also averaging the floating leaves of ``values`` (a loss, metrics) over the ranks; returns
        the updates and the averaged ``values``.

        The statistics and ``values`` go in one message, carried with the gradients where the algorithm can
        (:class:`~bagua_jax.step_means.StepMeans`).
        """
        step_means = StepMeans((nnx.state(model, nnx.BatchStat), values))
        updates = super().update(model, grads, step_means=step_means, **kwargs)
        statistics, values = step_means.result(self.communicator)
        nnx.update(model, statistics)
        return updates, values


def rank_rngs(rngs: nnx.Rngs | jax.Array, communicator: Communicator | None = None) -> nnx.Rngs:
    """This rank's own ``nnx.Rngs``: one key drawn from each stream of ``rngs`` (or ``rngs`` itself, a key), folded
    with the rank of ``communicator`` (default :func:`bagua_jax.native_data_parallel.world`).

    Every rank passes the same ``rngs``, e.g. ``rank_rngs(nnx.Rngs(0))``; the ranks then draw
    different dropout masks. Drawing advances ``rngs``' streams, so a later call gives new keys.
    """
    rank = (communicator if communicator is not None else world()).rank()
    if isinstance(rngs, nnx.Rngs):
        return nnx.Rngs(**{name: jax.random.fold_in(stream(), rank) for name, stream in rngs.items()})
    return nnx.Rngs(jax.random.fold_in(rngs, rank))


def nnx_rank_step(loss_fn: Callable, has_aux: bool, communicator: Communicator, average_loss: bool) -> Callable:
    """One rank's jitted ``step(model, optimizer, batch, rngs)``, updating both in place; returns the ranks' mean
    loss (and aux, with ``has_aux``), or with ``average_loss=False`` this rank's own.

    ``loss_fn(model, batch, rngs)`` gets :func:`rank_rngs` of ``rngs`` (``loss_fn(model, batch)``
    when ``rngs`` is None); ``optimizer`` is a :class:`DataParallelOptimizer`.
    """

    @nnx.jit
    def step(model: nnx.Module, optimizer: DataParallelOptimizer, batch: Any, rngs: Any):
        extra = () if rngs is None else (rank_rngs(rngs, communicator),)
        value, grads = nnx.value_and_grad(loss_fn, has_aux=has_aux)(model, batch, *extra)
        if not average_loss:
            optimizer.update(model, grads)
            return value
        return optimizer.update_averaging(model, grads, value)[1]

    return step

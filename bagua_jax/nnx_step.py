"""One rank's step of :class:`~bagua_jax.DataParallel` on a flax NNX model and its ``nnx.Optimizer``, in place.

``DataParallel.init(model)`` returns a :class:`~bagua_jax.train_state.NnxTrainState`, the user's
module and an ``nnx.Optimizer`` (:func:`nnx_optimizer`) whose transformation is the algorithm's.
:func:`nnx_rank_step` is one rank's step on them: the user's ``loss_fn(model, batch[, rngs])``
differentiated by ``nnx.value_and_grad``, the model's ``nnx.BatchStat`` variables (BatchNorm's
running statistics) averaged over the ranks, dropout keys of the rank's own, and the
optimizer's update, all inside one ``nnx.jit``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx


def rank_rngs(rngs: nnx.Rngs | jax.Array, rank: jax.Array) -> nnx.Rngs:
    """A rank's own ``nnx.Rngs``: one key drawn from each stream of ``rngs`` (or ``rngs`` itself, a key), folded with ``rank``.

    Every rank passes the same ``rngs``; drawing advances its streams as a single-process step
    would, so the next step's keys differ, and folding in the rank gives each rank its own masks.
    """
    if isinstance(rngs, nnx.Rngs):
        return nnx.Rngs(**{name: jax.random.fold_in(stream(), rank) for name, stream in rngs.items()})
    return nnx.Rngs(jax.random.fold_in(rngs, rank))


def nnx_rank_step(loss_fn: Callable, has_aux: bool, average: Callable[[Any], Any], rank: Callable[[], jax.Array]):
    """One rank's jitted step ``step(model, optimizer, batch, rngs)``: returns the ranks' mean loss (and aux, with ``has_aux``).

    ``average`` is the mean of a tree's floating leaves over the ranks; ``rank()`` this rank's index.
    """

    @nnx.jit
    def step(model: nnx.Module, optimizer: nnx.Optimizer, batch: Any, rngs: Any):
        extra = () if rngs is None else (rank_rngs(rngs, rank()),)
        value, grads = nnx.value_and_grad(loss_fn, has_aux=has_aux)(model, batch, *extra)
        nnx.update(model, average(nnx.state(model, nnx.BatchStat)))
        optimizer.update(model, grads)
        return average(value)

    return step


def nnx_optimizer(model: nnx.Module, tx: optax.GradientTransformation) -> nnx.Optimizer:
    """An ``nnx.Optimizer`` over ``model``'s ``nnx.Param`` variables (what ``nnx.value_and_grad`` differentiates)."""
    return nnx.Optimizer(model, tx, wrt=nnx.Param)

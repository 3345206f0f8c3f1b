"""A joiner's first step under gradient allreduce, taken weighed out while its state still travels.

The members train the step on their samples, as if the joiner were not there; the joiner sends zeros in the
step's one message (the gradient buckets with the loss and aux riding in them), and every rank's engine divides
the average by the members that trained (:meth:`~bagua_jax.NativeCommunicator.set_mpi_average_divisor`). The
joiner keeps the averaged gradients (:meth:`WeighedOutStep.average`) and, once the state arrived, applies them with
the optimizer (:meth:`WeighedOutStep.apply`): it then holds what its peers hold after the step. Both functions are
compiled before the joiner asks to be admitted, as its step is. The same holds for a member that had not applied
the last step and is given the state.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import optax

from bagua_common.fault_tolerance import Epoch
from bagua_jax.state_transfer import state_from_bytes, wait_in_epoch
from bagua_jax.step_means import StepMeans
from bagua_jax.train_state import TrainState, rewrap_state, unwrap_state
from bagua_jax.trainer import DataParallel

__all__ = ["WeighedOutStep", "weighs_out"]


def weighs_out(trainer: DataParallel) -> bool:
    """Whether a joiner of ``trainer``'s job can take its first step weighed out: flat gradient allreduce averaging
    in full precision over the native MPI engine (its average takes a divisor at run time)."""
    config = trainer.algorithm.config
    communicator = trainer.communicator
    return (
        config.name == "gradient_allreduce"
        and config.average
        and not config.hierarchical
        and communicator is not None
        and communicator.kind == "mpi"
    )


class WeighedOutStep:
    """The two halves of ``trainer``'s step for a rank weighed out of it: the average of the members' gradients
    (this rank sending zeros) and the optimizer's update of the state it receives meanwhile."""

    def __init__(self, trainer: DataParallel):
        if not weighs_out(trainer):
            raise ValueError("WeighedOutStep: only flat gradient allreduce averaging over the MPI engine weighs out")
        self._trainer = trainer
        self._transform = trainer.algorithm.transform(trainer._comms)
        self._average = jax.jit(self._averaged)
        self._apply = jax.jit(self._applied)

    def _averaged(self, params: Any, batch: Any) -> tuple[Any, Any]:
        """The members' averaged gradients and mean loss (and aux): this rank's message is zeros of the members'
        layout (the loss's shapes traced, never computed)."""
        trainer = self._trainer
        value = jax.eval_shape(trainer._loss_fn, params, batch)
        loss, aux = jax.tree.map(
            lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), value if trainer._has_aux else (value, None)
        )
        zeros = jax.tree.map(jnp.zeros_like, params)
        step_means = StepMeans((None, (loss, aux)))
        averaged, _ = self._transform.update(zeros, optax.EmptyState(), params, step_means=step_means)
        _, (loss, aux) = step_means.result(trainer._world)
        return averaged, ((loss, aux) if trainer._has_aux else loss)

    def _applied(self, state: TrainState, averaged: Any) -> TrainState:
        """``state`` after the optimizer applied ``averaged``, as the members' step applies it (the chain's first
        state is gradient allreduce's, which holds nothing)."""
        reduce_state, inner = state.opt_state
        updates, inner = self._trainer._optimizer.update(averaged, inner, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params, (reduce_state, inner), state.step + 1, state.model_state)

    def compile(self, state: TrainState, batch: Any) -> None:
        """Compile both halves for ``state``'s and ``batch``'s shapes without running them."""
        averaged = jax.eval_shape(self._averaged, state.params, batch)[0]
        self._average.lower(state.params, batch).compile()
        self._apply.lower(state, averaged).compile()

    def average(self, state: TrainState, batch: Any) -> tuple[Any, Any]:
        """Take part in the step weighed out: the members' averaged gradients, and the step's result (their mean
        loss, with aux) as :meth:`DataParallel.step` returns it. ``state`` lends its parameters' shapes only."""
        return self._average(state.params, batch)

    def apply(self, state: TrainState, averaged: Any) -> TrainState:
        """``state`` (the one received) after the step whose averaged gradients :meth:`average` returned."""
        return self._apply(state, averaged)

    def take(self, state: Any, batch: Any, incoming: Future, epoch: Epoch) -> tuple[Any, Any]:
        """The step weighed out: the members' averaged gradients, then, once the state's bytes arrived from
        ``incoming`` (:func:`~bagua_jax.state_transfer.transfer_over_pair`; MembershipChanged if ``epoch`` closes
        first), the step applied to that state laid out as ``state``; returns the new state and the step's result."""
        averaged, result = self.average(unwrap_state(state), batch)
        received = state_from_bytes(wait_in_epoch(incoming, epoch), state)
        return rewrap_state(None if isinstance(state, TrainState) else state, self.apply(received, averaged)), result

"""A fault-tolerant job's step under gradient allreduce, in two halves, so that a joiner can be weighed out of one.

A joiner takes its first step while its state still travels: the members train the step on their samples, the
joiner sends zeros in the step's one message (the gradient buckets with the loss and aux riding in them), and every
rank's engine divides the average by the members that trained
(:meth:`~bagua_jax.NativeCommunicator.set_mpi_average_divisor`). The joiner keeps the averaged gradients and,
once the state arrived, applies them with the optimizer.

Every rank runs that step as the same two compiled functions (:meth:`WeighedOutStep.step`): the gradients and their
average, then the optimizer's update. Only so does the joiner's update match its peers' bit for bit: the same update
compiled into one step with the backward pass is fused differently (AdamW's parameters then differ in their last
bits, which the replica check reports). The other steps stay the trainer's one compiled step; the members compile
the halves from a thread after their first step (:meth:`WeighedOutStep.compile_in_background`), the joiner before it
asks to be admitted.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import optax

from bagua_common.fault_tolerance import Epoch
from bagua_common.fault_tolerance.background import in_background, wait_unless
from bagua_jax.signature import check_batches_differ
from bagua_jax.state_transfer import state_from_bytes
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
    """``trainer``'s step (a state without a model state, no key) as its two halves: the average of the ranks'
    gradients, to which a rank weighed out of the step contributes zeros, and the optimizer's update."""

    def __init__(self, trainer: DataParallel):
        if not weighs_out(trainer):
            raise ValueError("WeighedOutStep: only flat gradient allreduce averaging over the MPI engine weighs out")
        self._trainer = trainer
        self._transform = trainer.algorithm.transform(trainer._comms)
        self._average = jax.jit(self._averaged, static_argnames="contributes")
        self._apply = jax.jit(self._applied)
        self._compiled: Future | None = None

    def _averaged(self, params: Any, batch: Any, contributes: bool) -> tuple[Any, Any]:
        """The ranks' averaged gradients and mean loss (and aux); a rank that does not contribute sends zeros of the
        same layout (the loss's shapes traced, never computed)."""
        trainer = self._trainer
        if contributes:
            value, grads = jax.value_and_grad(trainer._loss_fn, has_aux=trainer._has_aux)(params, batch)
        else:
            value = jax.tree.map(
                lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), jax.eval_shape(trainer._loss_fn, params, batch)
            )
            grads = jax.tree.map(jnp.zeros_like, params)
        loss, aux = value if trainer._has_aux else (value, None)
        step_means = StepMeans((None, (loss, aux)))  # the members' step carries them in its buckets the same way
        averaged, _ = self._transform.update(grads, optax.EmptyState(), params, step_means=step_means)
        _, (loss, aux) = step_means.result(trainer._world)
        return averaged, ((loss, aux) if trainer._has_aux else loss)

    def _applied(self, state: TrainState, averaged: Any) -> TrainState:
        """``state`` after the optimizer applied ``averaged`` (the chain's first state is gradient allreduce's, which
        holds nothing)."""
        reduce_state, inner = state.opt_state
        updates, inner = self._trainer._optimizer.update(averaged, inner, state.params)
        return TrainState(optax.apply_updates(state.params, updates), (reduce_state, inner), state.step + 1, None)

    def compile_in_background(self, state: Any, batch: Any) -> None:
        """Compile both halves (the average as a contributing rank and as one weighed out) for ``state``'s (what
        :meth:`DataParallel.step` takes) and ``batch``'s shapes on a thread, without running them; once (later calls
        do nothing). :meth:`step` waits for it."""
        if self._compiled is None:
            self._compiled = in_background(lambda: self._compile(unwrap_state(state), batch), "bagua-ft-compile")

    def compile(self, state: Any, batch: Any) -> None:
        """:meth:`compile_in_background`, waited for: a joiner compiles before it asks to be admitted."""
        self.compile_in_background(state, batch)
        self._compiled.result()

    def _compile(self, state: TrainState, batch: Any) -> None:
        averaged = jax.eval_shape(functools.partial(self._averaged, contributes=True), state.params, batch)[0]
        for contributes in (False, True):
            self._average.lower(state.params, batch, contributes=contributes).compile()
        self._apply.lower(state, averaged).compile()

    def step(
        self, state: Any, batch: Any, incoming: Future | None = None, epoch: Epoch | None = None
    ) -> tuple[Any, Any]:
        """One step, as :meth:`DataParallel.step` returns it (the new state, the ranks' mean loss). With
        ``incoming`` (the state's bytes on their way to a rank weighed out of the step, from
        :func:`~bagua_jax.state_transfer.transfer_over_pair`), the rank sends zeros, then applies the averaged
        gradients to the state received, laid out as ``state`` (MembershipChanged if ``epoch`` closes first)."""
        trainer = self._trainer
        if self._compiled is not None:
            self._compiled.result()
        if not trainer._batches_checked:
            check_batches_differ(batch, trainer.communicator)
            trainer._batches_checked = True
        own = unwrap_state(state)
        averaged, result = self._average(own.params, batch, contributes=incoming is None)
        if incoming is not None:
            own = state_from_bytes(wait_unless(incoming, epoch.closed, f"epoch {epoch.number} closed first"), state)
        return rewrap_state(None if isinstance(state, TrainState) else state, self._apply(own, averaged)), result

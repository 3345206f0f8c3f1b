"""A fault-tolerant job's step under gradient allreduce or PowerSGD, in two halves, so that a joiner can be weighed out
of one.

A joiner takes its first step while its state still travels: the members train the step on their samples, the
joiner sends zeros in the step's messages (gradient allreduce's buckets with the loss and aux riding in them;
PowerSGD's factors, linear in the gradients), and every rank's engine divides each average by the members that trained
(:meth:`~bagua_jax.NativeCommunicator.set_average_divisor`): the step's average is the members' alone. The joiner
needs only the algorithm's replicated state to take part (PowerSGD's step count, which decides whether the step is
compressed, and ``Q``: a few kB the state's holder sends first). It keeps the averaged gradients and the algorithm's new
state, and once the rest of the state arrived it applies them with the optimizer; its per-rank leaves (PowerSGD's
error-feedback residuals) stay as they were: it trained nothing whose error it would carry.

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
from bagua_common.fault_tolerance.background import COMPILING_AHEAD, in_background, wait_unless
from bagua_jax import state_rules
from bagua_jax.signature import check_batches_differ
from bagua_jax.state_transfer import state_from_bytes
from bagua_jax.step_means import StepMeans
from bagua_jax.train_state import TrainState, rewrap_state, unwrap_state
from bagua_jax.trainer import DataParallel

__all__ = ["WeighedOutStep", "weighs_out"]


def weighs_out(trainer: DataParallel) -> bool:
    """Whether a joiner of ``trainer``'s job can take its first step weighed out: a step whose collectives are
    full-precision averages over the world (gradient allreduce averaging flat, PowerSGD) over a native host engine (MPI,
    TCP), whose averages take a divisor at run time."""
    config = trainer.algorithm.config
    communicator = trainer.communicator
    return (
        config.step_free_of_world_size
        and getattr(config, "average", True)
        and not getattr(config, "hierarchical", False)
        and communicator is not None
        and communicator.on_host
    )


class WeighedOutStep:
    """``trainer``'s step (a state without a model state, no key) as its two halves: the average of the ranks'
    gradients with the algorithm's new state, to which a rank weighed out of the step contributes zeros, and the
    optimizer's update."""

    def __init__(self, trainer: DataParallel):
        if not weighs_out(trainer):
            raise ValueError(
                "WeighedOutStep: only a step of full-precision averages (gradient allreduce averaging flat, PowerSGD) "
                "over a host engine (MPI, TCP) weighs out"
            )
        self._trainer = trainer
        self._transform = trainer.algorithm.transform(trainer._comms)
        self._average = jax.jit(self._averaged, static_argnames="contributes")
        self._apply = jax.jit(self._applied)
        self._compiled: Future | None = None

    def _averaged(self, params: Any, algorithm_state: Any, batch: Any, contributes: bool) -> tuple[Any, Any, Any]:
        """The ranks' averaged gradients, the algorithm's state after them, and the mean loss (and aux); a rank that
        does not contribute sends zeros of the same layout (the loss's shapes traced, never computed)."""
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
        averaged, algorithm_state = self._transform.update(grads, algorithm_state, params, step_means=step_means)
        _, (loss, aux) = step_means.result(trainer._world)
        return averaged, algorithm_state, ((loss, aux) if trainer._has_aux else loss)

    def _applied(self, state: TrainState, averaged: Any, algorithm_state: Any) -> TrainState:
        """``state`` after the optimizer applied ``averaged``, with the algorithm's state that came with them (the
        optimizer chain's first)."""
        _, inner = state.opt_state
        updates, inner = self._trainer._optimizer.update(averaged, inner, state.params)
        return TrainState(optax.apply_updates(state.params, updates), (algorithm_state, inner), state.step + 1, None)

    def compile_in_background(self, state: Any, batch: Any) -> None:
        """Compile both halves (the average as a contributing rank and as one weighed out) for ``state``'s (what
        :meth:`DataParallel.step` takes) and ``batch``'s shapes on a thread, without running them; once (later calls
        do nothing). :meth:`step` waits for it."""
        if self._compiled is None:
            self._compiled = in_background(lambda: self._compile(unwrap_state(state), batch), COMPILING_AHEAD)

    def compile(self, state: Any, batch: Any) -> None:
        """:meth:`compile_in_background`, waited for: a joiner compiles before it asks to be admitted."""
        self.compile_in_background(state, batch)
        self._compiled.result()

    def _compile(self, state: TrainState, batch: Any) -> None:
        algorithm_state = state.opt_state[0]
        average = functools.partial(self._averaged, contributes=True)
        averaged, new_algorithm_state, _ = jax.eval_shape(average, state.params, algorithm_state, batch)
        for contributes in (False, True):
            self._average.lower(state.params, algorithm_state, batch, contributes=contributes).compile()
        self._apply.lower(state, averaged, new_algorithm_state).compile()

    def step(
        self, state: Any, batch: Any, incoming: Future | None = None, epoch: Epoch | None = None
    ) -> tuple[Any, Any]:
        """One step, as :meth:`DataParallel.step` returns it (the new state, the ranks' mean loss). With
        ``incoming`` (the state's bytes on their way to a rank weighed out of the step, from
        :func:`~bagua_jax.state_transfer.transfer_in_group`), the rank sends zeros, then applies the averaged
        gradients to the state received, laid out as ``state`` (MembershipChanged if ``epoch`` closes first), its
        per-rank leaves kept as they were; ``state`` then holds the algorithm's replicated state
        (:func:`~bagua_jax.state_transfer.with_algorithm_state`)."""
        trainer = self._trainer
        if self._compiled is not None:
            self._compiled.result()
        if not trainer._batches_checked:
            check_batches_differ(batch, trainer.communicator)
            trainer._batches_checked = True
        own, user_state = unwrap_state(state), None if isinstance(state, TrainState) else state
        averaged, algorithm_state, result = self._average(
            own.params, own.opt_state[0], batch, contributes=incoming is None
        )
        if incoming is None:
            return rewrap_state(user_state, self._apply(own, averaged, algorithm_state)), result
        received = state_from_bytes(wait_unless(incoming, epoch.closed, f"epoch {epoch.number} closed first"), state)
        new = self._apply(received, averaged, algorithm_state)
        # It trained nothing: its per-rank leaves (error-feedback residuals) stay as they were.
        return rewrap_state(user_state, state_rules.carry_over(state_rules.roles(trainer, own), new, own)), result

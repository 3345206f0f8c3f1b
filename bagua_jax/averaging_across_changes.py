"""Asynchronous model averaging in a fault-tolerant JAX job: the background rounds over each epoch's members.

Without fault tolerance the user's loop drives an :class:`~bagua_jax.algorithms.AsyncModelAverager` beside the
trainer. Under :class:`~bagua_jax.fault_tolerance.FaultTolerantTrainer` the trainer drives it, as torch's wrapper
does, since only it knows when the members change:

- The rounds run on a companion of the job's communicator (:meth:`~bagua_jax.NativeCommunicator.companion`), which
  follows the members and is revoked with them; each epoch's rounds on a handle of that epoch's communicator
  (:meth:`~bagua_jax.NativeCommunicator.pinned`), so that a round a change interrupts fails at once instead of
  reaching the new members.
- A round that fails fails the epoch from the thread at once (its error is raised again, and recovered from, as the
  next committed step applies the rounds); a change of members abandons the rounds
  (:meth:`~bagua_common.algorithms.averaging_rounds.AveragingRounds.abandon`: a round finished but not applied is
  dropped, so each member keeps its own weights), and the new members, a joiner too, start them again from the
  step they go on from, dividing by their number.
- The rounds' functions take the number of members as the kernel's attribute: compiling them again in the recovery
  took 1.1-1.3 s on the GPT ``mini``. The members compile them from a thread after a step for one member fewer and
  one more (:meth:`AveragingAcrossChanges.compile_ahead`), as the step is (:mod:`bagua_jax.resized_steps`).
"""

from __future__ import annotations

from concurrent.futures import Future
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from bagua_common.fault_tolerance import Epoch, Membership
from bagua_common.fault_tolerance.background import COMPILING_AHEAD, in_background
from bagua_jax.algorithms.async_model_average import AsyncModelAverage, AsyncModelAverager, compiled_rounds
from bagua_jax.epoch_communicator import communication_failure
from bagua_jax.native_communicator import NativeCommunicator
from bagua_jax.train_state import TrainState, rewrap_state, unwrap_state

__all__ = ["AveragingAcrossChanges"]


class AveragingAcrossChanges:
    """``algorithm``'s background rounds in a fault-tolerant job over ``communicator`` (the job's; its companion is
    made here, so every member makes this at the same point, before the communicator's first change)."""

    def __init__(self, algorithm: AsyncModelAverage, communicator: NativeCommunicator):
        self._algorithm = algorithm
        self._companion = communicator.companion("async_model_average")
        self._averager: AsyncModelAverager | None = None
        self._members: NativeCommunicator | None = None  # the handle of this epoch's rounds
        self._ahead_for: int | None = None  # the number of members the numbers around were compiled for
        self._ahead: dict[int, Future] = {}  # by number of members: the rounds' functions compiled for it

    @property
    def rounds(self) -> int:
        """The rounds this epoch's members completed so far (0 before :meth:`start`)."""
        return 0 if self._averager is None else self._averager.rounds

    def start(self, state: Any, membership: Membership, epoch: Epoch) -> None:
        """Start the rounds of ``epoch``'s members, whose communicator the job's is now, ``state``'s step counted (they
        start once its warm-up is over); a round's failed communication fails ``epoch`` in ``membership`` at once.
        Local: every member calls it once the members changed."""

        def failed(error: BaseException) -> None:
            if communication_failure(error) and not epoch.closed.is_set():
                membership.fail(epoch, f"asynchronous averaging's round failed: {str(error).splitlines()[0]}")

        own = unwrap_state(state)
        self._members = self._companion.pinned()
        compiled = self._ahead.get(self._members.size)
        if compiled is not None:
            compiled.exception()  # waits for its thread, begun before the change; a failure: compiled again below
        self._averager = self._algorithm.averager(own.params, self._members, steps_done=int(own.step), failed=failed)

    def compile_ahead(self, state: Any, size: int) -> None:
        """Compile, from a thread each, the rounds' functions for ``state``'s weights among one member fewer, then one
        more, than ``size``; once per number of members (later calls do nothing)."""
        if self._ahead_for == size:
            return
        self._ahead_for, self._ahead, previous = size, {}, None
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), unwrap_state(state).params)
        bucket_bytes = self._algorithm.bucket_bytes
        for around in (size - 1, size + 1):  # a death first; one after the other: the second would slow the first
            if around >= 1:
                compile_it = partial(_compiled_after, previous, shapes, around, bucket_bytes)
                self._ahead[around] = previous = in_background(compile_it, f"{COMPILING_AHEAD}-rounds-{around}")

    def apply(self, state: Any) -> Any:
        """``state`` after a committed step, the last finished round applied (if any)."""
        own = unwrap_state(state)
        params = self._averager.apply(own.params)
        return rewrap_state(None if isinstance(state, TrainState) else state, own._replace(params=params))

    def abandon(self) -> None:
        """End this epoch's rounds: its members changed (their collectives fail with the epoch), or the job finished
        (every member calls it after its last step, and the threads agree to stop). Nothing once ended."""
        if self._averager is not None:
            self._averager.abandon()
            self._members.close()
            self._averager = self._members = None


def _compiled_after(previous: Future | None, shapes: Any, size: int, bucket_bytes: int) -> None:
    """:func:`~bagua_jax.algorithms.async_model_average.compiled_rounds` for weights of ``shapes`` (zeros: the step
    donates the state's buffers), once ``previous`` (if any) ended."""
    if previous is not None:
        previous.exception()
    compiled_rounds(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes), size, bucket_bytes)

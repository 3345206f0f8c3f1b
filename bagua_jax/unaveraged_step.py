"""The step a fault-tolerant (low-precision) decentralized job's members train while a joiner sits it out: their step,
exchanging nothing. A member whose exchange failed where the others' completed (the step voted one ahead) takes that
step by itself the same way, after the change (:meth:`bagua_jax.fault_tolerance.FaultTolerantTrainer.step`).

A joiner has no weights to exchange until its state arrives, and a pair's or the ring's exchange would wait for it. So
the members train the step after its admission without it: each steps from its own weights by its own gradient, on all
the step's samples, the step counted (the exchanges' schedule goes on); the first member sends the joiner its state
meanwhile, and the joiner votes for that step once the state is there, counts it as sat out (:func:`counted_on`),
returns the loss of the state it was given on the first member's samples (:meth:`UnaveragedStep.loss`, compiled before
it asked to be admitted) and trains from the next step. The members wait for the joiner only where the state takes
longer than that step to arrive.

That step is a second compiled step: a copy of the trainer whose algorithm exchanges nothing
(:class:`~bagua_jax.algorithms.decentralized.WithoutAveraging`; low-precision decentralized training's copies of the
neighbours' weights stay as they are, and restart at the next step's start on every member:
:meth:`bagua_jax.fault_tolerance.FaultTolerantTrainer.step`). It communicates nothing, so it runs on
any number of members as compiled; the members compile it from a thread after their first step, long before a
joiner comes (:meth:`UnaveragedStep.compile_in_background`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import jax

from bagua_common.fault_tolerance.background import COMPILING_AHEAD, in_background
from bagua_jax.algorithms.decentralized import DecentralizedState, WithoutAveraging
from bagua_jax.algorithms.low_precision_decentralized import LowPrecisionDecentralizedState
from bagua_jax.train_state import TrainState, rewrap_state, unwrap_state
from bagua_jax.trainer import DataParallel

__all__ = ["StepBehind", "UnaveragedStep", "counted_on"]


@dataclass
class StepBehind:
    """The step a member voting one ahead was on when the members changed, which the others may have applied
    without it: ``take`` gives its state and result (its own, as computed; or trained alone, its exchange having
    failed), ``trainers`` is the number of members its samples were split among; ``taken`` once taken."""

    take: Callable[[], tuple[Any, Any]]
    trainers: int
    result: Any = None
    taken: bool = False


class UnaveragedStep:
    """``trainer``'s step ((low-precision) decentralized training, without a model state, which would be averaged)
    exchanging nothing."""

    def __init__(self, trainer: DataParallel):
        if not isinstance(trainer.algorithm, WithoutAveraging) or not trainer.algorithm.averages:
            raise ValueError("UnaveragedStep: only (low-precision) decentralized training has an unaveraged step")
        self._trainer = copy.copy(trainer)
        self._trainer._use(trainer.algorithm.without_averaging())
        self._trainer._batches_checked = True  # a collective: the members checked their batches in their first step
        self._compiled: Future | None = None
        self._loss = jax.jit(trainer._loss_fn)

    def compile_in_background(self, state: Any, batch: Any) -> None:
        """Compile the step for ``state``'s and ``batch``'s shapes on a thread, once (later calls do nothing);
        :meth:`step` waits for it."""
        if self._compiled is None:
            self._compiled = in_background(lambda: self._trainer.compile(state, batch), COMPILING_AHEAD)

    def compile_loss(self, state: Any, batch: Any) -> None:
        """Compile :meth:`loss` for ``state``'s and ``batch``'s shapes without running it (a joiner, before it asks)."""
        self._loss.lower(unwrap_state(state).params, batch).compile()

    def loss(self, state: Any, batch: Any) -> Any:
        """The loss (and aux, as :meth:`DataParallel.step` returns them) of ``state``'s parameters on ``batch``, no
        gradient taken: what a joiner sitting out the step returns for it."""
        return self._loss(unwrap_state(state).params, batch)

    def step(self, state: Any, batch: Any) -> tuple[Any, Any]:
        """One step without averaging, as :meth:`DataParallel.step` returns it (each member's own loss)."""
        if self._compiled is not None:
            self._compiled.result()
        return self._trainer.step(state, batch)


def counted_on(state: Any) -> Any:
    """``state`` (a joiner's, as the first member sent it) one step on without training: its step, and the
    algorithm's step counter the exchanges' schedule reads."""
    own = unwrap_state(state)
    counted = TrainState(own.params, _skip_one_step(own.opt_state), own.step + 1, own.model_state)
    return rewrap_state(None if isinstance(state, TrainState) else state, counted)


def _skip_one_step(opt_state: Any) -> Any:
    """``opt_state`` with the algorithm's state in it one step on."""
    counters = (DecentralizedState, LowPrecisionDecentralizedState)

    def skip(node: Any) -> Any:
        return node._replace(step=node.step + 1) if isinstance(node, counters) else node

    return jax.tree.map(skip, opt_state, is_leaf=lambda node: isinstance(node, counters))

"""A fault-tolerant job's step compiled ahead for the world sizes a change of members brings.

Where a step's layout follows the world size (ByteGrad's and the compressed Adams' chunks, decentralized training's
pairs and ring, DiLoCo's compressed exchange), a change of members used to compile it again in the recovery, while
every member waited: 9.8 s on the GPT ``mini`` with 3 ranks on 2 cores. :class:`ResizedSteps` compiles it, from a thread
after a step, for one member fewer and one more, on copies of the trainer whose communicator reports that size
(:func:`resized_trainer`: the same engine and handle, whose size the engine reads at run time), and gives the trainer
the one that matches at the change. The native primitives take the size as a static attribute and the handle's
communicator at run time, so a step compiled for ``n`` ranks runs on the grown or shrunk communicator in the same slot.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future
from functools import partial
from typing import Any

from bagua_common.comm.topology import Communicators
from bagua_common.fault_tolerance import FaultToleranceSettings
from bagua_common.fault_tolerance.admission import job_size
from bagua_common.fault_tolerance.background import COMPILING_AHEAD, in_background
from bagua_jax import state_rules
from bagua_jax.train_state import TrainState, unwrap_state
from bagua_jax.trainer import DataParallel

__all__ = ["ResizedSteps", "resized_trainer"]


def resized_trainer(trainer: DataParallel, size: int) -> DataParallel:
    """A copy of ``trainer`` (native mode) whose steps and fresh states are traced for ``size`` ranks: its
    communicator is a copy of ``trainer``'s (the same engine and handle) that reports ``size``. Its compiled steps run
    on ``trainer``'s communicator once that has ``size`` members."""
    if trainer.communicator is None:
        raise ValueError("resized_trainer: a DataParallel in native mode (communicator=)")
    view = copy.copy(trainer.communicator)
    view.size = size
    twin = copy.copy(trainer)
    twin._world, twin._comms = view, Communicators(world=view)
    twin._use(trainer.algorithm)
    return twin


class ResizedSteps:
    """``trainer``'s step compiled ahead for one member fewer and one more than it has (see the module docstring)."""

    def __init__(self, trainer: DataParallel):
        self._trainer = trainer
        self._size: int | None = None  # the world size the sizes around were compiled for
        self._ready: dict[int, Future] = {}  # by size: the copy of the trainer compiled for it

    def compile_in_background(self, state: Any, batch: Any, role_tree: TrainState) -> None:
        """Compile, from a thread each, the step for ``batch``'s shapes and ``state``'s carried over by
        ``role_tree``'s rules (:func:`~bagua_jax.state_rules.carry_over`) to one member fewer, then one more, than the
        trainer has; once per world size (later calls do nothing)."""
        size = self._trainer.size
        if self._size == size:
            return
        self._size, self._ready = size, {}
        previous = None
        for around in (size - 1, size + 1):  # a death first: more common than an admission
            if around >= 1:  # one after the other: the second would only slow the first
                compile_it = partial(self._compiled, around, state, batch, role_tree, previous)
                self._ready[around] = previous = in_background(compile_it, f"{COMPILING_AHEAD}-resize-{around}")

    def compile_for_joining(
        self, state: Any, batch: Any, role_tree: TrainState, settings: FaultToleranceSettings, master: tuple[str, int]
    ) -> None:
        """A joiner's, before it asks: compile the step for one member more than the job has, as a live member's store
        at ``master`` says (nothing when none answers: it compiles once admitted)."""
        size = job_size(settings, *master)
        if size is not None:
            self._ready = {size + 1: Future()}
            self._ready[size + 1].set_result(self._compiled(size + 1, state, batch, role_tree))

    def _compiled(
        self, size: int, state: Any, batch: Any, role_tree: TrainState, after: Future | None = None
    ) -> DataParallel:
        if after is not None:
            after.exception()  # waits; its failure is its own
        own = unwrap_state(state)
        twin = resized_trainer(self._trainer, size)
        fresh = TrainState(own.params, twin._init(own.params), own.step, own.model_state)
        twin.compile(state_rules.carry_over(role_tree, own, fresh), batch)
        return twin

    def adopt(self, size: int) -> bool:
        """Give the trainer its steps and fresh states compiled for ``size`` ranks, once they are (waiting for their
        thread, which began before the change); False (nothing changed) when there are none, or their compilation
        failed: the trainer then compiles them again."""
        ready, self._ready = self._ready.get(size), {}
        if ready is None or ready.exception() is not None:
            return False
        twin = ready.result()
        self._trainer._tx, self._trainer._steps, self._trainer._init = twin._tx, twin._steps, twin._init
        self._trainer._nnx_step = None
        return True

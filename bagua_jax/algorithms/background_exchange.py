"""Streaming DiLoCo's outer exchanges on a background thread: started in one jitted step, finished tau steps later.

The native collectives are XLA custom calls that run inside the step that issues them, so an
exchange issued in the jitted step would hold that step up for its whole wire time. Instead the
step that starts a fragment's exchange hands its pseudo-gradient (and error-feedback residual)
to a host callback, which queues the average on a thread of its own and returns at once; the
thread runs it over the MPI engine on a communicator split from the world for it alone (so its
collectives never interleave with the step's), while the next tau inner steps compute. The
step that applies the fragment hands the same inputs to a second callback, which waits for the
thread's result (not at all when the wire was faster than the tau steps) and returns it.

The inputs live in the optimizer state until the exchange is applied, so the result is a
function of the state alone: when the thread has no exchange of exactly those inputs (a process
restored from a checkpoint taken while an exchange was on the wire), the finishing callback
queues it then and waits for it, and the parameters come out bit for bit as if nothing had
stopped. Every rank restores the same step, so all take that path together. The thread runs
exchanges one at a time in the order the steps started them, the same order on every rank. A
dead peer makes the communicator's timeout fire: the finishing step raises its error.

The communicator is the world's companion (:meth:`~bagua_jax.NativeCommunicator.companion`): in a fault-tolerant
job it follows the members, and is revoked with the world when they change. Each exchange runs on the communicator
of the members that started it (a handle of its own), so one abandoned by a change fails at once instead of reaching
the new members; the step that applies it finds it started by other members and runs it again among the new ones,
each with its own inputs (the survivors' pseudo-gradients: no inner step is lost).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import NamedTuple

import jax
import numpy as np
from jax.experimental import io_callback

from bagua_jax.host_communicator import HostCommunicator
from bagua_jax.native_communicator import NativeCommunicator

Average = Callable[[jax.Array, jax.Array, jax.Array, HostCommunicator], tuple[jax.Array, jax.Array]]
"""``average(pseudo_gradient, residual, trained, comm)``: the ranks' mean pseudo-gradient over ``comm`` and the new
residual; ``trained`` is this rank's weight (a float32 scalar, 1.0 or 0.0: :attr:`DiLoCoState.trained`)."""


class _Exchange(NamedTuple):
    """One fragment's exchange handed to the thread: its inputs (host copies), the communicator's generation it runs
    on, and its result to come."""

    step: int
    pseudo_gradient: np.ndarray
    residual: np.ndarray
    trained: np.ndarray
    generation: int
    result: Future

    def has_inputs(self, step: int, inputs: tuple[np.ndarray, np.ndarray, np.ndarray], generation: int) -> bool:
        """Whether this exchange was started at ``step`` from these exact bits (NaNs included) of its pseudo-gradient,
        residual and weight, by the members of the communicator's ``generation``."""
        mine = (self.pseudo_gradient, self.residual, self.trained)
        return (
            self.step == step and self.generation == generation and all(_same_bits(a, b) for a, b in zip(mine, inputs))
        )


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    # Compared as integers of the same width, in place (float32 only: the pseudo-gradients and residuals).
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def _shut_down(thread: ThreadPoolExecutor, comm: NativeCommunicator, workers: list[threading.Thread]) -> None:
    """Release ``thread`` and ``comm`` after the exchanges in flight, called from any thread.

    A garbage collection, which runs on whatever thread allocates, may find the exchange garbage
    on ``thread``'s own worker (one of ``workers``), which cannot join itself: there the
    communicator is closed by a last task of the thread's, after the exchange it is running.
    """
    if threading.current_thread() in workers:
        thread.submit(comm.close)
        thread.shutdown(wait=False)
    else:
        thread.shutdown(wait=True)
        comm.close()


class BackgroundExchange:
    """Outer exchanges over a companion of ``world`` (a NativeCommunicator over MPI) on a thread of their own.

    Collective over ``world`` (it makes the companion): every rank makes one at the same point. ``average``
    is the exchange itself, run on the thread with a :class:`~bagua_jax.host_communicator.HostCommunicator`;
    call :meth:`start` in the jitted step that starts a fragment's exchange and :meth:`finish` in
    the step that applies it, with the same inputs. Its thread and communicator are released when
    it is garbage collected (at the latest at exit), after the exchanges in flight.
    """

    def __init__(self, world: NativeCommunicator, average: Average, name: str) -> None:
        self._comm = comm = world.companion(f"{name}/outer_exchange")
        self._average = average
        workers: list[threading.Thread] = []
        self._thread = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=f"{name}-outer-exchange",
            initializer=lambda: workers.append(threading.current_thread()),
        )
        self._in_flight: dict[int, _Exchange] = {}
        weakref.finalize(self, _shut_down, self._thread, comm, workers)

    def start(
        self, fragment: int, step: jax.Array, pseudo_gradient: jax.Array, residual: jax.Array, trained: jax.Array
    ) -> None:
        """(Inside ``jit``) queue fragment ``fragment``'s exchange, started after inner step ``step``, this rank's
        pseudo-gradient weighed by ``trained``."""
        io_callback(partial(self._start, fragment), None, step, pseudo_gradient, residual, trained, ordered=True)

    def finish(
        self, fragment: int, step: jax.Array, pseudo_gradient: jax.Array, residual: jax.Array, trained: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """(Inside ``jit``) the mean pseudo-gradient and new residual of the exchange :meth:`start` queued
        with these arguments, waiting for it if it is still on the wire (or running it now if it never was)."""
        shapes = (
            jax.ShapeDtypeStruct(pseudo_gradient.shape, np.float32),
            jax.ShapeDtypeStruct(residual.shape, np.float32),
        )
        return io_callback(
            partial(self._finish, fragment), shapes, step, pseudo_gradient, residual, trained, ordered=True
        )

    def _submit(self, step: np.ndarray, *inputs: np.ndarray) -> _Exchange:
        # The callback's arguments may alias XLA's buffers: the thread gets its own copies.
        pseudo_gradient, residual, trained = (np.array(x, copy=True) for x in inputs)
        result = self._thread.submit(self._run, self._comm.pinned(), pseudo_gradient, residual, trained)
        return _Exchange(int(step), pseudo_gradient, residual, trained, self._comm.generation, result)

    def _run(self, members: NativeCommunicator, *inputs: np.ndarray) -> tuple[jax.Array, jax.Array]:
        try:
            return self._average(*inputs, HostCommunicator(members))
        finally:
            members.close()

    def _start(self, fragment: int, step: np.ndarray, *inputs: np.ndarray) -> None:
        self._in_flight[fragment] = self._submit(step, *inputs)

    def _finish(self, fragment: int, step: np.ndarray, *inputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        exchange = self._in_flight.pop(fragment, None)
        if exchange is None or not exchange.has_inputs(int(step), inputs, self._comm.generation):
            exchange = self._submit(step, *inputs)
        mean, new_residual = exchange.result.result()
        return np.asarray(mean, np.float32), np.asarray(new_residual, np.float32)

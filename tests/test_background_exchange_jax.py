"""Streaming DiLoCo's BackgroundExchange releases its thread and communicator from whichever thread collects it.

A garbage collection runs on whatever thread allocates, the exchange's own included; a finalizer
that joined the exchange's thread from that thread raised "cannot join current thread" and left
the communicator open. The world and the host communicator are stand-ins here (the thread and
its shutdown are what is checked); tests/test_diloco_jax.py runs the exchange over MPI.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

from bagua_jax.algorithms import background_exchange
from bagua_jax.algorithms.background_exchange import BackgroundExchange


class _Split:
    """The world's companion: records on which thread it is closed, after which exchanges."""

    generation = 0

    def __init__(self) -> None:
        self.exchanges_done = 0
        self.closed_after: int | None = None
        self.closed = threading.Event()

    def pinned(self) -> _Pinned:
        return _Pinned(self)

    def close(self) -> None:
        self.closed_after = self.exchanges_done
        self.closed.set()


class _Pinned:
    """The companion's communicator an exchange runs on."""

    def __init__(self, split: _Split) -> None:
        self.split = split

    def close(self) -> None:
        pass


class _World:
    def __init__(self) -> None:
        self.split_made = _Split()

    def companion(self, name: str) -> _Split:
        return self.split_made


def test_collected_on_its_own_thread_it_closes_the_communicator_after_the_exchange(monkeypatch):
    monkeypatch.setattr(background_exchange, "HostCommunicator", lambda comm: comm)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    world = _World()
    holder: list[BackgroundExchange] = []
    dropped_here = threading.Event()

    def average(
        pseudo_gradient: np.ndarray, residual: np.ndarray, trained: np.ndarray, comm: _Pinned
    ) -> tuple[np.ndarray, np.ndarray]:
        dropped_here.wait(timeout=5)
        holder.clear()  # the last reference to the exchange goes on its own thread: its finalizer runs here
        comm.split.exchanges_done += 1
        return pseudo_gradient / 2, residual

    exchange = BackgroundExchange(world, average, "test")
    exchange._start(0, np.int32(1), np.ones(3, np.float32), np.zeros(0, np.float32), np.float32(1.0))
    result = exchange._in_flight[0].result
    holder.append(exchange)
    del exchange
    dropped_here.set()
    np.testing.assert_array_equal(result.result(timeout=5)[0], np.full(3, 0.5, np.float32))
    assert world.split_made.closed.wait(timeout=5), [u.exc_value for u in unraisable]
    assert world.split_made.closed_after == 1
    assert not unraisable, [u.exc_value for u in unraisable]

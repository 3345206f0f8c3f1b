"""Waits of a fault-tolerant member that give up once its epoch changes: for work it runs on a thread, and for a
key of the epoch's store.

A member's thread may block on a peer that died (a group's connect, a state's transfer): whoever waits for it gives
up once the epoch fails or closes, and the thread, a daemon, is left to end on its own timeout. A wait for a store key
polls, so that it never holds the store's connection (shared with the training thread) for long.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from bagua_common.fault_tolerance.errors import MembershipChanged
from bagua_common.fault_tolerance.kv_store import StoreClient

__all__ = ["COMPILING_AHEAD", "get_unless", "in_background", "wait_unless"]

_POLL_S = 0.05  # how often a wait looks whether its event was set meanwhile

COMPILING_AHEAD = "bagua-ft-compile"
"""The prefix of the names of the threads that compile steps before they are needed (JAX: a joiner's first step, the
world sizes a change brings): a benchmark of the steady state waits for them first."""


def in_background(work: Callable[[], Any], name: str) -> Future:
    """``work()`` on a daemon thread (one stuck in a collective never holds up the process's exit)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits for the result
            future.set_exception(error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


def wait_unless(future: Future, event: threading.Event, why: str) -> Any:
    """``future``'s result (or its error), given up with MembershipChanged(``why``) once ``event`` is set (an
    epoch's ``failed`` or ``closed``)."""
    while True:
        try:
            return future.result(timeout=_POLL_S)
        except FutureTimeout:
            if event.is_set():
                raise MembershipChanged(why) from None


def get_unless(store: StoreClient, key: str, wait: float, event: threading.Event, why: str) -> bytes | None:
    """The value of ``key`` in ``store``, waiting up to ``wait`` seconds for it (None if it was not set), given up
    with MembershipChanged(``why``) once ``event`` is set."""
    deadline = time.monotonic() + wait
    while True:
        value = store.get(key, wait=min(_POLL_S, max(0.0, deadline - time.monotonic())))
        if value is not None or time.monotonic() >= deadline:
            return value
        if event.is_set():
            raise MembershipChanged(why)

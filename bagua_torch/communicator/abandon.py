"""Waiting for ``torch.distributed`` works that a fault-tolerant job may abandon when its members change."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from functools import partial
from typing import Any

from bagua_common.fault_tolerance.errors import MembershipChanged
from bagua_torch.communicator.protocol import CommunicationError

__all__ = ["caused_by_a_change", "wait_or_abandon"]

_ABANDON_CHECK_S = 0.2  # the longest a wait sleeps before it looks again whether its step was abandoned
_FIRST_POLL_S = 2e-4  # NCCL: the first look whether a collective completed; each next one waits twice as long...
_POLL_S = 2e-3  # ...up to this: the most a completed collective waits to be noticed


def wait_or_abandon(
    works: Sequence[Any], abandon: threading.Event, timeout: float, group: Any, backend: str, what: str
) -> list[Any]:
    """Wait until every work of ``works`` (the collective ``what``) completed or failed, or ``timeout`` seconds
    passed; raise MembershipChanged once ``abandon`` is set. Return the works the caller still waits for with their
    own ``wait()`` (which raises their error): those with a future. A work without one (gloo's send and recv,
    whose ``is_completed()`` stays False until waited for) is waited for here, on a thread of its own, and its
    error is raised here. Abandoned works are left to their backend (torch 2.13's works have no ``abort``, and gloo
    cannot cancel a collective: a point-to-point work's thread ends when the peer's process does, or at ``timeout``)
    and their group is not used again; an NCCL ``group`` is aborted (not run here: no GPU).

    A gloo work is waited for in its own ``wait`` (woken at completion, and every ``_ABANDON_CHECK_S`` to look at
    ``abandon``): polling its ``is_completed()`` every few milliseconds took 23 ms of CPU per second waited, which
    the ranks still computing lose when ranks share cores. No work is given a completion callback: an abandoned
    gloo collective completes (fails) only when a peer's process ends, which may be while this process is
    finalizing its interpreter, and a callback's Python code would then take the GIL on gloo's thread, which
    aborts the process (SIGABRT).
    """
    errors: list[BaseException] = []
    with_future, waits, threads_done = [], [], []
    for work in works:
        try:
            work.get_future()
        except RuntimeError:  # point-to-point works have no future
            finished = threading.Event()
            threading.Thread(
                target=_wait_on_thread, args=(work, timeout, errors, finished), name=f"wait {what}", daemon=True
            ).start()
            waits.append(finished.wait)
            threads_done.append(finished)
            continue
        with_future.append(work)
        waits.append(partial(_blocking_wait if backend == "gloo" else _polled_wait, work))
    deadline = time.monotonic() + timeout
    timed_out = False
    for wait in waits:
        while not timed_out and not wait(min(_ABANDON_CHECK_S, max(1e-3, deadline - time.monotonic()))):
            if abandon.is_set():
                if backend == "nccl":  # NCCL can cancel its kernels
                    getattr(group, "abort", lambda: None)()
                raise MembershipChanged(f"{what} was abandoned: the members changed")
            timed_out = time.monotonic() > deadline
    if errors:
        raise errors[0]
    if not all(finished.is_set() for finished in threads_done):
        raise RuntimeError(f"{what} did not complete within {timeout:g} s")
    return with_future


def _wait_on_thread(work: Any, timeout: float, errors: list[BaseException], finished: threading.Event) -> None:
    """Wait for a work without a future; its error goes to ``errors`` (raised again by the caller's thread)."""
    try:
        work.wait(timedelta(seconds=timeout))
    except BaseException as error:  # noqa: BLE001
        errors.append(error)
    finished.set()


def _blocking_wait(work: Any, seconds: float) -> bool:
    """Whether a gloo ``work`` completed (or failed: its own ``wait`` raises that again) within ``seconds``."""
    try:
        work.wait(timedelta(seconds=seconds))
    except RuntimeError:  # timed out, or failed
        return bool(work.is_completed())
    return True


def _polled_wait(work: Any, seconds: float) -> bool:
    """Whether ``work`` completed within ``seconds``, looking at ``is_completed()`` ever less often."""
    end, pause = time.monotonic() + seconds, _FIRST_POLL_S
    while not work.is_completed():
        if time.monotonic() >= end:
            return False
        time.sleep(pause)
        pause = min(2 * pause, _POLL_S)
    return True


def caused_by_a_change(error: BaseException | None) -> bool:
    """Whether ``error`` (or what caused it: a background thread's error is raised again wrapped) is a lost
    member's doing: an abandoned or failed collective."""
    while error is not None:
        if isinstance(error, (MembershipChanged, CommunicationError)):
            return True
        error = error.__cause__
    return False

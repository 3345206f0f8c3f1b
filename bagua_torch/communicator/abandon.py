"""Waiting for ``torch.distributed`` works that a fault-tolerant job may abandon when its members change."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from bagua_common.fault_tolerance.errors import MembershipChanged

__all__ = ["wait_or_abandon"]

_FIRST_POLL_S = 2e-4  # the first look whether a collective completed; each next one waits twice as long...
_POLL_S = 2e-3  # ...up to this: the most a completed collective waits to be noticed


def wait_or_abandon(
    works: Sequence[Any], abandon: threading.Event, timeout: float, group: Any, backend: str, what: str
) -> list[Any]:
    """Wait until every work of ``works`` (the collective ``what``) completed or failed, or ``timeout`` seconds
    passed; raise MembershipChanged once ``abandon`` is set. Return the works the caller still waits for with their
    own ``wait()`` (which raises their error): those with a future. A work without one (gloo's send and recv,
    whose ``is_completed()`` stays False until waited for) is waited for here, on a thread of its own, and its
    error is raised here; it is aborted when abandoned. Other abandoned works are left to their backend (gloo
    cannot cancel a collective) and their group is not used again; an NCCL ``group`` is aborted (not run here: no
    GPU).

    The works with a future are polled, never given a completion callback: an abandoned gloo collective completes
    (fails) only when a peer's process ends, which may be while this process is finalizing its interpreter, and a
    callback's Python code would then take the GIL on gloo's thread, which aborts the process (SIGABRT).
    """
    errors: list[BaseException] = []
    waited: list[Any] = []

    def wait_for(work: Any) -> None:
        try:
            work.wait(timedelta(seconds=timeout))
        except BaseException as error:  # noqa: BLE001 -- raised again by the caller's thread
            errors.append(error)
        waited.append(work)

    with_future, without_future = [], []
    for work in works:
        try:
            work.get_future()
        except RuntimeError:  # point-to-point works have no future
            without_future.append(work)
            threading.Thread(target=wait_for, args=(work,), name=f"wait {what}", daemon=True).start()
            continue
        with_future.append(work)
    deadline = time.monotonic() + timeout
    pause = _FIRST_POLL_S
    while len(waited) < len(without_future) or not all(work.is_completed() for work in with_future):
        if abandon.is_set():
            for work in without_future:
                work.abort()
            if backend == "nccl":  # NCCL can cancel its kernels
                getattr(group, "abort", lambda: None)()
            raise MembershipChanged(f"{what} was abandoned: the members changed")
        if time.monotonic() > deadline:
            break
        time.sleep(pause)
        pause = min(2 * pause, _POLL_S)
    if errors:
        raise errors[0]
    if len(waited) < len(without_future):
        raise RuntimeError(f"{what} did not complete within {timeout:g} s")
    return with_future

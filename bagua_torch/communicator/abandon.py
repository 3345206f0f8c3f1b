"""Waiting for ``torch.distributed`` works that a fault-tolerant job may abandon when its members change."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from bagua_common.fault_tolerance.errors import MembershipChanged

__all__ = ["wait_or_abandon"]

_POLL_S = 0.05  # how often a wait looks whether its collective was abandoned


def wait_or_abandon(
    works: Sequence[Any], abandon: threading.Event, timeout: float, group: Any, backend: str, what: str
) -> list[Any]:
    """Wait until every work of ``works`` (the collective ``what``) completed or failed, or ``timeout`` seconds
    passed; raise MembershipChanged once ``abandon`` is set. Return the works the caller still waits for with their
    own ``wait()`` (which raises their error): those with a future. A work without one (gloo's send and recv,
    whose ``is_completed()`` stays False until waited for) is waited for here, on a thread of its own, and its
    error is raised here; it is aborted when abandoned. Other abandoned works are left to their backend (gloo
    cannot cancel a collective) and their group is not used again; an NCCL ``group`` is aborted (not run here: no
    GPU)."""
    finished = threading.Event()
    left = [len(works)]
    errors: list[BaseException] = []
    waited: list[Any] = []
    lock = threading.Lock()

    def one_done(_future: Any = None) -> None:
        with lock:
            left[0] -= 1
            if left[0] <= 0:
                finished.set()

    def wait_for(work: Any) -> None:
        try:
            work.wait(timedelta(seconds=timeout))
        except BaseException as error:  # noqa: BLE001 -- raised again by the caller's thread
            errors.append(error)
        waited.append(work)
        one_done()

    with_future, without_future = [], []
    for work in works:
        try:
            future = work.get_future()
        except RuntimeError:  # point-to-point works have no future
            without_future.append(work)
            threading.Thread(target=wait_for, args=(work,), name=f"wait {what}", daemon=True).start()
            continue
        with_future.append(work)
        future.add_done_callback(one_done)
    if not works:
        finished.set()
    deadline = time.monotonic() + timeout
    while not finished.wait(_POLL_S):
        if abandon.is_set():
            for work in without_future:
                work.abort()
            if backend == "nccl":  # NCCL can cancel its kernels
                getattr(group, "abort", lambda: None)()
            raise MembershipChanged(f"{what} was abandoned: the members changed")
        if time.monotonic() > deadline:
            break
    if errors:
        raise errors[0]
    if len(waited) < len(without_future):
        raise RuntimeError(f"{what} did not complete within {timeout:g} s")
    return with_future

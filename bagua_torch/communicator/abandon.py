"""Waiting for ``torch.distributed`` works that a fault-tolerant job may abandon when its members change."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

from bagua_common.fault_tolerance.errors import MembershipChanged

__all__ = ["wait_or_abandon"]

_POLL_S = 0.05  # how often a wait looks whether its collective was abandoned


def wait_or_abandon(
    works: Sequence[Any], abandon: threading.Event, timeout: float, group: Any, backend: str, what: str
) -> None:
    """Return once every work of ``works`` (the collective ``what``) completed or failed (the caller's ``wait()``
    raises its error), or after ``timeout`` seconds (likewise); raise MembershipChanged once ``abandon`` is set. An
    abandoned work is left to its backend (gloo cannot cancel it) and its group is not used again; an NCCL ``group``
    is aborted (not run here: no GPU)."""
    deadline = time.monotonic() + timeout
    finished = threading.Event()
    left = [len(works)]
    lock = threading.Lock()

    def one_done(_future: Any) -> None:
        with lock:
            left[0] -= 1
            if left[0] <= 0:
                finished.set()

    polled = []
    for work in works:
        try:
            work.get_future().add_done_callback(one_done)
        except RuntimeError:  # some point-to-point works have no future: looked at in the loop
            polled.append(work)
            one_done(None)
    if not works:
        finished.set()
    while not (finished.wait(_POLL_S) and all(w.is_completed() for w in polled)):
        if abandon.is_set():
            if backend == "nccl":  # NCCL can cancel its kernels
                getattr(group, "abort", lambda: None)()
            raise MembershipChanged(f"{what} was abandoned: the members changed")
        if time.monotonic() > deadline:
            return

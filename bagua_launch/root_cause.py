"""Which rank a failed job's summary names when several ranks fail at nearly the same time.

A rank killed from outside (the OOM killer's SIGKILL, a user's ``kill``) makes its peers fail
in turn, a few milliseconds later, with an error about the lost peer (an exit code, or an abort:
some runtimes end a process whose peer vanished with SIGABRT). Which of those exits the launcher
notices first depends on how its threads (or the MPI wrappers) are scheduled, not on which rank
died first: on a loaded machine the peer's ``exit code 1`` can come first. So the launcher
waits :data:`SETTLE_S` after the first failure it notices, and names the first rank killed
from outside among those that failed by then, else the first noticed.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

__all__ = ["SETTLE_S", "killed_from_outside", "root_cause"]

SETTLE_S = 0.1
"""Seconds after the first failure noticed in which the other ranks' failures count as its possible cause."""

_CRASHES = frozenset(
    getattr(signal, name) for name in ("SIGABRT", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS")
)


def killed_from_outside(code: int | None) -> bool:
    """Whether a return code is a death by a signal another process sent (negative, not a crash's own
    signal), or None: a rank gone without an exit status (MPI), which only SIGKILL does."""
    return code is None or (code < 0 and -code not in _CRASHES)


def root_cause(failures: Sequence[tuple[int, int | None]]) -> tuple[int, int | None]:
    """The ``(rank, return code)`` to name among ranks that failed close together, in the order noticed.

    The first killed from outside: peers of a killed rank exit with an error or abort, nobody
    kills them for it. Without one, the first noticed.
    """
    if not failures:
        raise ValueError("root_cause: no failures to choose from")
    return next((failure for failure in failures if killed_from_outside(failure[1])), failures[0])

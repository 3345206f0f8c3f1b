"""Which rank a failed job's summary names when several ranks fail at nearly the same time.

A rank killed by a signal (the OOM killer, a user's ``kill``, a crash) makes its peers fail in
turn, a few milliseconds later, with an error about the lost peer. Which of those exits the
launcher notices first depends on how its threads (or the MPI wrappers) are scheduled, not on
which rank died first: on a loaded machine the peer's ``exit code 1`` can come first. So the
launcher waits :data:`SETTLE_S` after the first failure it notices, and names the first rank
killed by a signal among those that failed by then, else the first noticed.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SETTLE_S", "killed_by_signal", "root_cause"]

SETTLE_S = 0.1
"""Seconds after the first failure noticed in which the other ranks' failures count as its possible cause."""


def killed_by_signal(code: int | None) -> bool:
    """Whether a return code is a death by a signal (negative, or None: gone without an exit status)."""
    return code is None or code < 0


def root_cause(failures: Sequence[tuple[int, int | None]]) -> tuple[int, int | None]:
    """The ``(rank, return code)`` to name among ranks that failed close together, in the order noticed.

    The first killed by a signal: peers of a killed rank exit with an error, they are not killed
    for it. Without one, the first noticed.
    """
    if not failures:
        raise ValueError("root_cause: no failures to choose from")
    return next((failure for failure in failures if killed_by_signal(failure[1])), failures[0])

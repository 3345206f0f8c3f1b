"""Recoveries that change nothing: the same members failing the same transaction again and again.

A failure that loses nobody (a collective timed out on a member that is slow but alive) is retried by the same
members. When a member is slower than the collective timeout at every attempt, every retry fails the same way and
the job loops without training. :class:`ProgressWatch` counts such recoveries in a row on each member's monitor (every
member forms every epoch, so all count alike, whenever their training threads look) and stops the job, naming the
cause, at the third.
"""

from __future__ import annotations

from bagua_common.comm.timeout import ENV_VAR as TIMEOUT_ENV_VAR
from bagua_common.fault_tolerance.epoch import Epoch
from bagua_common.fault_tolerance.errors import NoProgress

__all__ = ["RETRIES_WITHOUT_PROGRESS", "ProgressWatch"]

RETRIES_WITHOUT_PROGRESS = 3
"""Recoveries in a row with the same members and no transaction committed that stop the job: one retry covers a
transient stall, a third failure of the same transaction means it cannot complete as it is."""


class ProgressWatch:
    """Counts the recoveries in a row that kept every member and committed nothing since the last one."""

    def __init__(self) -> None:
        self._in_a_row, self._committed = 0, -1

    def recovered(self, left: Epoch, new: Epoch, reason: str | None) -> None:
        """Count the recovery from ``left`` (closed by a failure, for ``reason``; None when it ended after a commit)
        to ``new``; raise :class:`~bagua_common.fault_tolerance.errors.NoProgress` at the
        :data:`RETRIES_WITHOUT_PROGRESS`-th in a row that kept the same members and committed nothing."""
        if reason is None or {m.id for m in new.members} != {m.id for m in left.members}:
            self._in_a_row = 0
            return
        self._in_a_row = self._in_a_row + 1 if new.committed == self._committed else 1
        self._committed = new.committed
        if self._in_a_row >= RETRIES_WITHOUT_PROGRESS:
            raise NoProgress(
                f"fault tolerance: transaction {new.committed + 1} failed {self._in_a_row} times in a row with the "
                f"same {new.size} members, none lost (the last time: {reason}). A collective that cannot complete "
                f"within the collective timeout fails the same way at every retry: raise {TIMEOUT_ENV_VAR} above "
                "the longest step (a slow link, a large model), or find the member that stalls; stopping rather "
                "than retrying forever"
            )

"""The epoch's decision register: which transactions committed, and whether the epoch is still open.

One key per epoch in the coordinator's store, changed only by compare-and-set, holds
``"T <state>"``: ``T`` is the last committed transaction and ``state`` is

* ``open``: transaction ``T + 1`` may commit;
* ``drain``: ``T + 1`` may commit, and the epoch then ends (a joiner waits to be admitted);
* ``wind``: ``T + 1`` may commit, and the register then turns to ``drain``: members that apply a
  transaction before its outcome is known (:meth:`~bagua_common.fault_tolerance.Membership.vote_ahead`)
  may be computing ``T + 2`` already when ``T + 1`` commits, so their epoch ends one transaction later;
* ``ended``: closed after a commit, nothing was lost (the next epoch admits the joiners);
* ``closed``: closed by a failure; no vote after ``T`` commits in this epoch (a transaction voted ahead and
  applied by a survivor still counts: the survivors' join records decide, see :mod:`.formation`).

Transaction ``t`` commits when its last vote turns ``"t-1 open"`` into ``"t open"`` (or
``"t-1 wind"`` into ``"t drain"``, ``"t-1 drain"`` into ``"t ended"``); closing turns any open
state into ``"T closed"``. Since both are compare-and-set on one key, every member reads the same outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from bagua_common.fault_tolerance.kv_store import StoreClient

__all__ = ["Decision", "commit_transaction"]

State = Literal["open", "wind", "drain", "ended", "closed"]
_STATES = ("open", "wind", "drain", "ended", "closed")
_AFTER_COMMIT: dict[str, State] = {"open": "open", "wind": "drain", "drain": "ended"}


@dataclass(frozen=True)
class Decision:
    """A value of the register: the last committed transaction and the epoch's state."""

    committed: int
    state: State = "open"

    def __post_init__(self) -> None:
        if self.state not in _STATES:
            raise ValueError(f"unknown decision state {self.state!r}")

    def encode(self) -> bytes:
        """The register's bytes."""
        return f"{self.committed} {self.state}".encode()

    @classmethod
    def decode(cls, raw: bytes | None) -> Decision:
        """The register read from the store (a ValueError for anything this module did not write)."""
        try:
            committed, state = (raw or b"").decode().split(" ")
            return cls(int(committed), state)  # type: ignore[arg-type]
        except (ValueError, UnicodeDecodeError):
            raise ValueError(f"not a decision register: {raw!r}") from None

    @property
    def final(self) -> bool:
        """Whether the epoch is over (no transaction commits in it any more)."""
        return self.state in ("ended", "closed")

    def after_last_vote(self, transaction: int) -> Decision | None:
        """The value committing ``transaction`` once all its votes are in; None if the epoch no longer allows it."""
        if self.final or transaction != self.committed + 1:
            return None
        return Decision(transaction, _AFTER_COMMIT[self.state])

    def closed(self) -> Decision:
        """This value with the epoch closed by a failure (unchanged if the epoch is already over)."""
        return self if self.final else Decision(self.committed, "closed")

    def draining(self, ahead: bool = False) -> Decision:
        """This value asking the epoch to end after its next commit, or after the one after it when the members
        vote ``ahead`` (unchanged unless open)."""
        return Decision(self.committed, "wind" if ahead else "drain") if self.state == "open" else self


def commit_transaction(store: StoreClient, key: str, transaction: int) -> Decision:
    """Turn the register at ``key`` from ``transaction - 1`` to ``transaction`` (the last vote is in) unless the
    epoch no longer allows it; return its value after. The first try expects it open, which it is unless the
    coordinator asked the epoch to drain or closed it: one round trip in steady state."""
    current = Decision(transaction - 1).encode()
    while True:
        desired = Decision.decode(current).after_last_vote(transaction)
        if desired is None:
            return Decision.decode(current)
        after = store.compare_set(key, current, desired.encode())
        if after == desired.encode():
            return desired
        current = after

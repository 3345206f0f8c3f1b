"""An epoch of a fault-tolerant job: its members in rank order, and its records in the coordinator's store.

Keys (see :mod:`bagua_common.fault_tolerance.membership`): ``ft/epoch/<E>`` the record of epoch ``E``,
``ft/after/<E>`` the number of the epoch formed after ``E`` (or ``noquorum``, or ``stateless``), ``ft/admit/<id>`` the
epoch that admits a joiner, and under ``ft/e<E>/`` the epoch's own keys: ``decision`` (the register of
:mod:`.decision`), ``votes/<t>``, ``done/<t>`` (the register's value once ``t`` is decided), ``closed``
(why it closed, and the suspects), ``hb/<id>`` (heartbeats) and the prefixes of its communicators.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from bagua_common.fault_tolerance.decision import Decision, commit_transaction
from bagua_common.fault_tolerance.errors import Evicted
from bagua_common.fault_tolerance.kv_store import StoreClient, StoreUnreachable

__all__ = ["Epoch", "Member", "Recovery", "close_epoch", "count_vote", "publish_epoch", "read_epoch"]


@dataclass(frozen=True)
class Member:
    """A member process: its unique ``id`` and the address of its store."""

    id: str
    host: str
    port: int

    def as_json(self) -> list[Any]:
        return [self.id, self.host, self.port]

    @classmethod
    def from_json(cls, value: Any) -> Member:
        member_id, host, port = value
        if not (isinstance(member_id, str) and isinstance(host, str) and isinstance(port, int)):
            raise ValueError(f"not a member record: {value!r}")
        return cls(member_id, host, port)


@dataclass(eq=False)
class Epoch:
    """One agreed membership: ``members`` in rank order (``members[0]`` coordinates), this process's ``rank``,
    ``committed`` (the last transaction committed when it formed), ``joined`` (the ids admitted by it, who need
    state), ``store`` (this epoch's client to the coordinator's store, for the training thread) and three events:
    ``closed`` (the epoch is over: its members move to the next one at their next boundary), set together with
    ``failed`` (a failure ended it: waits on its communicators give up) or ``ended`` (it ended after a commit, to
    admit joiners: its communicators keep working until the members move on)."""

    number: int
    members: tuple[Member, ...]
    rank: int
    committed: int
    joined: tuple[str, ...] = ()
    store: StoreClient | None = None
    closed: threading.Event = field(default_factory=threading.Event)
    failed: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)

    def mark_failed(self) -> None:
        """A failure ended the epoch: ``failed`` (before ``closed``, so that whoever wakes on it sees why)."""
        self.failed.set()
        self.closed.set()

    def mark_ended(self) -> None:
        """The epoch ended after a commit: ``ended``, then ``closed``."""
        self.ended.set()
        self.closed.set()

    def mark_decided(self, decision: Decision) -> None:
        """Where ``decision`` (the register's value, read after a vote) is final, mark the epoch so: ended after a
        commit, failed otherwise."""
        if decision.final:
            self.mark_ended() if decision.state == "ended" else self.mark_failed()

    @property
    def size(self) -> int:
        """The number of members."""
        return len(self.members)

    @property
    def coordinator(self) -> Member:
        """The member whose store holds the epoch's keys."""
        return self.members[0]

    def prefix(self, purpose: str = "") -> str:
        """The store prefix of this epoch's keys for ``purpose`` (a communicator's rendezvous, say)."""
        return f"ft/e{self.number}/{purpose}"

    def is_joiner(self, rank: int | None = None) -> bool:
        """Whether member ``rank`` (default this one) was admitted by this epoch and still needs the job's state."""
        return self.members[self.rank if rank is None else rank].id in self.joined

    def training_place(self, sitting_out: Collection[int] = ()) -> tuple[int, int]:
        """This member's place among the members that train the current step, and their number: every member but
        the ranks ``sitting_out`` (joiners sitting out their first DiLoCo round, which compute the step on the first
        trainer's samples, weighed zero: place 0)."""
        training = [rank for rank in range(self.size) if rank not in sitting_out]
        return (training.index(self.rank) if self.rank in training else 0), len(training)

    @property
    def state_holder(self) -> int:
        """The rank that gives the job's state to those that need it (:attr:`joined`): the first member that has
        it, which is not the coordinator when the coordinator survived a change behind the others."""
        return next(rank for rank, member in enumerate(self.members) if member.id not in self.joined)

    def record(self) -> bytes:
        return json.dumps(
            {
                "epoch": self.number,
                "members": [m.as_json() for m in self.members],
                "committed": self.committed,
                "joined": list(self.joined),
            }
        ).encode()

    @classmethod
    def from_record(cls, raw: bytes, me: str) -> Epoch:
        data = json.loads(raw)
        members = tuple(Member.from_json(m) for m in data["members"])
        ids = [m.id for m in members]
        if me not in ids:
            raise Evicted(
                f"the job formed epoch {data['epoch']} without this member ({me}); it was taken for dead and can "
                "only come back as a joiner"
            )
        return cls(int(data["epoch"]), members, ids.index(me), int(data["committed"]), tuple(data["joined"]))


@dataclass(frozen=True)
class Recovery:
    """The epoch formed after a change, and the last transaction the survivors committed (every member applies
    exactly the transactions up to it)."""

    epoch: Epoch
    committed: int


def publish_epoch(store: StoreClient, epoch: Epoch, after: Sequence[int]) -> None:
    """Write ``epoch``'s record and its open decision register, then tell the members leaving the epochs ``after``
    and the joiners it admits."""
    store.set(f"ft/epoch/{epoch.number}", epoch.record())
    store.set(f"{epoch.prefix()}decision", Decision(epoch.committed).encode())
    for number in after:
        store.set(f"ft/after/{number}", str(epoch.number))
    for member_id in epoch.joined:
        store.set(f"ft/admit/{member_id}", str(epoch.number))


def read_epoch(store: StoreClient, number: bytes, me: str) -> Epoch:
    """The epoch numbered ``number`` (as ``ft/after/<E>`` or ``ft/admit/<id>`` hold it) as member ``me`` sees it
    (:class:`~bagua_common.fault_tolerance.Evicted` if it was formed without ``me``)."""
    record = store.check(f"ft/epoch/{int(number)}")
    if record is None:
        raise StoreUnreachable(store.address, f"has no record of epoch {int(number)}")
    return Epoch.from_record(record, me)


ENDS_EPOCH = 1 << 40
"""Added to ``votes/<t>`` when the register turns to ``drain`` at ``t - 1`` (transaction ``t`` will end the epoch).
It is added by ``t - 1``'s last vote, before any member can vote for ``t``. Members voting ahead learn the end
of the epoch from their own vote's count, without reading the register."""


def count_vote(
    store: StoreClient, epoch: Epoch, transaction: int, waiters: bool = True
) -> tuple[bool, Decision | None, Decision]:
    """Count a member's vote for ``transaction`` in ``epoch``. Returns whether the transaction ends the epoch (see
    :data:`ENDS_EPOCH`), for the last vote the register's value after it (None for the others), and the register's
    value as the vote was counted (read in the same round trip). The last vote commits the transaction
    (:func:`commit_transaction`) and ends the epoch when the register asked for that. It publishes the register's
    value in ``done/<t>`` for the members waiting on it: always with ``waiters``, else only when the epoch is over
    (members voting ahead wait for nothing else)."""
    prefix = epoch.prefix()
    count, seen = store.add_and_check(f"{prefix}votes/{transaction}", 1, f"{prefix}decision")
    register = Decision.decode(seen)
    ends_epoch = count >= ENDS_EPOCH
    if count % ENDS_EPOCH != epoch.size:
        return ends_epoch, None, register
    decision = commit_transaction(store, f"{prefix}decision", transaction)
    if decision.committed == transaction and decision.state == "drain":
        store.add(f"{prefix}votes/{transaction + 1}", ENDS_EPOCH)
    if decision.committed == transaction and decision.final:
        mark_closed(store, epoch, {"reason": "ended", "suspects": []})
    if waiters or decision.final:
        store.set(f"{prefix}done/{transaction}", decision.encode())
    return ends_epoch, decision, register


def close_epoch(store: StoreClient, epoch: Epoch, closure: dict[str, Any]) -> None:
    """Close ``epoch``: the register to ``T closed`` (unless it is already over), then wake every waiter."""
    key = f"{epoch.prefix()}decision"
    while True:
        current = store.check(key)
        decision = Decision.decode(current)
        if decision.final or store.compare_set(key, current, decision.closed().encode()) == decision.closed().encode():
            break
    # The next transaction's voters wake to the register's final value: it did not commit.
    store.set(f"{epoch.prefix()}done/{decision.committed + 1}", decision.closed().encode())
    mark_closed(store, epoch, closure)


def mark_closed(store: StoreClient, epoch: Epoch, closure: dict[str, Any]) -> None:
    """Set ``epoch``'s ``closed`` key (the first reason stays), waking every member's monitor."""
    store.compare_set(f"{epoch.prefix()}closed", b"", json.dumps(closure))


def leave_epoch(store: StoreClient, epoch: Epoch, me: str, patience: float, period: float) -> None:
    """Say in ``epoch``'s store that member ``me`` leaves it on purpose (not a failure). Its coordinator (rank 0) waits
    up to ``patience`` seconds, looking every ``period``, for the others to leave first: its store, which they read,
    must outlive their reading it. A store gone meanwhile ends the wait."""
    try:
        store.set(f"{epoch.prefix()}left/{me}", b"")
        others = [f"{epoch.prefix()}left/{m.id}" for m in epoch.members if m.id != me]
        deadline = time.monotonic() + patience
        while epoch.rank == 0 and time.monotonic() < deadline:
            if all(store.check(key) is not None for key in others):
                return
            time.sleep(period)
    except StoreUnreachable:
        pass

"""Forming the next epoch after a change: the survivors gather at the first member whose store answers.

Each survivor writes a join record (``ft/join/<id>``: its address, the epoch it leaves, the last
transaction it applied) at the candidate coordinator, the first member of the leaving epoch, in
order and skipping the suspects, whose store answers. The candidate, when it is this member,
waits for the survivors (not for suspects, dead or silent members, nor longer than
``dead_after``), checks the quorum (more than half of the leaving epoch's members not confirmed
dead), and publishes the epoch: the survivors in their order, then the joiners whose requests
wait in its store, ``committed`` the largest the survivors applied. A survivor that applied less (its
collectives failed where another's completed, the step being voted ahead) is listed with the joiners: it gets
the job's state from the first member that has it (:attr:`Epoch.state_holder`); one a single step behind whose
replica is its own (voting one ahead: decentralized averaging) is not, and trains that step itself. A record
counts only while its writer still waits at that candidate, as the writer's own store says (``ft/waiting-at``): a
candidate too slow for the others' patience finds they left, and the quorum stays a majority of members waiting at
one place.
"""

from __future__ import annotations

import json
import threading
import time
from contextlib import closing
from typing import Any

from bagua_common.fault_tolerance.epoch import Epoch, Member, publish_epoch, read_epoch
from bagua_common.fault_tolerance.errors import Evicted, NoQuorum
from bagua_common.fault_tolerance.kv_store import KVClient, StoreClient, StoreUnreachable, wait_for
from bagua_common.fault_tolerance.node_directory import CURRENT
from bagua_common.fault_tolerance.settings import FaultToleranceSettings

__all__ = ["Formation", "probe", "process_ended"]

WAITING_AT = "ft/waiting-at"
"""Key in a member's own store: the candidate it last wrote its join record at, and the epoch it was leaving."""

_PROBE_SECONDS = 1.0
"""The longest a probe waits for a member's store to answer (a hung store looks like a lost one)."""
_ENDING_SECONDS = 0.5
"""How long :func:`process_ended` probes again a store that dropped the connection: a process being killed closes
its connections before its store's listener, which meanwhile still completes new connections and drops them."""


class Formation:
    """How member ``me`` (whose own store ``local`` reaches) forms epochs with the others; ``stopping`` ends it,
    ``gone`` holds the members whose process ended."""

    def __init__(
        self,
        settings: FaultToleranceSettings,
        me: Member,
        local: StoreClient,
        stopping: threading.Event,
        gone: set[str],
    ):
        self.settings, self.me, self._local, self._stopping = settings, me, local, stopping
        self._gone = gone  # members whose process ended (their connections to this member's store closed)
        self._requests_seen = 0
        self._unwritten: dict[int, float] = {}  # requests counted, not yet written: when first seen so

    def requests_waiting(self, store: StoreClient) -> bool:
        """Whether joiners asked to be admitted since the last epoch this member formed (``store``: its own)."""
        return int(store.check("ft/requests") or b"0") > self._requests_seen

    def form_next(self, leaving: Epoch, suspects: set[str], record: dict[str, Any]) -> Epoch:
        """Join the survivors of ``leaving`` at the first member whose store answers, and return the epoch formed
        there (coordinating the formation when that member is this one)."""
        while not self._stopping.is_set():
            candidate, client = self._first_answering(leaving, suspects)
            try:
                self._local.set(WAITING_AT, json.dumps({"member": candidate.id, "leaving": leaving.number}))
                client.set(f"ft/join/{self.me.id}", json.dumps(record))
                if candidate == self.me:
                    self._gather(client, leaving, suspects)
                raw = wait_for(
                    client, f"ft/after/{leaving.number}", self.settings.quorum_timeout + 2 * self.settings.dead_after
                )
                if raw == b"noquorum":
                    raise NoQuorum(
                        f"fault tolerance: the members reachable at {candidate.id} are not a majority of epoch "
                        f"{leaving.number}'s {leaving.size} members that may be alive; stopping rather than splitting "
                        "the job"
                    )
                if raw == b"stateless":
                    raise NoQuorum(
                        f"fault tolerance: none of epoch {leaving.number}'s members reachable at {candidate.id} holds "
                        "the job's state (they joined and were still to be given it, and every member that had it is "
                        "gone or finished); stopping rather than training from scratch"
                    )
                return read_epoch(client, raw, self.me.id)
            except (StoreUnreachable, TimeoutError):
                suspects.add(candidate.id)
            finally:
                if client is not self._local:
                    client.close()
        raise Evicted("fault tolerance: this member is closing")

    def _first_answering(self, leaving: Epoch, suspects: set[str]) -> tuple[Member, StoreClient]:
        for member in leaving.members:
            if member == self.me:
                return member, self._local
            if member.id in suspects:
                continue
            try:
                client = KVClient(member.host, member.port, _PROBE_SECONDS, secret=self.settings.secret)
                client.ping()
                client.timeout = self.settings.dead_after
                return member, client
            except StoreUnreachable:
                suspects.add(member.id)
        raise Evicted(f"fault tolerance: this member ({self.me.id}) was not a member of epoch {leaving.number}")

    def _gather(self, store: StoreClient, leaving: Epoch, suspects: set[str]) -> None:
        """As the new coordinator: wait for the survivors' join records, check the quorum, publish the epoch.

        A member of ``leaving`` is waited for until it joins, unless it is a suspect (the closure named it),
        its store refuses connections (dead), does not answer (hung or cut off), or ``dead_after`` passed.
        The quorum: more than half of ``leaving``'s members not confirmed dead.
        """
        start, period = time.monotonic(), self.settings.heartbeat_period
        joined: dict[str, dict[str, Any]] = {self.me.id: _json(store.check(f"ft/join/{self.me.id}"))}
        others = {m.id: m for m in leaving.members if m != self.me}
        dead: set[str] = set()
        probed: dict[str, tuple[str, float]] = {}

        def state(member_id: str) -> str:
            seen, when = probed.get(member_id, ("", -period))
            if time.monotonic() - when >= period:
                seen, current = probe(others[member_id], self.settings.secret)
                if current is not None and current > leaving.number:  # they went on without this member
                    raise Evicted(
                        f"fault tolerance: the job formed epoch {current} without this member ({self.me.id}); it was "
                        "taken for dead and can only come back as a joiner"
                    )
                when = time.monotonic()
                probed[member_id] = (seen, when)
            return seen

        while True:
            dead |= self._gone & set(others)
            for member_id in dead & set(joined):  # joined, then its process ended
                del joined[member_id]
            for member_id in set(others) - set(joined) - dead:
                join = _json(store.check(f"ft/join/{member_id}"))
                if join is not None and join["last_epoch"] >= leaving.number:
                    joined[member_id] = join
            elapsed = time.monotonic() - start
            missing = set(others) - set(joined) - dead
            waiting = {
                m for m in missing if m not in suspects and elapsed < self.settings.dead_after and state(m) == "alive"
            }
            dead |= {m for m in missing - waiting if probed.get(m, ("",))[0] == "refused"}
            if not waiting:
                if 2 * len(joined) <= leaving.size - len(dead):
                    dead |= {m for m in missing - dead if state(m) == "refused"}  # the quorum needs to know: look
                if 2 * len(joined) > leaving.size - len(dead):
                    moved = self._gone_elsewhere(others, joined, leaving)
                    if not moved:
                        break
                    for member_id in moved:
                        del joined[member_id]
                        store.delete(f"ft/join/{member_id}")
                    continue
                if elapsed > self.settings.quorum_timeout:
                    store.set(f"ft/after/{leaving.number}", b"noquorum")
                    return
            time.sleep(0.005 if waiting else period)
        members = [m for m in leaving.members if m.id in joined]
        committed = max(int(j["committed"]) for j in joined.values())
        if committed < leaving.committed:  # only members still waiting to be given the state are left
            store.set(f"ft/after/{leaving.number}", b"stateless")
            return
        joiners = self._admissible_requests(store, {m.id for m in members})
        # A survivor behind the others (a joiner whose state never arrived) gets the state like a joiner; one that
        # voted for the last commit but never saw it applies it (its vote was counted) and is not behind; one voting
        # one ahead a step behind trains that step itself (its replica is its own, not the others').
        behind = [m for m in members if _behind(joined[m.id], committed)]
        epoch = Epoch(
            max(int(j["last_epoch"]) for j in joined.values()) + 1,
            tuple(members + joiners),
            0,
            committed,
            tuple(m.id for m in behind + joiners),
        )
        publish_epoch(store, epoch, after=sorted({int(j["last_epoch"]) for j in joined.values()}))
        for member_id in joined:
            store.delete(f"ft/join/{member_id}")

    def _gone_elsewhere(self, others: dict[str, Member], joined: dict[str, Any], leaving: Epoch) -> list[str]:
        """The members whose join records here are stale: each one's own store says it now waits at another member
        (it gave up on this one, starved or cut off, past its patience) or has ended. A record counts only while its
        writer waits here, so that two candidates never both count a member, and two majorities cannot form. One
        that went on to an epoch formed elsewhere formed it without this member: this member is evicted."""
        moved = []
        for member_id in set(joined) - {self.me.id}:
            here = {"member": self.me.id, "leaving": int(joined[member_id]["last_epoch"])}
            try:
                waiting_at, current = _read_own(others[member_id], self.settings.secret, WAITING_AT, CURRENT)
            except StoreUnreachable as error:
                if error.refused:  # ended: gone from every candidate
                    moved.append(member_id)
                continue  # silent (hung, or too loaded to answer): counted, as a member that joined and hung is
            if waiting_at != here:
                if current is not None and int(current["epoch"]) > here["leaving"]:
                    raise Evicted(
                        f"fault tolerance: the job formed epoch {current['epoch']} without this member ({self.me.id}) "
                        "while it was too slow to coordinate; it can only come back as a joiner"
                    )
                moved.append(member_id)
        return moved

    def _admissible_requests(self, store: StoreClient, members: set[str]) -> list[Member]:
        """The joiners that asked since the last formation, in the order they asked. A request counted but not yet
        written (its joiner is between the two calls) ends the list: it and those after it wait for the next
        formation (the count stays ahead, so the coordinator drains again), unless it stays unwritten for
        ``dead_after`` (its joiner died there)."""
        count = int(store.check("ft/requests") or b"0")
        joiners, index = [], self._requests_seen
        while index < count:
            raw = store.check(f"ft/request/{index + 1}")
            if raw is None:
                first_seen = self._unwritten.setdefault(index + 1, time.monotonic())
                if time.monotonic() - first_seen < self.settings.dead_after:
                    break
            else:
                try:
                    member = Member.from_json(json.loads(raw))
                    if member.id not in members:
                        joiners.append(member)
                except (ValueError, TypeError):
                    pass
            index += 1
        self._requests_seen = index
        return joiners


def _behind(record: dict[str, Any], committed: int) -> bool:
    """Whether the survivor of join record ``record`` needs another's state to reach ``committed``."""
    applied = max(int(record["committed"]), int(record["voted"] or 0))
    return applied < committed and not (record["catches_up"] and applied == committed - 1)


def probe(member: Member, secret: bytes) -> tuple[str, int | None]:
    """``"alive"``, ``"refused"`` (nothing listens: its process is gone) or ``"silent"`` (hung or cut off), and the
    epoch the member is in (None unless alive); ``secret`` is the job's."""
    try:
        (current,) = _read_own(member, secret, CURRENT)
        return "alive", None if current is None else int(current["epoch"])
    except StoreUnreachable as error:
        return ("refused" if error.refused else "silent"), None


def process_ended(member: Member, secret: bytes) -> bool:
    """Whether ``member``'s process ended (its store refuses connections), asked when its connection to this
    member's store closed: a store that neither answers nor refuses is probed again for :data:`_ENDING_SECONDS`
    (a process being killed), then taken for alive (stopped, or cut off: its heartbeats decide)."""
    deadline = time.monotonic() + _ENDING_SECONDS
    while True:
        seen, _ = probe(member, secret)
        if seen != "silent" or time.monotonic() >= deadline:
            return seen == "refused"
        time.sleep(0.02)


def _read_own(member: Member, secret: bytes, *keys: str) -> list[Any]:
    """``keys`` (JSON, None where unset) from ``member``'s own store, waiting at most :data:`_PROBE_SECONDS` for it."""
    with closing(KVClient(member.host, member.port, _PROBE_SECONDS, secret=secret)) as client:
        return [_json(client.check(key)) for key in keys]


def _json(raw: bytes | None) -> Any:
    return None if raw is None else json.loads(raw)

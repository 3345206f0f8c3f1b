"""Who the members of a fault-tolerant job are: epochs, heartbeats, commit by agreement, recovery, joining.

The protocol is described in ``docs/guides/fault_tolerance.md`` (and, for developers, in the design notes): every
member hosts a :class:`~bagua_common.fault_tolerance.kv_store.KVServer`; an *epoch* is an agreed, ordered member
list whose first member is its *coordinator* and holds the epoch's keys (``ft/e<E>/...``: the decision register,
votes, heartbeats, the communicators' rendezvous). A *transaction* (a step, an outer exchange) commits when the last
of its votes turns the register from ``T`` to ``T+1`` (:mod:`.decision`); closing the epoch turns it to
``T closed``; both are compare-and-set, so every member sees the same outcome. A per-step transaction is voted
*ahead* (:meth:`Membership.vote_ahead`): applied as soon as this member's collectives completed, without waiting
for the last vote, so no member waits for the slowest one's collectives every step; after a failure, the
survivors that had not applied it get the state of one that had. Where the replicas differ (decentralized
averaging, whose exchange completes with one peer), a step is voted *one ahead* (:meth:`Membership.vote_one_ahead`):
applied once the step before it committed, so the survivors are at most one step apart, and one behind trains that
step itself.

Each member runs one monitor thread: it waits on the epoch's ``closed`` key (a blocking get,
woken at once by a closure), sends heartbeats, and on the coordinator also watches the others'
heartbeats and the joiners' requests. A member whose connection to the coordinator's store
drops is gone at once (its process ended); one whose heartbeats stop for ``dead_after`` is
taken for gone. On a closure the monitor forms the next epoch with the survivors at the first
member whose store answers (so the coordinator's role moves when the coordinator dies); the
training thread only waits for it (:meth:`Membership.recover`).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from contextlib import closing
from typing import Any

from bagua_common.comm.engine_exit import exiting_on_uncaught_exception
from bagua_common.fault_tolerance import node_directory
from bagua_common.fault_tolerance.admission import await_admission, stores_to_ask
from bagua_common.fault_tolerance.decision import Decision
from bagua_common.fault_tolerance.epoch import (
    Epoch,
    Member,
    Recovery,
    close_epoch,
    leave_epoch,
    publish_epoch,
    read_epoch,
)
from bagua_common.fault_tolerance.errors import Evicted, NoProgress, NoQuorum
from bagua_common.fault_tolerance.formation import Formation, process_ended
from bagua_common.fault_tolerance.kv_store import (
    KVServer,
    StoreClient,
    StoreUnreachable,
    advertised_host,
    connect,
    wait_for,
)
from bagua_common.fault_tolerance.progress import ProgressWatch
from bagua_common.fault_tolerance.settings import FaultToleranceSettings
from bagua_common.fault_tolerance.voting import Voting

__all__ = ["Membership"]


class Membership(Voting):
    """This process's membership of a fault-tolerant job (see the module docstring).

    Build it with :meth:`start` (the launcher's ranks, together) or :meth:`join` (a process joining a
    running job). The training thread reads :attr:`epoch`, votes with :meth:`commit`, reports a failed
    collective with :meth:`fail` and, after a change, takes the next epoch from :meth:`recover`.
    """

    def __init__(self, settings: FaultToleranceSettings, host: str, port: int = 0):
        self.settings = settings
        self._server = KVServer(host, port, on_disconnect=self._member_disconnected, secret=settings.secret)
        self.me = Member(f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}", host, self._server.port)
        self._local = self._server.in_process_client()
        self._lock = threading.Condition()
        self._epoch: Epoch | None = None  # the monitor's current epoch (the training thread keeps its own)
        self._failure: BaseException | None = None  # NoQuorum, Evicted or NoProgress, raised by recover()
        self._progress = ProgressWatch()  # recoveries that change nothing
        self._committed = 0  # the last transaction this member applied (for the join records)
        self._voted: int | None = None  # a transaction voted for and not yet decided
        self._recorded = -1  # the last epoch this member's join record left: nothing is applied in it any more
        # Whether the members apply a transaction before its outcome (vote_ahead: the epoch drains a transaction
        # later) or wait for it (commit); unknown until this member's first vote, and no joiner is admitted before.
        self.votes_ahead: bool | None = None
        self.catches_up = False
        """Set by the front end voting one ahead (:meth:`vote_one_ahead`) while this member, one transaction behind
        the others at a change, can take that transaction by itself from its own state (from a step's start, or its
        gradients, until its vote applies it); else it is given another's."""
        self._recovering = 0  # training-thread calls waiting in recover()
        self._older: list[Epoch] = []  # epochs that ended after a commit, whose groups may still be in use
        self._heartbeats: dict[str, tuple[int, float, int]] = {}
        self._stopping = threading.Event()
        self._gone: set[str] = set()  # members whose connections to this member's store all closed
        self._formation = Formation(settings, self.me, self._local, self._stopping, self._gone)
        self._monitor_client: StoreClient | None = None
        self._monitor: threading.Thread | None = None
        atexit.register(self._abandon_on_uncaught_exception)

    # --- starting ----------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        settings: FaultToleranceSettings,
        rank: int,
        world_size: int,
        master_addr: str,
        master_port: int,
        timeout: float = 300.0,
    ) -> Membership:
        """Form epoch 0 from the launcher's ``world_size`` ranks (every rank calls it; rank 0's store listens on
        ``master_addr:master_port``, where the others register within ``timeout`` seconds)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"fault tolerance: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        self = cls(settings, advertised_host(master_addr), master_port if rank == 0 else 0)
        try:
            coordinator = (
                self._local if rank == 0 else connect(master_addr, master_port, timeout, secret=settings.secret)
            )
            coordinator.set(f"ft/start/{rank}", json.dumps(self.me.as_json()))
            if rank == 0:
                members = []
                for r in range(world_size):
                    raw = coordinator.get(f"ft/start/{r}", wait=timeout)
                    if raw is None:
                        raise TimeoutError(f"fault tolerance: rank {r} did not register within {timeout:g} s")
                    members.append(Member.from_json(json.loads(raw)))
                epoch = Epoch(0, tuple(members), 0, 0)
                publish_epoch(coordinator, epoch, after=[-1])
            raw = wait_for(coordinator, "ft/after/-1", timeout)
            epoch = read_epoch(coordinator, raw, self.me.id)
            if rank:
                coordinator.close()
        except BaseException:
            self.close()
            raise
        self._adopt(epoch)
        return self

    @classmethod
    def join(
        cls,
        settings: FaultToleranceSettings,
        master_addr: str,
        master_port: int,
        peers: Sequence[str] | None = None,
        timeout: float = 300.0,
    ) -> Membership:
        """Join a running job: ask a live member's store (``master_addr:master_port``, then ``peers``, default
        ``BAGUA_FT_PEERS``) where the job's coordinator is, request admission there and wait (up to ``timeout``
        seconds, asking again when the coordinator changes) for the epoch that admits this process. The returned
        membership's epoch lists this process in :attr:`Epoch.joined`: it needs the job's state from a member.
        Raises :class:`~bagua_common.fault_tolerance.errors.JobFinished` (exit status 0) when a store asked says the
        job has finished."""
        self = cls(settings, advertised_host(master_addr))
        try:
            epoch = await_admission(settings, self.me, stores_to_ask(master_addr, master_port, peers), timeout)
        except BaseException:
            self.close()
            raise
        self._adopt(epoch)
        node_directory.tell_admitted(settings)
        return self

    # --- the training thread's side ------------------------------------------------------

    @property
    def epoch(self) -> Epoch:
        """The latest epoch the monitor knows (the training thread uses the one :meth:`recover` gave it)."""
        assert self._epoch is not None
        return self._epoch

    def fail(self, epoch: Epoch, reason: str) -> None:
        """Close ``epoch`` because something failed on this member (a collective raised, a peer hung)."""
        epoch.mark_failed()
        try:
            assert epoch.store is not None
            close_epoch(epoch.store, epoch, {"reason": f"{self.me.id}: {reason}", "suspects": []})
        except StoreUnreachable:
            pass  # the coordinator is gone: the monitor sees it too

    def recover(self, after: Epoch, timeout: float | None = None) -> Recovery:
        """Wait for the epoch after ``after`` and return it (raises :class:`NoQuorum` or :class:`Evicted` when
        the monitor could not form one with this member)."""
        limit = self.settings.quorum_timeout + 4 * self.settings.dead_after if timeout is None else timeout
        deadline = time.monotonic() + limit
        with self._lock:
            self._recovering += 1
            self._lock.notify_all()
            try:
                while self._failure is None and self._epoch is not None and self._epoch.number <= after.number:
                    if not self._lock.wait(timeout=max(0.0, deadline - time.monotonic())):
                        raise TimeoutError(f"fault tolerance: no epoch after {after.number} within {limit:g} s")
            finally:
                self._recovering -= 1
            if self._failure is not None:
                raise self._failure
            assert self._epoch is not None
            epoch = self._epoch
        if after.store is not None:
            after.store.close()  # the training thread is done with the old epoch
        return Recovery(epoch, epoch.committed)

    def applied(self, transaction: int) -> None:
        """Record that this member applied ``transaction`` by other means (a joiner given the state at it)."""
        with self._lock:
            self._committed = transaction

    # --- the monitor ---------------------------------------------------------------------

    def _adopt(self, epoch: Epoch) -> None:
        """Make ``epoch`` current: a training client to its coordinator, the pointer in this member's store, and
        the monitor (started on the first epoch)."""
        epoch.store = self._client_of(epoch.coordinator)
        if self._stopping.is_set():
            epoch.store.close()
            return
        host, port = epoch.coordinator.host, epoch.coordinator.port
        pointer = json.dumps({"epoch": epoch.number, "size": epoch.size, "host": host, "port": port})
        self._local.set(node_directory.CURRENT, pointer)
        node_directory.tell(self.settings, node_directory.CURRENT, pointer)
        with self._lock:
            self._epoch = epoch
            if not epoch.is_joiner():  # a joiner has applied nothing until it is given the state
                self._committed = max(self._committed, epoch.committed)
            self._heartbeats = {}
            self._lock.notify_all()
        self._close_for_the_gone()  # a member lost while this epoch formed
        if self._monitor is None:
            self._monitor = threading.Thread(target=self._watch, name="bagua-ft-monitor", daemon=True)
            self._monitor.start()

    def _client_of(self, member: Member, registered: bool = False) -> StoreClient:
        """A client to ``member``'s store: in-process when it is this member's own (the coordinator reads and writes
        its store at every heartbeat and vote); ``registered``, a connection whose closing tells the other end that
        this member is gone."""
        if member.id == self.me.id:
            return self._server.in_process_client()
        settings = self.settings
        who = self.me.id if registered else None
        return connect(member.host, member.port, settings.dead_after, who, secret=settings.secret)

    def _watch(self) -> None:
        period = self.settings.heartbeat_period
        while not self._stopping.is_set():
            epoch = self.epoch
            suspects: list[str] = []
            ended, why = False, ""
            previous, client = self._monitor_client, None
            try:
                # Registered before the last epoch's connection closes: a member is gone when its last one does.
                client = self._monitor_client = self._client_of(epoch.coordinator, registered=True)
                if previous is not None:
                    previous.close()
                prefix = epoch.prefix()
                while not self._stopping.is_set():
                    closure = client.get(f"{prefix}closed", wait=period)
                    if closure is not None:
                        closure = json.loads(closure)
                        suspects, why = list(closure.get("suspects", [])), str(closure.get("reason", ""))
                        ended = why == "ended"
                        break
                    client.add(f"{prefix}hb/{self.me.id}", 1)
                    if epoch.rank == 0:
                        self._coordinate(client, epoch)
            except StoreUnreachable:
                suspects, why = [epoch.coordinator.id], f"{epoch.coordinator.id}'s store is unreachable"
            if self._stopping.is_set():
                if client is not None:  # connected after close() closed the monitor's client
                    client.close()
                return
            if ended:  # after a commit: the epoch's communicators stay usable until its members move on
                epoch.mark_ended()
            else:  # a failure: waits in this epoch and in any older one still in use give up
                for older in [*self._older, epoch]:
                    older.mark_failed()
                self._older = []
            self._older.append(epoch)
            try:
                formed = self._formation.form_next(epoch, set(suspects) - {self.me.id}, self._join_record(epoch))
                self._progress.recovered(epoch, formed, None if ended else why)  # every member counts every epoch
            except (NoQuorum, Evicted, NoProgress) as failure:
                if isinstance(failure, NoProgress):  # all stop: the others read the epoch before its coordinator ends
                    node_directory.tell(self.settings, node_directory.STOPPED, type(failure).__name__)  # no replacing
                    with contextlib.suppress(StoreUnreachable), closing(self._client_of(formed.coordinator)) as store:
                        leave_epoch(store, formed, self.me.id, self.settings.dead_after, self.settings.heartbeat_period)
                with self._lock:
                    self._failure = failure
                    self._lock.notify_all()
                return
            self._adopt(formed)

    def _coordinate(self, client: StoreClient, epoch: Epoch) -> None:
        """The coordinator's duties each heartbeat: close the epoch when a member's heartbeats stopped, and ask it
        to end after its next commit when a joiner waits."""
        now, prefix, stale = time.monotonic(), epoch.prefix(), []
        # Stale: no new heartbeat for dead_after, over as many of this monitor's own looks as fit in it (a monitor
        # starved by a loaded machine looks less often and waits longer rather than blaming the others).
        looks = self.settings.dead_after / self.settings.heartbeat_period
        for member in (m for m in epoch.members[1:] if not self._left(epoch, m.id)):
            count = int(client.check(f"{prefix}hb/{member.id}") or b"0")
            last, since, seen = self._heartbeats.get(member.id, (-1, now, 0))
            if count != last:
                self._heartbeats[member.id] = (count, now, 0)
            elif now - since > self.settings.dead_after and seen >= looks:
                stale.append(member.id)
            else:
                self._heartbeats[member.id] = (count, since, seen + 1)
        if stale:
            why = f"no heartbeat for {self.settings.dead_after:g} s"
            close_epoch(client, epoch, {"reason": why, "suspects": stale})
            return
        if self.votes_ahead is not None and self._formation.requests_waiting(client):
            current = client.check(f"{prefix}decision")
            draining = Decision.decode(current).draining(self.votes_ahead)
            client.compare_set(f"{prefix}decision", current, draining.encode())

    def _member_disconnected(self, member_id: str) -> None:
        """The store's report that a member's last registered connection closed. If its store refuses connections
        too, its process ended: remember it, and as the coordinator close the epoch it is in (one formed meanwhile
        is closed when adopted). A member whose store answers only gave up on this one (this process was stopped)."""
        epoch = self._epoch
        member = next((m for m in epoch.members if m.id == member_id), None) if epoch is not None else None
        if member is None or self._left(epoch, member_id) or not process_ended(member, self.settings.secret):
            return
        self._gone.add(member_id)
        self._close_for_the_gone()

    def _left(self, epoch: Epoch, member_id: str) -> bool:
        """Whether ``member_id`` left ``epoch`` on purpose (:meth:`close`), as this member's store says."""
        try:
            return self._local.check(f"{epoch.prefix()}left/{member_id}") is not None
        except StoreUnreachable:
            return False

    def _close_for_the_gone(self) -> None:
        epoch = self._epoch
        if epoch is None or self._stopping.is_set() or epoch.rank != 0:
            return
        gone = sorted(self._gone & {m.id for m in epoch.members})
        if gone:
            try:
                close_epoch(self._local, epoch, {"reason": f"{', '.join(gone)} disconnected", "suspects": gone})
            except StoreUnreachable:
                pass

    def _join_record(self, leaving: Epoch) -> dict[str, Any]:
        """This member's join record for the epoch after ``leaving``: a vote in flight is decided within a round
        trip once the epoch closed (or the training thread waits for the next epoch), so its outcome is in."""
        with self._lock:
            self._lock.wait_for(lambda: self._voted is None or self._recovering, timeout=self.settings.dead_after)
            self._recorded = leaving.number
            return {
                "member": self.me.as_json(),
                "last_epoch": leaving.number,
                "committed": self._committed,
                "voted": self._voted,
                "catches_up": self.catches_up,
            }

    # --- ending ---------------------------------------------------------------------------

    def finished(self) -> None:
        """Record that the job's last transaction committed (called by every member as its loop ends): a process
        asking to join from now on, at this member's store or this node's launcher, exits with ``JobFinished``
        instead of waiting to be admitted, and the launcher starts no replacement for a rank that ends."""
        with self._lock:
            committed = str(self._committed)
        self._local.set(node_directory.FINISHED, committed)
        node_directory.tell(self.settings, node_directory.FINISHED, committed)

    def close(self) -> None:
        """Leave the job: say so in the coordinator's store (a member that left is not a failure), stop the monitor
        and the store. The coordinator waits up to ``dead_after`` for the others to leave first, so that members
        ending together do not take each other's departure for a failure. A member the others went on without
        (:meth:`recover` raised) has no epoch to leave."""
        atexit.unregister(self._abandon_on_uncaught_exception)
        epoch = self._epoch
        if epoch is not None and epoch.store is not None and not self._stopping.is_set() and self._failure is None:
            leave_epoch(epoch.store, epoch, self.me.id, self.settings.dead_after, self.settings.heartbeat_period)
        self._stop()

    def _abandon_on_uncaught_exception(self) -> None:
        """At exit, where an exception ended the program: stop without leaving, as its death would, so that the
        others go on now, not once the interpreter and the runtimes have shut down."""
        if exiting_on_uncaught_exception():
            self._stop()

    def _stop(self) -> None:
        """Close this member's connections and store (gone to the others, unless it left); let its monitor end."""
        self._stopping.set()
        for client in (self._monitor_client, self._local, self._epoch.store if self._epoch else None):
            if client is not None:
                client.close()
        self._server.close()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(timeout=self.settings.dead_after)

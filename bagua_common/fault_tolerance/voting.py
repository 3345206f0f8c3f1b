"""How a member votes for a transaction, and learns whether it committed (:class:`Voting`, the part of
:class:`~bagua_common.fault_tolerance.Membership` the training thread calls once per step or DiLoCo exchange).

Three ways, by what a member's completed collectives show (``docs/guides/fault_tolerance.md``, "How a step commits"):
:meth:`Voting.commit` waits for every vote; :meth:`Voting.vote_ahead` applies at once (every collective spans all
ranks, so every rank contributed); :meth:`Voting.vote_one_ahead` applies once the transaction before had every vote
(a decentralized exchange completes with one peer), so that the survivors of a change are at most one apart.
"""

from __future__ import annotations

import threading
import time

from bagua_common.fault_tolerance.decision import Decision
from bagua_common.fault_tolerance.epoch import Epoch, count_vote
from bagua_common.fault_tolerance.kv_store import StoreUnreachable

__all__ = ["Voting"]


class Voting:
    """The votes, mixed into :class:`~bagua_common.fault_tolerance.Membership`, whose state it reads and sets
    (``_lock``, ``_voted``, ``_committed``, ``_recorded``, ``_failure``, :attr:`votes_ahead`, ``settings``) and
    whose :meth:`recover` it calls when the coordinator is gone."""

    _lock: threading.Condition
    _voted: int | None
    _committed: int
    _recorded: int
    _failure: BaseException | None
    votes_ahead: bool | None

    def commit(self, epoch: Epoch, transaction: int) -> bool:
        """Vote for ``transaction`` (the next one: ``committed + 1``) in ``epoch`` once this member's collectives
        for it completed, and return whether it committed: True, apply it; False, abandon it (the epoch closed
        first) and take the next epoch from :meth:`recover`. When the coordinator's store is gone before the
        outcome is known, waits for the next epoch, whose agreed ``committed`` decides. Raises what :meth:`recover`
        would when the monitor finds the job gone on without this member (stopped past ``dead_after``)."""
        assert epoch.store is not None
        with self._lock:
            self._voted, self.votes_ahead = transaction, False
        try:
            decision = count_vote(epoch.store, epoch, transaction)[1] or self._outcome(epoch, transaction)
            committed = decision.committed >= transaction
            epoch.mark_decided(decision)
        except StoreUnreachable:
            committed = self.recover(epoch).committed >= transaction
        return self._decided(transaction, committed)

    def vote_ahead(self, epoch: Epoch, transaction: int) -> bool:
        """Vote for ``transaction`` once this member's collectives for it completed, and apply it without waiting
        for the others' votes (a per-step transaction: a step applied by any survivor counts, and the survivors
        that did not apply it get the state of one that did at the recovery, see :class:`Formation`). Returns
        True, apply it; False only when this member's record for the next epoch went out without it (abandon it
        then, and take the next epoch from :meth:`recover`). Waits for the outcome only when the transaction ends
        the epoch (to admit a joiner)."""
        assert epoch.store is not None
        with self._lock:
            self.votes_ahead = True
            if self._recorded >= epoch.number:
                return False
            self._committed = max(self._committed, transaction)
        try:
            ends_epoch, decision, _ = count_vote(epoch.store, epoch, transaction, waiters=False)
            if decision is None and ends_epoch:
                decision = self._outcome(epoch, transaction)
            if decision is not None:
                epoch.mark_decided(decision)
        except StoreUnreachable:
            pass  # the coordinator is gone: the monitor closes the epoch, and the survivors' records decide
        return True

    def vote_one_ahead(self, epoch: Epoch, transaction: int) -> bool:
        """Vote for ``transaction`` once this member's collectives for it completed, and apply it once the transaction
        before it committed (every member voted for it), without waiting for this one's other votes. For steps whose
        collectives complete without showing that every member contributed (a decentralized exchange completes with
        one peer): no member then applies a step before every member completed the one before, so at a change the
        survivors are at most one step apart, and a survivor one step behind takes that step by itself, from its own
        state, instead of being given another's, where the front end set :attr:`catches_up`. Returns True,
        apply it; False, abandon it (the epoch closed, or ended, before the transaction before it committed, or this
        member's record for the next epoch went out without it) and take the next epoch from :meth:`recover`. Waits
        for the outcome of ``transaction`` itself only when it ends the epoch (to admit a joiner)."""
        assert epoch.store is not None
        with self._lock:
            self.votes_ahead = True
            if self._recorded >= epoch.number:
                return False
            self._voted = transaction
        try:
            ends_epoch, decision, seen = count_vote(epoch.store, epoch, transaction, waiters=False)
            before = decision or seen  # the register as this vote was counted (after it, if it was the last)
            if before.committed < transaction - 1 and not before.final:  # a member is a step behind: rare
                before = self._register_past(epoch, transaction - 1)
            # t - 1 committed, and the epoch did not end with it (closed after it, t counts: the records decide)
            ended_before = before.committed == transaction - 1 and before.state == "ended"
            applies = before.committed >= transaction - 1 and not ended_before
            if applies and decision is None and ends_epoch:
                decision = self._outcome(epoch, transaction)
            epoch.mark_decided(decision or before)
        except StoreUnreachable:  # the coordinator is gone: the next epoch's committed counts this member's vote
            applies = self.recover(epoch).committed >= transaction
        return self._decided(transaction, applies)

    def _decided(self, transaction: int, applied: bool) -> bool:
        """Record the outcome of this member's vote for ``transaction`` (the join record waits for it); returns
        ``applied``."""
        with self._lock:
            self._voted = None
            if applied:
                self._committed = max(self._committed, transaction)
            self._lock.notify_all()
        return applied

    def _register_past(self, epoch: Epoch, transaction: int) -> Decision:
        """The register once ``transaction`` committed or the epoch is over (read every few milliseconds: only a member
        voting one ahead waits for it, when another is a step behind)."""
        assert epoch.store is not None
        while not (register := Decision.decode(epoch.store.check(f"{epoch.prefix()}decision"))).final:
            if register.committed >= transaction:
                return register
            if self._failure is not None:
                raise self._failure
            time.sleep(0.002)
        return register

    def _outcome(self, epoch: Epoch, transaction: int) -> Decision:
        """The register's value once ``transaction``'s last vote is in, or the epoch closed before it."""
        assert epoch.store is not None
        key, period = f"{epoch.prefix()}done/{transaction}", self.settings.heartbeat_period
        while (done := epoch.store.get(key, wait=period)) is None:
            if self._failure is not None:
                raise self._failure
        return Decision.decode(done)

"""A fault-tolerant JAX job's recovery from a change of members (:class:`Recovery`, the part of
:class:`~bagua_jax.fault_tolerance.FaultTolerantTrainer` that runs once per change): the next epoch taken, the
communicator rebuilt for its members, the step a member one behind the others was on taken by itself, the state
carried over by :mod:`bagua_jax.state_rules` and given to the joiners, each algorithm's own state resumed (low-precision
decentralized training's ring copies, asynchronous averaging's rounds), and the replicas compared."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from bagua_common.fault_tolerance import Epoch
from bagua_jax import state_rules
from bagua_jax.algorithms.low_precision_decentralized import LowPrecisionDecentralized
from bagua_jax.epoch_communicator import fail_epoch, follow_members
from bagua_jax.host_communicator import HostCommunicator
from bagua_jax.train_state import TrainState, rewrap_state, unwrap_state
from bagua_jax.unaveraged_step import StepBehind

__all__ = ["Recovery"]


class Recovery:
    """The recovery from a change of members, mixed into :class:`~bagua_jax.fault_tolerance.FaultTolerantTrainer`,
    whose attributes it reads (the trainer, communicator, membership, epoch, the algorithm's steps and rules, the
    state's sharing) and whose ``epoch``, ``membership``, ``committed`` and ``recoveries`` it sets."""

    def _recover(self, state: Any, behind: StepBehind | None = None, failed_at: float | None = None) -> Any:
        """Take the next epoch and rebuild the communicator for it; returns the state to go on from (a survivor
        that had not applied a step another one applied is given that one's state; voting one ahead, it takes
        ``behind``, the step it was on, by itself). Over an engine that rebuilds its communicator afresh (TCP), a
        member lost during the recovery makes the survivors take the epoch after. Its record gives the seconds since
        ``failed_at`` (when the step first failed, by ``time.monotonic``) until this member trains again."""
        started, first, retried = time.monotonic(), self.epoch, False
        while True:
            if self._transfer is not None and self._sits_out:  # a broadcast on the old communicator: over (revoked)
                with contextlib.suppress(Exception):  # before it changes; a pair's own thread is left to end
                    self._transfer.result()
            self._transfer = self._incoming = None
            self.membership, new = follow_members(self.communicator, self.membership, self.epoch)  # evicted: a new one
            self.epoch = new
            if self._averaging is not None:  # the old members' rounds: their collectives failed with their epoch
                self._averaging.abandon()
            # A failed attempt may have left the step compiled for its size: compiled again for the next one's.
            recompile = (retried or new.size != first.size) and not self._world_size_free
            try:
                state = self._take_epoch(state, new, recompile, behind)
                break
            except Exception as error:  # noqa: BLE001 - communication failures only; the rest is raised
                if not self.communicator.can_rebuild:
                    raise
                fail_epoch(self.membership, new, error)
                retried = True
        caught_up = behind is not None and behind.taken  # the step it was on taken by itself (one ahead)
        record = {"epoch": new.number, "size": new.size, "joined": len(new.joined), "caught_up": caught_up}
        now = time.monotonic()
        resumed = {} if failed_at is None else {"resume_seconds": now - failed_at}
        self.recoveries.append({**record, "rebuild_seconds": now - started, **resumed})
        return state

    def _take_epoch(self, state: Any, new: Epoch, recompile: bool, behind: StepBehind | None) -> Any:
        """``state`` carried over to ``new``'s members, whose communicator this one now is: the step the others
        applied first taken by itself where this member is one behind them (``behind``), the state's group split,
        the step compiled again (``recompile``), the state given to the joiners, the replicas compared."""
        if behind is not None and self.committed < new.committed and not new.is_joiner():
            state, behind.result = behind.take()
            behind.taken = True
            self._apply(behind.trainers)
        # Its step abandoned, the divisor goes back to the size; only now, once the new members' communicator
        # dropped the failed calls' ordering tokens: before, the divisor's wait for those calls raised their error.
        self.communicator.set_average_divisor(None)
        self.communicator.revoke_when(new.closed, f"the job's membership changed (epoch {new.number} closed)")
        self._split_state_group(new)
        state = self._carry_over(state, recompile)
        self._sitting_out &= {member.id for member in new.members}
        if new.joined:
            state = self._share_state(state, new)
        state = self._resumed(state)
        if not self._sitting_out:  # else checked once the joiners took part in their first exchange
            self.check_replicas(state, f"after the recovery to epoch {new.number}")
        return state

    def _carry_over(self, state: Any, recompile: bool) -> Any:
        """``state`` for the new members by :mod:`bagua_jax.state_rules` (per-rank leaves fresh, the rest kept), the
        step compiled again first where its buffers follow the world size (unless ahead: ``resized_steps``)."""
        if recompile and not (self._resized is not None and self._resized.adopt(self.trainer.size)):
            self.trainer.recompile()
        own = unwrap_state(state)
        fresh = TrainState(own.params, self.trainer._init(own.params), own.step, own.model_state)
        carried = state_rules.carry_over(self._roles, own, fresh)
        return rewrap_state(None if isinstance(state, TrainState) else state, carried)

    def _resumed(self, state: Any) -> Any:
        """``state`` with the algorithm's own state resumed on the new members: low-precision decentralized training's
        copies taken again on the new ring (collective; while joiners sit out the step, and have no weights, at the
        next step's start instead, on every member), asynchronous averaging's rounds started over them."""
        ring = isinstance(self.trainer.algorithm, LowPrecisionDecentralized) and self._unaveraged_step is not None
        self._copies_due = ring and bool(self._sitting_out)
        exchange, resumed = HostCommunicator(self.communicator).send_recv, state_rules.ring_copies_resumed
        state = state if self._copies_due else resumed(state, exchange, self.epoch.rank, self.epoch.size)
        self._start_rounds(state)
        return state

"""Training that survives a lost rank without a restart: the JAX front end (native mode, MPI engine).

:class:`FaultTolerantTrainer` drives a :class:`~bagua_jax.trainer.DataParallel` in native mode through the shared
protocol of :mod:`bagua_common.fault_tolerance` (members, epochs, commit by agreement). Each step is a transaction; a
JAX step changes nothing in place, so an abandoned one costs nothing to roll back. When a member dies or hangs, a thread
revokes the communicator, the survivors shrink it to themselves in the same handle (a step whose shapes follow the world
size was compiled ahead for it), check that their replicas are bit-identical and run the step again on the new partition
of the samples not yet trained on (:mod:`bagua_jax.recovery`; under (low-precision) decentralized training and
asynchronous averaging after its warm-up, a step voted one ahead: one whose exchange failed where the others' completed,
or whose vote came too late, takes that step by itself, unaveraged, :mod:`bagua_jax.unaveraged_step`; asynchronous
averaging's rounds start again over the new members, :mod:`bagua_jax.averaging_across_changes`);
one they took for dead (stopped or cut off past ``dead_after``) joins again. A joiner
compiles its step before it asks to be admitted and does not make its peers wait for its state
(:mod:`bagua_jax.state_sharing`): it takes its first step weighed out (gradient allreduce, PowerSGD:
:mod:`bagua_jax.weighed_out_step`), sits it out ((low-precision) decentralized: :mod:`bagua_jax.unaveraged_step`), or
sits out the DiLoCo round in flight with a zero pseudo-gradient (INTELLECT-1's rule). Under DiLoCo each outer exchange
is the transaction: the survivors train on to it and retry it among themselves, losing no inner step; one overlapping
the next steps (Streaming DiLoCo) commits with the step that applies it. The guide, ``docs/guides/fault_tolerance.md``,
has the rules of every algorithm's state."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any

import jax
import numpy as np

from bagua_common.algorithms.diloco import DiLoCoConfig
from bagua_common.fault_tolerance import (
    DataPosition,
    Epoch,
    FaultToleranceSettings,
    Membership,
    MembershipChanged,
    check_digests,
)
from bagua_common.fault_tolerance.background import wait_unless
from bagua_common.fault_tolerance.data_position import RECORD_KEY, recorded_position
from bagua_common.job.checkpoint import checkpoint_to_restore
from bagua_jax import checkpoint, state_rules
from bagua_jax.algorithms.async_model_average import AsyncModelAverage
from bagua_jax.algorithms.decentralized import Decentralized, WithoutAveraging
from bagua_jax.averaging_across_changes import AveragingAcrossChanges
from bagua_jax.epoch_communicator import fail_epoch, join_members
from bagua_jax.host_communicator import HostCommunicator
from bagua_jax.native_communicator import NativeCommunicator
from bagua_jax.recovery import Recovery
from bagua_jax.resized_steps import ResizedSteps
from bagua_jax.state_sharing import StateSharing
from bagua_jax.train_state import TrainState, is_nnx_module, unwrap_state
from bagua_jax.trainer import DataParallel
from bagua_jax.unaveraged_step import StepBehind, UnaveragedStep, counted_on
from bagua_jax.weighed_out_step import WeighedOutStep, weighs_out

__all__ = ["FaultTolerantTrainer"]


class FaultTolerantTrainer(Recovery, StateSharing):
    """A native-mode :class:`DataParallel` (MPI engine) whose steps survive a lost or added member.

    ``membership`` is this process's :class:`~bagua_common.fault_tolerance.Membership` (its first epoch's ranks
    must be the communicator's; a process that joins a running job is made by :meth:`joiner` instead); ``data`` the
    job's :class:`~bagua_common.fault_tolerance.DataPosition`; ``hash_every`` compares the replicas' digests every
    that many committed transactions (steps; under DiLoCo, exchanges; default: the membership's settings), besides
    after every recovery. :meth:`init` gives the state (a joiner receives it from a member), :meth:`step` runs one
    step (committed, or a DiLoCo inner step), :meth:`finished` marks the job finished after the last one. It takes
    the algorithms of :func:`bagua_jax.state_rules.carried_algorithms` (DiLoCo's overlapped exchange in float32)."""

    def __init__(
        self, trainer: DataParallel, membership: Membership, data: DataPosition, hash_every: int | None = None
    ):
        state_rules.refuse_unsurvivable(trainer)
        if membership.epoch.is_joiner():
            raise ValueError(
                "FaultTolerantTrainer: this process joins a running job: make it with FaultTolerantTrainer.joiner "
                "(over NativeCommunicator.tcp_self(host) or mpi_self()), which compiles the step before asking to join"
            )
        self._prepare(trainer, data, membership.settings, hash_every)
        self._admitted(membership)

    @classmethod
    def joiner(
        cls,
        trainer: DataParallel,
        data: DataPosition,
        settings: FaultToleranceSettings,
        master: tuple[str, int],
        hash_every: int | None = None,
        timeout: float = 300.0,
    ) -> FaultTolerantTrainer:
        """The trainer of a process that joins a running job (a replacement, one more rank): ``trainer``'s communicator
        is this process alone (:meth:`NativeCommunicator.tcp_self` or :meth:`~NativeCommunicator.mpi_self`) until
        :meth:`init` compiled the step, asked a live member's store at ``master`` (host, port) to admit it (up to
        ``timeout`` s) and put the job's in its slot."""
        state_rules.refuse_unsurvivable(trainer)
        if trainer.communicator is None or trainer.communicator.size != 1:
            raise ValueError(
                "FaultTolerantTrainer.joiner needs a DataParallel over NativeCommunicator.tcp_self(host) or mpi_self()"
            )
        joiner = cls.__new__(cls)
        joiner._prepare(trainer, data, settings, hash_every)
        joiner._join_at = (settings, master, timeout)
        return joiner

    def _prepare(
        self, trainer: DataParallel, data: DataPosition, settings: FaultToleranceSettings, hash_every: int | None
    ) -> None:
        """What does not depend on the members: the trainer, the data, the algorithm's rules."""
        communicator = trainer.communicator
        if not isinstance(communicator, NativeCommunicator) or communicator.kind not in ("tcp", "mpi"):
            raise ValueError(
                "FaultTolerantTrainer needs a DataParallel over a native host engine (communicator=: "
                "NativeCommunicator.tcp_through_store or mpi_through_store)"
            )
        self.trainer, self.data, self.communicator = trainer, data, communicator
        self.hash_every = settings.hash_every if hash_every is None else int(hash_every)
        # Averages laid out alike for every size (gradient allreduce, PowerSGD, DiLoCo's float32) run as compiled.
        config = trainer.algorithm.config
        self._diloco: DiLoCoConfig | None = config if isinstance(config, DiLoCoConfig) else None
        fp32_diloco = self._diloco is not None and self._diloco.outer_exchange == "fp32"
        self._world_size_free = config.step_free_of_world_size or fp32_diloco
        self._sits_out = self._diloco is not None and not self._diloco.fragment_sync_delay and config.fragments == 1
        if self._diloco is not None:  # a joiner sitting out an exchange (_share_state) adds an uncounted zero
            trainer._use(trainer.algorithm.counting_trainers())
        if isinstance(trainer.algorithm, Decentralized):  # a lost member may leave an odd number to pair
            trainer._use(trainer.algorithm.averaging_all_when_odd())
        # A rank's collectives completing shows that every rank contributed where the replicas are identical.
        self._votes_ahead = self._diloco is None and getattr(trainer.algorithm, "replicas_identical", False)
        self._weighed_out_step = WeighedOutStep(trainer) if weighs_out(trainer) else None
        self._unaveraged_step = UnaveragedStep(trainer) if isinstance(trainer.algorithm, WithoutAveraging) else None
        asynchronous = isinstance(trainer.algorithm, AsyncModelAverage)  # its rounds follow the members
        self._averaging = AveragingAcrossChanges(trainer.algorithm, communicator) if asynchronous else None
        self._copies_due = False  # the ring copies' restart, deferred to the next step's start by a joiner's sit-out
        self._resized = ResizedSteps(trainer) if settings.compile_ahead and not self._world_size_free else None
        self._sitting_out: frozenset[str] = frozenset()
        """The members (ids) given the state that sit out (or are weighed out of) the round or step in flight."""
        self._transfer: Future | None = None  # the state's sending to those sitting out, while the members train
        self._incoming: Future | None = None  # a member weighed out of the step in flight: its state on the way
        self._state_group: NativeCommunicator | None = None  # the holder's and joiners', split at their admission
        # The transaction the replicas are compared after (not hash_every): the first all trained once joiners were in.
        self._check_after: int | None = None
        self._roles: TrainState | None = None
        self.membership: Membership | None = None
        self.admission: dict[str, float] | None = None
        """A joiner's: when it ``asked`` to be admitted (its step compiled) and was ``admitted``, the job's communicator
        in its slot (``time.time()``)."""
        self.recoveries: list[dict[str, Any]] = []
        """One record per recovery: epoch, size, joiners admitted, whether this member ``caught_up`` (took the step
        the others applied by itself), seconds to rebuild and from the failed step to the retried (or next) step's
        start."""

    def _admitted(self, membership: Membership) -> None:
        """Take ``membership``'s epoch, whose ranks must be the communicator's."""
        self.membership, self.epoch = membership, membership.epoch
        rank = self.communicator.engine.rank(self.communicator.handle)  # on the host: nothing to compile
        if (self.epoch.rank, self.epoch.size) != (rank, self.communicator.size):
            raise ValueError(
                f"FaultTolerantTrainer: the communicator is rank {rank} of {self.communicator.size} but the "
                f"membership's epoch has this member as rank {self.epoch.rank} of {self.epoch.size}"
            )
        self.committed = self.epoch.committed
        self.communicator.revoke_when(
            self.epoch.closed, f"the job's membership changed (epoch {self.epoch.number} closed)"
        )

    def init(self, params: Any, example_batch: Any = None) -> Any:
        """The state to train from: ``trainer.init(params)`` on the first members; a joiner's comes from a member.
        ``params`` is a pytree of parameters or a flax ``TrainState`` (the same class comes back). A joiner
        (:meth:`joiner`) first compiles the step for ``example_batch`` (a batch of this rank's shapes; unused by the
        others), so that its peers never wait for its compilation, then asks to be admitted."""
        if is_nnx_module(params):
            raise TypeError(
                "FaultTolerantTrainer takes a pytree of parameters or a flax TrainState; an NNX model changes in "
                "place, which an abandoned step could not roll back: split it (nnx.split) and pass its parameters"
            )
        state = self.trainer.init(params)  # the first members check with each other that they train the same job
        self._roles = state_rules.roles(self.trainer, unwrap_state(state))
        if unwrap_state(state).model_state is not None:  # averaged: no weighed-out or unaveraged step
            self._weighed_out_step = self._unaveraged_step = None
        if self.membership is not None:
            self._start_rounds(state)
        else:
            state = self._join(state, example_batch)
            try:
                self._split_state_group(self.epoch)
                state = self._carry_over(state, recompile=not self._world_size_free)
                state = self._resumed(self._share_state(state, self.epoch))
                if not self._sitting_out:  # else checked once the joiners took part in their first exchange
                    self.check_replicas(state, f"after joining in epoch {self.epoch.number}")
            except Exception as error:  # noqa: BLE001 - communication failures only; the rest is raised
                if not self.communicator.can_rebuild:
                    raise
                fail_epoch(self.membership, self.epoch, error)  # a member lost meanwhile: it is given the state
                state = self._recover(state)  # in the next epoch
            self.trainer._batches_checked = True  # the members checked their batches before this one came
        return state

    def _join(self, state: Any, example_batch: Any) -> Any:
        """Compile the step, ask to be admitted, take the epoch's communicator; returns ``state``."""
        if example_batch is None:
            raise ValueError(
                "FaultTolerantTrainer.init: a joiner compiles its step before it asks to join, so that its peers never "
                "wait for it: pass example_batch, a batch of this rank's shapes"
            )
        if self._world_size_free:  # else its buffers follow the world size: compiled for one member more than the job's
            self.trainer.compile(state, example_batch)
        elif self._resized is not None:  # for the job's size with it, as a member's store says
            self._resized.compile_for_joining(state, example_batch, self._roles, *self._join_at[:2])
        if self._weighed_out_step is not None:  # its first step
            self._weighed_out_step.compile(state, example_batch)
        if self._unaveraged_step is not None:  # the loss of the first step, which it sits out
            self._unaveraged_step.compile_loss(state, example_batch)
        settings, master, timeout = self._join_at
        asked = time.time()
        membership = join_members(self.communicator, settings, master, None, timeout)
        self.admission = {"asked": asked, "admitted": time.time()}
        self._admitted(membership)
        return state

    def step(self, state: Any, batch_of: Callable[[np.ndarray], Any]) -> tuple[Any, Any]:
        """One step: ``batch_of(indices)`` builds this rank's batch from the sample indices :attr:`data` assigns it;
        returns the new state and the step's result as :meth:`DataParallel.step` does (for a step a joiner sits out, the
        loss of its state: :mod:`bagua_jax.unaveraged_step`).

        A step that is a transaction (every step; under DiLoCo, each step that ends with an outer exchange) commits
        by agreement; one abandoned by a membership change is run again, on the new members' partition of the same
        samples, from the last committed state. A DiLoCo inner step runs in a closed epoch too: it communicates
        nothing, and the round's exchange is where the survivors recover."""
        failed_at = None
        while True:
            epoch, transaction = self.epoch, self.committed + 1
            exchange = self._is_transaction(state)
            place, trainers = self._training_place(epoch)
            unaveraged = self._unaveraged_step is not None and bool(self._sitting_out)
            sat_out = unaveraged and epoch.members[epoch.rank].id in self._sitting_out  # a joiner: the members train
            batch = batch_of(self.data.indices(place, trainers))
            weighed = self._weighed_out_step is not None and bool(self._sitting_out)
            joiners_in_this_step = weighed or unaveraged  # they take it while their state travels
            # Voted one ahead where this member can train the step alone, should it fall one behind.
            alone = None if joiners_in_this_step else self._step_alone(state)
            one_ahead = not self._votes_ahead and alone is not None
            self.membership.catches_up = one_ahead
            try:
                if epoch.closed.is_set() and (exchange or epoch.ended.is_set()):
                    raise MembershipChanged(f"epoch {epoch.number} closed")
                if self._copies_due and not self._sitting_out:  # the joiners have weights now: restart the copies
                    state = self._resumed(self._carry_over(state, recompile=False))
                if exchange and self._transfer is not None and (self._sits_out or not joiners_in_this_step):
                    transfer, self._transfer = self._transfer, None  # the receivers have it before the exchange
                    wait_unless(transfer, epoch.closed, f"epoch {epoch.number} closed while the state was on its way")
                if sat_out:  # it votes for the step the members train, its state one step on (unaveraged_step)
                    new_state, result = counted_on(state), None
                elif weighed:  # the joiners send zeros, the average divides by the members; every rank runs the two
                    self.communicator.set_average_divisor(trainers)  # halves: the joiners' update is the members'
                    new_state, result = self._weighed_out_step.step(state, batch, self._incoming, epoch)
                else:
                    new_state, result = (self._unaveraged_step if unaveraged else self.trainer).step(state, batch)
                jax.block_until_ready((new_state, result))
                for ahead in () if sat_out else (self._weighed_out_step, self._unaveraged_step):  # from a thread, long
                    if ahead is not None:  # before a joiner comes; not during a joiner's first step: every member waits
                        ahead.compile_in_background(state, batch)
                if self._resized is not None and not sat_out:  # and for the world sizes one change brings
                    self._resized.compile_in_background(state, batch, self._roles)
                if self._averaging is not None and not sat_out:  # the rounds too, which follow the number of members
                    self._averaging.compile_ahead(state, epoch.size)
                if weighed:
                    self.communicator.set_average_divisor(None)
            except Exception as error:  # noqa: BLE001 - communication failures only; the rest is raised
                fail_epoch(self.membership, epoch, error)
                # Should the others have applied it, this member's exchange having failed: it trains the step alone.
                behind = StepBehind(partial(alone, state, batch), trainers) if one_ahead else None
            else:
                if not exchange:
                    self.data.advance(trainers)
                    return new_state, result
                if self._votes_ahead:
                    vote = self.membership.vote_ahead
                else:
                    vote = self.membership.vote_one_ahead if one_ahead else self.membership.commit
                applied = vote(epoch, transaction)
                self.membership.catches_up = False  # until the next step: one behind then, it has no batch to take it
                if applied:  # a joiner that sat it out reports its given state's loss on the first member's samples
                    new_state = self._applied(epoch, trainers, new_state)
                    return new_state, self._unaveraged_step.loss(state, batch) if sat_out else result
                # Should the others have applied it, its record having gone out without it: it takes its own step.
                behind = StepBehind(lambda: (new_state, result), trainers) if one_ahead else None
            failed_at = time.monotonic() if failed_at is None else failed_at
            state = self._recover(state, behind, failed_at)
            if behind is not None and behind.taken:
                return state, behind.result

    def _applied(self, epoch: Epoch, trainers: int, new_state: Any) -> Any:
        """``new_state``, its step applied by ``trainers`` members: the data moves on, the replicas are compared when
        due (a failed comparison recovers the state)."""
        self._apply(trainers)
        if self._averaging is not None:  # the last round finished, if any
            try:
                new_state = self._averaging.apply(new_state)
            except Exception as error:  # noqa: BLE001 - a round a lost member failed (its thread's); the rest raised
                fail_epoch(self.membership, epoch, error)  # the step is committed: the recovery goes on from it
                return self._recover(new_state)
        pending = self._check_after
        due = self.committed >= pending if pending else self.hash_every and self.committed % self.hash_every == 0
        if due and not epoch.closed.is_set():
            self._check_after = None
            try:
                self.check_replicas(new_state, f"at step {self.committed}")
            except Exception as error:  # noqa: BLE001 - as in the step; the recovery checks the replicas
                fail_epoch(self.membership, epoch, error)
                new_state = self._recover(new_state)
        return new_state

    def save(self, root: str | os.PathLike, state: Any) -> Path | None:
        """:func:`bagua_jax.checkpoint.save` of ``state`` (what :meth:`step` returned) by the members, for a restart of
        the whole job, with :attr:`data`'s position for :meth:`restore`; returns its folder. None when a member was lost
        meanwhile (rank 0 commits it once every member wrote its part; the next :meth:`step` recovers), and, with
        nothing written, while the members change or a joiner sits out."""
        epoch = self.epoch
        if self._sitting_out or self._copies_due or epoch.closed.is_set():  # joiners not training; members changing
            return None
        try:
            return checkpoint.save(root, state, self.trainer, metadata={RECORD_KEY: self.data.record()})
        except Exception as error:  # noqa: BLE001 - communication failures only; the rest is raised
            fail_epoch(self.membership, epoch, error)
            return None

    def restore(self, root: str | os.PathLike, params: Any) -> Any:
        """The state of the newest committed checkpoint under ``root`` (:meth:`save`'s, any world size), :attr:`data`
        at the position it recorded: a restarted job's first members call it instead of :meth:`init`."""
        if self.membership is None:
            raise ValueError("FaultTolerantTrainer.restore: a joiner receives the members' state: call init")
        directory = checkpoint_to_restore(root)
        self.data.resume(recorded_position(directory))
        state = checkpoint.restore(directory, self.trainer, params)
        self._roles = state_rules.roles(self.trainer, unwrap_state(state))
        self.check_replicas(state, f"after restoring {directory}")
        self._start_rounds(state)
        return state

    def finished(self) -> None:
        """Mark the job finished; every member calls it once its last step committed. A replacement or joiner started
        afterwards then exits with status 0, and ``bagua-launch --fault-tolerant`` starts no replacement for a rank.
        Asynchronous averaging's rounds stop (a round not yet applied is dropped)."""
        if self._averaging is not None:
            self._averaging.abandon()
        self.membership.finished()

    def check_replicas(self, state: Any, what: str) -> None:
        """Raise :class:`~bagua_common.fault_tolerance.ReplicaMismatch` on every member unless the replicated state
        (:mod:`bagua_jax.state_rules`: all but error-feedback residuals and an unaveraged model state), the step and
        the data position are bit-identical across the members."""
        digest = state_rules.replica_digest(self._roles, jax.device_get(unwrap_state(state)), self.data.state())
        gathered = HostCommunicator(self.communicator).allgather(digest)  # nothing to compile
        check_digests(state_rules.DIGEST_PARTS, np.asarray(gathered), what)

    @property
    def averaging_rounds(self) -> int | None:
        """The rounds asynchronous averaging's current members completed so far (None under the other algorithms)."""
        return None if self._averaging is None else self._averaging.rounds

    @property
    def trainers(self) -> int:
        """The members that train the next step, among which its samples are split: all but those given the state."""
        return self._training_place(self.epoch)[1]

    def _is_transaction(self, state: Any) -> bool:
        """Whether the next step of ``state`` is a transaction: every step, or one that applies DiLoCo's exchange."""
        return self._diloco is None or bool(self._diloco.applies_after(int(unwrap_state(state).step) + 1))

    def _apply(self, trainers: int) -> None:
        self.committed += 1
        self.data.advance(trainers)
        self._incoming = None
        if self._sitting_out:  # the joiners took part in an exchange or a step: they hold the replicated state now
            self._sitting_out = frozenset()  # compared once a step of theirs overlapped the state's travel, if weighed
            self._check_after = self.committed + (self._weighed_out_step is not None)

    def _training_place(self, epoch: Epoch) -> tuple[int, int]:
        """This member's place among those training the step, and their number (those sitting out weigh zero)."""
        return epoch.training_place([rank for rank, m in enumerate(epoch.members) if m.id in self._sitting_out])

    def _step_alone(self, state: Any) -> Callable[[Any, Any], tuple[Any, Any]] | None:
        """The step (``step(state, batch)``) this member takes by itself, should it fall one behind the others, where
        its steps vote one ahead: (low-precision) decentralized training's unaveraged step, or the step itself from
        the step count on which the algorithm's steps communicate nothing (asynchronous averaging's, once its warm-up
        is over: ``local_steps_from``); else None."""
        if self._unaveraged_step is not None:
            return self._unaveraged_step.step
        local_from = self.trainer.algorithm.config.local_steps_from()
        if local_from is None or int(unwrap_state(state).step) < local_from:
            return None
        return self.trainer.step

    def _start_rounds(self, state: Any) -> None:
        """Asynchronous averaging's rounds over the members the communicator has now, from ``state``'s step."""
        if self._averaging is not None:
            self._averaging.start(state, self.membership, self.epoch)

"""Training that survives a lost rank without a restart, for PyTorch (protocol: :mod:`bagua_common.fault_tolerance`).

Turn it on with ``bagua_torch.init_process_group(fault_tolerance=True)`` (or ``BAGUA_FAULT_TOLERANCE=1``),
wrap the model as usual, and run the steps through :meth:`FaultTolerance.steps`::

    group = bagua_torch.init_process_group(fault_tolerance=True)
    model = bagua_torch.with_bagua(net, [optimizer], "bytegrad")
    data = DataPosition(len(dataset), batch_per_rank=32)
    for step in group.fault_tolerance.steps(total_steps, data):
        with step:                                   # a lost member ends the attempt; it runs again
            x, y = dataset[step.indices]
            loss_fn(model(x), y).backward()
            optimizer.step()                         # commits by agreement in its pre-hook

Each epoch of members gets its own gloo (or NCCL) process groups on the coordinator's store. A rank applies each
step as soon as its own collectives completed (decentralized training: and every member completed the step before).
When a member dies, the survivors abandon their collectives, take the next epoch, rebuild the wrapper for the new size
(the algorithm's state carried by its rule, ``docs/guides/fault_tolerance.md``), check that the replicas are
bit-identical and run the step in flight again; a decentralized survivor whose exchange failed where the others'
completed takes that step by itself instead, its optimizer stepping the gradients it holds. A
process started with ``BAGUA_FT_JOIN=1`` joins the running job, its state sent by a member while its peers train
(:mod:`bagua_torch.state_transfer`). NCCL is not run here: no GPU.
"""

from __future__ import annotations

import inspect
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from bagua_common.comm.topology import Communicators
from bagua_common.fault_tolerance import (
    ENV_FAULT_TOLERANCE,
    ENV_JOIN,
    ENV_PEERS,
    DataPosition,
    Epoch,
    Evicted,
    ExchangeInterrupted,
    FaultToleranceSettings,
    Membership,
    MembershipChanged,
    Recovery,
    recorded_position,
)
from bagua_common.fault_tolerance.data_position import RECORD_KEY
from bagua_common.job.checkpoint import checkpoint_to_restore
from bagua_torch import checkpoint, state_transfer
from bagua_torch.algorithms.joiner_sits_out import JoinerSitsOutOneStep
from bagua_torch.communicator import CommunicationError
from bagua_torch.communicator.abandon import caused_by_a_change
from bagua_torch.communicator.epoch_groups import epoch_communicator, solo_communicator
from bagua_torch.replica_check import check_replicas
from bagua_torch.state_sharing import StateSharing
from bagua_torch.survivable import carried_algorithms, refuse_unsurvivable

if TYPE_CHECKING:
    from bagua_torch.bagua_module import BaguaModule

__all__ = ["ENV_FAULT_TOLERANCE", "FaultTolerance", "Step", "carried_algorithms", "start_fault_tolerance"]


class Step:
    """One attempt at a training step (a context manager; see :meth:`FaultTolerance.steps`): ``number`` is the step
    (from 1), ``indices`` this rank's samples (given a :class:`~bagua_common.fault_tolerance.DataPosition`), ``rank``
    and ``world_size`` this member's place among the members training the step (all but DiLoCo joiners sitting out
    their first round)."""

    def __init__(self, job: FaultTolerance, number: int):
        self._job = job
        self.number = number
        self.rank, self.world_size = job.training_place()
        self.indices = None if job.data is None else job.data.indices(self.rank, self.world_size)

    def __enter__(self) -> Step:
        self._job._attempt_started()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        return self._job._attempt_ended(error, self.world_size)


class FaultTolerance(StateSharing):
    """This process's side of a fault-tolerant job: its membership, the epoch's communicators, the wrapped models.
    Made by ``init_process_group(fault_tolerance=True)``; reach it as ``group.fault_tolerance`` (the module docstring
    shows the loop). A joiner (``membership`` None) wraps its models alone and asks to be admitted when its loop
    starts; :meth:`save` and :meth:`restore` restart the whole job from a checkpoint."""

    def __init__(
        self,
        settings: FaultToleranceSettings,
        membership: Membership | None,
        join_at: tuple[str, int],
        backend: str,
        device: torch.device,
        timeout: float,
    ):
        self.settings, self.membership, self._join_at = settings, membership, join_at
        self.backend, self.device, self.timeout = backend, device, timeout
        self.modules: list[BaguaModule] = []
        self._replicas_identical = True  # every model's algorithm keeps its replicas identical: votes go ahead
        self._steps_alone = True  # else every model can take a step by itself (decentralized): votes go one ahead
        self.data: DataPosition | None = None
        self.epoch: Epoch | None = None if membership is None else membership.epoch
        self.step = self.committed = 0 if self.epoch is None else self.epoch.committed
        """Steps completed; transactions committed by agreement (steps, or DiLoCo's exchanges): equal on all members."""
        self.recoveries: list[dict[str, float]] = []
        """Per change of members: ``epoch``, ``size``, ``seconds`` (from the failure seen here, or the change
        noticed, to the step running again), ``steps_lost`` (0 or 1), ``caught_up`` (1: the step the others applied
        taken by itself, :meth:`_change_epoch`), ``joined`` (members admitted)."""
        self._voted_this_attempt = self._committed_this_attempt = False
        self._stepping_alone = False  # the optimizers step the step the others committed: their hooks vote for nothing
        self._failure_seen: float | None = None
        self._checked = self._sat_out_through = -1  # the last step the replicas were checked; a joiner sat out
        self._sitting_out: tuple[int, ...] = ()  # the ranks given the state in the background, until they commit
        self._weighed_out = False  # whether those take part in the step in flight weighed out, not sitting out a round
        self._incoming: state_transfer.IncomingState | None = None  # this joiner's state, weighed out of its step
        self._entered = self._check_due = False  # an epoch was entered; the replicas are checked at the next step
        self.world = solo_communicator(self.timeout)  # until the loop starts: the models wrap alone, then are rebuilt
        self.group: Any = None
        """The ``BaguaProcessGroup`` whose ``fault_tolerance`` this is (rank, size, communicators follow the epochs)."""

    @property
    def communicators(self) -> Communicators:
        """The current epoch's communicators."""
        return Communicators(self.world)

    # --- the models ------------------------------------------------------------------

    def attach(self, module: BaguaModule) -> None:
        """Train ``module`` (a wrapper made on this job's group) fault-tolerantly: commit its steps, rebuild it on
        a change. Called by the wrapper; what cannot continue in-process is refused (:func:`refuse_unsurvivable`)."""
        refuse_unsurvivable(module)
        self.modules.append(module)
        config = module.algorithm.config_class
        self._replicas_identical &= config is not None and config.replicated
        one_optimizer = len(module.optimizers) == 1  # a step by itself steps all: none may have stepped before
        self._steps_alone &= isinstance(module.algorithm_impl, JoinerSitsOutOneStep) and one_optimizer

    def commit_step(self) -> None:
        """Vote for the step in flight (its collectives are done) and let it apply: voting ahead where the replicas are
        identical, one ahead where they differ (decentralized: once every vote for the step before is in), else once
        every vote is in; raise MembershipChanged if it did not commit. Once per attempt."""
        if self._voted_this_attempt:
            return
        assert self.membership is not None and self.epoch is not None
        self._voted_this_attempt = True
        if self._incoming is not None:  # a joiner weighed out of this step: its state, before its optimizer applies
            self._incoming.load()
            self._incoming = None
        # A rank's collectives completing shows that every rank contributed only where each collective spans all
        # ranks (replicated algorithms); a decentralized exchange completes with one peer: it votes one ahead.
        if self._replicas_identical:
            vote = self.membership.vote_ahead
        else:
            vote = self.membership.vote_one_ahead if self._votes_one_ahead() else self.membership.commit
        if not vote(self.epoch, self.committed + 1):
            raise MembershipChanged(f"step {self.step + 1} was not committed: the members changed")
        self.membership.catches_up = False  # applied: one behind now is behind a step it has not begun
        self._transaction_committed()

    def optimizer_stepping(self) -> bool:
        """Called by a wrapped model as its optimizer steps (its gradients complete); returns whether the step is
        voted for: not the step this member takes alone after a change (:meth:`_change_epoch`), which the others
        committed. From a voted step's call until it applies or its attempt ends, this member, one behind the others
        at a change, can take the step by itself (:meth:`_votes_one_ahead`); else, one behind, it is given the state."""
        assert self.membership is not None
        if self._stepping_alone:
            return False
        self.membership.catches_up = self._votes_one_ahead()
        return True

    def _votes_one_ahead(self) -> bool:
        """Whether this step is voted one ahead: every model's algorithm exchanges weights with peers (its replicas
        differ) and can take a step by itself, and no member sits the step out."""
        return not self._replicas_identical and self._steps_alone and not self._sitting_out

    def commit(self) -> bool:
        """Vote for a transaction the algorithm itself delimits (DiLoCo's outer exchange) and wait for its outcome:
        whether it committed."""
        assert self.membership is not None and self.epoch is not None
        self._voted_this_attempt = True
        if not self.membership.commit(self.epoch, self.committed + 1):
            return False
        self._transaction_committed()
        return True

    def _transaction_committed(self) -> None:
        self.committed += 1
        self._committed_this_attempt = True
        if self._sitting_out:  # joiners took part: weighed out, or from their sit-out (their loop skips its step)
            skipped = self.epoch.rank not in self._sitting_out and not self._weighed_out
            self._sat_out_through, self._sitting_out, self._check_due = self.step + 1 if skipped else -1, (), True
        for module in self.modules:
            module.algorithm_impl.on_commit()

    # --- the loop --------------------------------------------------------------------

    def steps(self, total: int, data: DataPosition | None = None) -> Iterator[Step]:
        """Yield an attempt at each step until ``total`` steps are done; a step interrupted by a membership change
        is yielded again (with the new members' sample split). Once done, the job is marked finished: a replacement
        started afterwards exits (status 0) instead of waiting to join, and so does a joiner of a finished job."""
        self.data = data
        if self.membership is None:
            self._join()
        elif not self._entered:  # the loop starts: the models are rebuilt in the first epoch
            self._enter_or_recover(self.epoch)
        while self.step < total:
            assert self.epoch is not None
            every = self.settings.hash_every
            due = self._check_due or (every and self.step % every == 0 and self._checked != self.step)
            if due and not self._sitting_out and not self.epoch.closed.is_set():
                try:
                    self._check_replicas(f"at step {self.step}")
                except (MembershipChanged, CommunicationError) as error:
                    self._fail(error)
            if self.epoch.closed.is_set() and self._may_leave_the_epoch():
                self._change_epoch(lost_step=False)
            if not self._sitting_out and self.group is not None:
                self.group.use(self.world)  # a sit-out's exchange step is over: every member trains
            yield Step(self, self.step + 1)
        self.membership.finished()

    def _may_leave_the_epoch(self) -> bool:
        """Whether this member takes the next epoch before the next step, its epoch being closed: when it ended after
        a commit (admitting joiners), or where every step is a transaction (DiLoCo: members train to the exchange)."""
        assert self.epoch is not None
        return self.epoch.ended.is_set() or all(m.algorithm_impl.transaction_per_step for m in self.modules)

    def _attempt_started(self) -> None:
        self._voted_this_attempt = self._committed_this_attempt = False

    def _attempt_ended(self, error: BaseException | None, trainers: int) -> bool:
        assert self.membership is not None and self.epoch is not None
        catches_up, self.membership.catches_up = self.membership.catches_up, False  # no step in flight now
        if error is None:
            self._step_done(trainers)
            return False
        if not caused_by_a_change(error):
            return False
        self._failure_seen = time.monotonic()
        self._fail(error)
        # A failure after the step committed (in an optimizer post-hook's exchange) or in DiLoCo's exchange: it counts.
        interrupted = self._committed_this_attempt or isinstance(error, ExchangeInterrupted)
        if interrupted:
            self._step_done(trainers)
        alone = None if interrupted or not catches_up else trainers
        self._change_epoch(lost_step=not interrupted, alone=alone)
        return True

    def _step_done(self, trainers: int | None = None) -> None:
        """Count a step trained by ``trainers`` members (its attempt's: a sit-out may end inside it; default: now's)."""
        self.step += 1
        if self.data is not None:
            self.data.advance(self.training_place()[1] if trainers is None else trainers)

    def training_place(self) -> tuple[int, int]:
        """This member's rank among the members training the current step, and their number: every member but
        those sitting out their first DiLoCo round (:meth:`_receive_or_send_state`)."""
        assert self.epoch is not None
        return self.epoch.training_place(self._sitting_out)

    def _fail(self, error: BaseException) -> None:
        assert self.membership is not None and self.epoch is not None
        if not self.epoch.failed.is_set():
            self.membership.fail(self.epoch, f"{type(error).__name__}: {error}")

    def _change_epoch(self, lost_step: bool, alone: int | None = None) -> None:
        """Take the next epoch after the current one closed (again, should a member be lost meanwhile). Where the
        others applied the step in flight, which this member did not (voting one ahead, its exchange failed), it
        takes that step by itself first, its samples split among ``alone`` members, as in the attempt."""
        assert self.membership is not None and self.epoch is not None
        started, attempted = self._failure_seen or time.monotonic(), self.step + 1
        recovery = self._recover()
        caught_up = False
        if recovery is not None:
            if alone is not None and recovery.committed == self.committed + 1 and not recovery.epoch.is_joiner():
                self._stepping_alone = caught_up = True
                try:
                    for module in self.modules:  # its gradients stepped, exchanging nothing; before the rebuild
                        module.algorithm_impl.step_alone()
                        for optimizer in module.stepping_optimizers:
                            optimizer.step()
                        module.algorithm_impl.on_commit()
                finally:
                    self._stepping_alone = False
                self._step_done(alone)
            self.committed = recovery.committed
            self._enter_or_recover(recovery.epoch)
        self.recoveries.append(
            {
                "epoch": self.epoch.number,
                "size": self.epoch.size,
                "seconds": time.monotonic() - started,
                "steps_lost": int(lost_step and self.step < attempted),  # not when given a survivor's state at it
                "caught_up": int(caught_up),
                "joined": len(self.epoch.joined),
            }
        )
        self._failure_seen = None

    def _join(self, peers: list[str] | None = None) -> None:
        """Ask to be admitted (the models are wrapped: nobody waits for this process to start), then take the
        epoch that admits it and the job's state from its first member. ``peers``: stores to ask beside
        ``MASTER_ADDR:MASTER_PORT`` and ``BAGUA_FT_PEERS``."""
        started = time.monotonic()
        if peers is not None:
            peers += [p for p in os.environ.get(ENV_PEERS, "").split(",") if p.strip()]
        self.membership = Membership.join(self.settings, *self._join_at, peers=peers, timeout=self.timeout)
        self.epoch = self.membership.epoch
        self.committed = self.epoch.committed
        self._enter_or_recover(self.epoch)
        self.joined_after = time.monotonic() - started
        """Seconds from asking to be admitted to being ready to train (a joiner)."""

    def _enter_or_recover(self, epoch: Epoch) -> None:
        """Enter ``epoch``, or the next one (and so on) should a member be lost meanwhile."""
        while True:
            try:
                self._enter(epoch)
                return
            except (MembershipChanged, CommunicationError) as error:
                self._fail(error)
                recovery = self._recover()
                if recovery is None:
                    return  # joined again
                epoch, self.committed = recovery.epoch, recovery.committed

    def _recover(self) -> Recovery | None:
        """The next epoch; or, when the others went on without this process (it was taken for dead), join the job
        again as a new member given the state (returns None then)."""
        assert self.membership is not None and self.epoch is not None
        try:
            return self.membership.recover(self.epoch)
        except Evicted:
            self.membership.close()
            self.membership = None
            self._join([f"{m.host}:{m.port}" for m in self.epoch.members])  # where the others may still be
            return None

    def _enter(self, epoch: Epoch) -> None:
        """Make ``epoch`` current: its communicators, the models rebuilt for its size, the replicas made equal (the
        first member's sent to the joiners; rank 0's when the job's first members enter), and checked."""
        for module in self.modules:
            module.reducer.discard()
        self.epoch = epoch
        self.world = epoch_communicator(epoch, "world", self.backend, self.device, self.timeout)
        if self.group is not None:
            self.group.use(self.world)
        for module in self.modules:
            module.rebuild(self.communicators)
        self._sitting_out, self._weighed_out, self._check_due, self._incoming = (), False, False, None
        if epoch.joined:  # the members' state, which a restored checkpoint's step, data and optimizer are part of
            self._receive_or_send_state()
        elif not self._entered:  # the job's first epoch: every rank takes rank 0's replicas (not again: DiLoCo's drift)
            for module in self.modules:
                module.synchronize_replicas()
            self.membership.applied(0)
        self._entered = True
        for module in self.modules:
            module.algorithm_impl.after_change()
        if not self._sitting_out:  # else checked once they took part in their first exchange
            self._check_replicas(f"after the change to epoch {epoch.number} ({epoch.size} members)")

    # --- checkpoints for a restart of the whole job --------------------------------------

    def save(self, root: str | os.PathLike) -> Path | None:
        """:func:`bagua_torch.checkpoint.save` of the wrapped model and its optimizers at :attr:`step` with the data
        position, by the members between steps, for :meth:`restore`; its folder, or None: a member was lost meanwhile
        (not committed: the next step recovers), or a DiLoCo joiner sits out the round (inside its exchange)."""
        model = self._checkpointed_model("save")
        if self._sitting_out or self.step == self._sat_out_through:  # a joiner would not take part
            return None
        metadata = None if self.data is None else {RECORD_KEY: self.data.record()}
        try:
            return checkpoint.save(root, model, model.stepping_optimizers, step=self.step, metadata=metadata)
        except (MembershipChanged, CommunicationError) as error:
            self._fail(error)
            return None

    def restore(self, root: str | os.PathLike, data: DataPosition) -> int:
        """Called by a restarted job's first members before :meth:`steps`: loads the newest committed checkpoint under
        ``root`` (:meth:`save`'s, any world size); ``data`` and the loop go on from its position and step (returned)."""
        if self.membership is None:
            raise ValueError("FaultTolerance.restore: a joiner receives the members' state: call steps() alone")
        model, directory = self._checkpointed_model("restore"), checkpoint_to_restore(root)
        data.resume(recorded_position(directory))
        if not self._entered:  # the models are rebuilt for the epoch's members first
            self._enter_or_recover(self.epoch)
        self.step = checkpoint.restore(directory, model, model.stepping_optimizers)
        self.data, self._check_due = data, True
        return self.step

    def _checkpointed_model(self, what: str) -> BaguaModule:
        if len(self.modules) == 1:
            return self.modules[0]
        raise ValueError(f"FaultTolerance.{what} checkpoints one wrapped model; this job has {len(self.modules)}")

    # --- replica checks -----------------------------------------------------------------

    def _check_replicas(self, when: str) -> None:
        """Compare the replicated state across the members (ReplicaMismatch on every member if any part differs)."""
        position = [self.step, self.committed, *(self.data.state() if self.data else [])]
        check_replicas(self.world, self.device, self.modules, position, when)
        self._checked, self._check_due = self.step, False

    def close(self) -> None:
        """Leave the job (the others see this member go)."""
        if self.membership is not None:
            self.membership.close()


def start_fault_tolerance(
    rank: int | None,
    world_size: int | None,
    master_addr: str,
    master_port: int,
    backend: str,
    device: torch.device,
    timeout: float,
) -> FaultTolerance:
    """Start (every launcher rank, together) or join (``BAGUA_FT_JOIN=1``) a fault-tolerant job; called by
    ``init_process_group(fault_tolerance=True)``."""
    if not hasattr(dist, "ProcessGroupGloo") or "group_src" not in inspect.signature(dist.broadcast).parameters:
        raise RuntimeError("fault tolerance needs torch >= 2.6 (process groups addressed by group rank)")
    settings = FaultToleranceSettings.from_environment()
    membership = None
    if os.environ.get(ENV_JOIN) != "1":
        if rank is None or world_size is None:
            raise ValueError("fault tolerance: the rank and world size are unknown (set RANK and WORLD_SIZE)")
        membership = Membership.start(settings, rank, world_size, master_addr, master_port, timeout=timeout)
    return FaultTolerance(settings, membership, (master_addr, master_port), backend, device, timeout)

"""Training that survives a lost rank without a restart: the JAX front end (native mode, MPI engine).

:class:`FaultTolerantTrainer` drives a :class:`~bagua_jax.trainer.DataParallel` in native mode through the
shared protocol of :mod:`bagua_common.fault_tolerance` (members, epochs, commit by agreement). Each step is a
transaction: the jitted step runs on this rank's part of the next samples, waits for its result, votes ahead
(:meth:`~bagua_common.fault_tolerance.Membership.vote_ahead`: without waiting for the others' votes) and takes
the new state (a JAX step changes nothing in place, so an abandoned one costs nothing to roll back). When a
member dies or hangs, the epoch closes; a thread waiting on it revokes the communicator, so the collective
blocked in the compiled step fails at once; the survivors take the next epoch, shrink the communicator to
themselves (new ranks in the agreed order), admit joiners, give the state of the first member that has it to
the joiners and to any survivor that had not applied the last step (by broadcast over the same communicator),
check that their replicated state is bit-identical, and run the step again on the new partition of the samples
not yet trained on. The communicator's handle stays the same, so a
step whose shapes do not depend on the world size (gradient allreduce, decentralized averaging over all) is not
compiled again; one whose shapes do (ByteGrad and the compressed Adams: chunks per rank) is compiled once per new
world size (:attr:`FaultTolerantTrainer.recoveries` records each recovery's time).

Under DiLoCo each outer exchange is the transaction, and it commits once every member voted (a round commits rarely;
its retry rests on every member knowing the outcome). The inner steps communicate nothing, so the members notice a
death at different inner steps: each trains on to the round's exchange, which fails on every survivor at the same
step, and the survivors run that step again among themselves, with their own pseudo-gradients: no completed inner
step is lost, and the dead member's samples of the round go with its pseudo-gradient. Joiners are admitted at a
round's end; the members wait while the state travels (torch's joiner sits the round out instead).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from bagua_common.algorithms.diloco import DiLoCoConfig
from bagua_common.fault_tolerance import (
    DataPosition,
    Epoch,
    Membership,
    MembershipChanged,
    ReplicaDigest,
    check_digests,
)
from bagua_jax import state_rules
from bagua_jax.native_communicator import NativeCommunicator
from bagua_jax.signature import check_ranks_agree
from bagua_jax.train_state import TrainState, rewrap_state, unwrap_state
from bagua_jax.trainer import DataParallel

__all__ = ["FaultTolerantTrainer"]

# Errors of the native engines that mean "the communicator cannot finish this collective": the step is retried
# in the next epoch. Anything else is the program's own error and is raised.
_COMMUNICATION_FAILURES = ("was revoked", "did not complete within", "unusable after an earlier failure")
_PARTS = (*state_rules.PARTS.values(), "position")


def _communication_failure(error: Exception) -> bool:
    """Whether ``error`` means the step cannot finish with these members (retried in the next epoch)."""
    return isinstance(error, MembershipChanged) or any(text in str(error) for text in _COMMUNICATION_FAILURES)


def _refuse_unsurvivable(trainer: DataParallel) -> None:
    """Raise ValueError naming the fallback unless ``trainer``'s algorithm keeps its replicas identical, or is DiLoCo
    without an overlapped exchange: the decentralized ones and asynchronous averaging let the replicas drift with
    nothing every member holds to go on from, and an overlapped exchange runs on a communicator of its own that a
    change of members does not rebuild."""
    algorithm = trainer.algorithm
    config = algorithm.config
    if isinstance(config, DiLoCoConfig) and config.fragment_sync_delay:
        raise ValueError(
            f"FaultTolerantTrainer cannot continue {config.name} with fragment_sync_delay="
            f"{config.fragment_sync_delay} after a lost member: the overlapped exchange runs on a communicator of its "
            "own, which a change of members does not rebuild. Use fragment_sync_delay=0, or train it with the "
            "elastic restart instead (bagua-launch --nnodes MIN:MAX, restoring the last checkpoint into the new world "
            "size)"
        )
    if not getattr(algorithm, "replicas_identical", False) and not isinstance(config, DiLoCoConfig):
        raise ValueError(
            f"FaultTolerantTrainer cannot continue {config.name} after a lost member: its replicas "
            "differ between the ranks' steps, so there is no state every member holds to go on from. Train it with "
            "the elastic restart instead (bagua-launch --nnodes MIN:MAX, restoring the last checkpoint into the new "
            "world size), or use an algorithm that survives a loss in place: gradient_allreduce, bytegrad, qadam, "
            "onebit_adam, powersgd, diloco"
        )


class FaultTolerantTrainer:
    """A native-mode :class:`DataParallel` (MPI engine) whose steps survive a lost or added member.

    ``membership`` is this process's :class:`~bagua_common.fault_tolerance.Membership` (its first epoch's ranks
    must be the communicator's); ``data`` the job's :class:`~bagua_common.fault_tolerance.DataPosition`;
    ``hash_every`` compares the replicas' digests every that many committed transactions (steps; under DiLoCo,
    exchanges; default: the membership's settings), besides after every recovery. :meth:`init` gives the state (a
    joiner receives it from a member), :meth:`step` runs one step (committed, or a DiLoCo inner step),
    :meth:`finished` marks the job finished after the last one. Algorithms whose replicas are identical
    (``replicas_identical``), and DiLoCo with ``fragment_sync_delay=0``.
    """

    def __init__(
        self,
        trainer: DataParallel,
        membership: Membership,
        data: DataPosition,
        hash_every: int | None = None,
    ):
        _refuse_unsurvivable(trainer)
        communicator = trainer.communicator
        if not isinstance(communicator, NativeCommunicator) or communicator.kind != "mpi":
            raise ValueError("FaultTolerantTrainer needs a DataParallel over the native MPI engine (communicator=)")
        self.trainer, self.membership, self.data = trainer, membership, data
        self.communicator: NativeCommunicator = communicator
        self.hash_every = membership.settings.hash_every if hash_every is None else int(hash_every)
        self.epoch: Epoch = membership.epoch
        if (self.epoch.rank, self.epoch.size) != (int(communicator.rank()), communicator.size):
            raise ValueError(
                f"FaultTolerantTrainer: the communicator is rank {int(communicator.rank())} of {communicator.size} "
                f"but the membership's epoch has this member as rank {self.epoch.rank} of {self.epoch.size}"
            )
        self.committed = self.epoch.committed
        # Gradient allreduce's native step has no buffer laid out per rank (the engine averages over its current
        # size): it runs on every world size as compiled. Other algorithms are compiled again after a change.
        config = trainer.algorithm.config
        self._world_size_free = config.name == "gradient_allreduce"
        self._diloco: DiLoCoConfig | None = config if isinstance(config, DiLoCoConfig) else None
        self._roles: TrainState | None = None
        self.recoveries: list[dict[str, Any]] = []
        """One record per recovery: epoch, size, seconds from the failed step to the retried step's start."""
        self._watch(self.epoch)

    def init(self, params: Any) -> Any:
        """The state to train from: ``trainer.init(params)`` on the first members; a joiner's comes from rank 0."""
        state = self.trainer.init(params)  # checks with the members that everyone trains the same job
        self._roles = state_rules.roles(self.trainer, unwrap_state(state))
        if self.epoch.is_joiner():
            state = self._share_state(state, self.epoch)
            self.check_replicas(state, f"after joining in epoch {self.epoch.number}")
            self.trainer._batches_checked = True  # the members checked their batches before this one came
        return state

    def step(self, state: Any, batch_of: Callable[[np.ndarray], Any]) -> tuple[Any, Any]:
        """One step: ``batch_of(indices)`` builds this rank's batch from the sample indices :attr:`data` assigns it;
        returns the new state and the step's result as :meth:`DataParallel.step` does.

        A step that is a transaction (every step; under DiLoCo, each step that ends with an outer exchange) commits
        by agreement; one abandoned by a membership change is run again, on the new members' partition of the same
        samples, from the last committed state. A DiLoCo inner step runs in a closed epoch too: it communicates
        nothing, and the round's exchange is where the survivors recover.
        """
        failed_at = None
        while True:
            epoch, transaction = self.epoch, self.committed + 1
            exchange = self._is_transaction(state)
            if failed_at is not None:
                self.recoveries[-1]["resume_seconds"] = time.monotonic() - failed_at
            batch = batch_of(self.data.indices(epoch.rank, epoch.size))
            try:
                if epoch.closed.is_set() and (exchange or epoch.ended.is_set()):
                    raise MembershipChanged(f"epoch {epoch.number} closed")
                new_state, result = self.trainer.step(state, batch)
                jax.block_until_ready((new_state, result))
            except Exception as error:  # noqa: BLE001 - communication failures only; the rest is raised
                if not _communication_failure(error):
                    raise
                failed_at = time.monotonic() if failed_at is None else failed_at
                if not epoch.closed.is_set():
                    self.membership.fail(epoch, str(error).splitlines()[0])
                state = self._recover(state)
                continue
            if not exchange:
                self.data.advance(epoch.size)
                return new_state, result
            vote = self.membership.commit if self._diloco is not None else self.membership.vote_ahead
            if vote(epoch, transaction):
                self._apply(epoch)
                if self.hash_every and self.committed % self.hash_every == 0 and not epoch.closed.is_set():
                    try:
                        self.check_replicas(new_state, f"at step {self.committed}")
                    except Exception as error:  # noqa: BLE001 - as above; the recovery checks the replicas
                        if not _communication_failure(error):
                            raise
                        if not epoch.closed.is_set():
                            self.membership.fail(epoch, str(error).splitlines()[0])
                        new_state = self._recover(new_state)
                return new_state, result
            failed_at = time.monotonic() if failed_at is None else failed_at
            state = self._recover(state)

    def finished(self) -> None:
        """Mark the job finished; every member calls it once its last step committed (after its loop). A
        replacement or joiner started afterwards then exits with status 0 instead of waiting to join a job that is
        gone, and ``bagua-launch --fault-tolerant`` starts no replacement for a rank that ends."""
        self.membership.finished()

    def check_replicas(self, state: Any, what: str) -> None:
        """Raise :class:`~bagua_common.fault_tolerance.ReplicaMismatch` on every member unless the replicated state
        (:mod:`bagua_jax.state_rules`: all but error-feedback residuals and an unaveraged model state), the step
        and the data position are bit-identical across the members."""
        digest = ReplicaDigest(_PARTS)
        for part, leaf in state_rules.replicated_leaves(self._roles, jax.device_get(unwrap_state(state))):
            digest.add(part, leaf)
        digest.add("position", np.asarray(self.data.state(), np.int64))
        gathered = self.communicator.allgather(jnp.asarray(digest.digest()))
        check_digests(_PARTS, np.asarray(gathered), what)

    def _is_transaction(self, state: Any) -> bool:
        """Whether the next step of ``state`` is a transaction: every step, or one that ends with DiLoCo's exchange."""
        if self._diloco is None:
            return True
        return bool(self._diloco.exchanges_after(int(unwrap_state(state).step) + 1))

    def _apply(self, epoch: Epoch) -> None:
        self.committed += 1
        self.data.advance(epoch.size)

    def _watch(self, epoch: Epoch) -> None:
        """Revoke this epoch's communicator the moment the epoch closes, from a thread: the training thread may be
        blocked in a collective with a member that will never arrive. The thread holds its own handle of this
        epoch's communicator, so a late wake-up never revokes the next epoch's."""
        own = self.communicator.handle_copy()
        engine = self.communicator.engine

        def revoke_when_closed() -> None:
            epoch.closed.wait()
            engine.revoke(own, f"the job's membership changed (epoch {epoch.number} closed)")
            engine.destroy(own)

        threading.Thread(target=revoke_when_closed, name=f"bagua-ft-revoke-{epoch.number}", daemon=True).start()

    def _recover(self, state: Any) -> Any:
        """Take the next epoch and rebuild the communicator for it; returns the state to go on from (a survivor
        that had not applied a step another one applied is given that one's state)."""
        started = time.monotonic()
        old = self.epoch
        new = self.membership.recover(old).epoch
        old_ids = [m.id for m in old.members]
        survivors = [old_ids.index(m.id) for m in new.members if m.id in old_ids]
        if len(survivors) < old.size:
            self.communicator.shrink(survivors)
        if new.size > len(survivors):
            self.communicator.grow(new.store, new.prefix("mpi/"), new.size)
        self.epoch = new
        self._watch(new)
        state = self._carry_over(state, recompile=new.size != old.size and not self._world_size_free)
        if new.joined:
            check_ranks_agree(unwrap_state(state).params, self.trainer.algorithm, self.communicator)
            state = self._share_state(state, new)
        self.check_replicas(state, f"after the recovery to epoch {new.number}")
        self.recoveries.append({"epoch": new.number, "size": new.size, "rebuild_seconds": time.monotonic() - started})
        return state

    def _carry_over(self, state: Any, recompile: bool) -> Any:
        """``state`` for the new members by the algorithm's rules (:mod:`bagua_jax.state_rules`): the per-rank
        leaves (error-feedback residuals) from a fresh state, the rest kept; the step is compiled again first when
        its buffers are laid out for the world size."""
        if recompile:
            self.trainer.recompile()
        own = unwrap_state(state)
        fresh = TrainState(own.params, self.trainer._init(own.params), own.step, own.model_state)
        carried = state_rules.carry_over(self._roles, own, fresh)
        return rewrap_state(None if isinstance(state, TrainState) else state, carried)

    def _share_state(self, state: Any, epoch: Epoch) -> Any:
        """The first member that has the committed state (:attr:`Epoch.state_holder`) broadcasts it (everyone takes
        part) to those that need it: the joiners, and survivors that had not applied the last step. The data
        position and the transaction number travel in the epoch's store. Returns the state to go on from."""
        holder, key = epoch.state_holder, epoch.prefix("transfer")
        if epoch.rank == holder:
            epoch.store.set(key, json.dumps({"committed": self.committed, "position": self.data.state()}))
        received = self._broadcast_state(state, holder)
        if not epoch.is_joiner():
            return state
        raw = epoch.store.get(key, wait=self.membership.settings.quorum_timeout)
        if raw is None:
            raise TimeoutError(f"fault tolerance: no state record for the joiners of epoch {epoch.number}")
        record = json.loads(raw)
        self.committed = int(record["committed"])
        self.data.load_state(record["position"])
        self.membership.applied(self.committed)
        return received

    def _broadcast_state(self, state: Any, root: int) -> Any:
        own = unwrap_state(state)
        received = jax.tree.map(
            lambda leaf: self.communicator.broadcast(leaf, root), (own.params, own.opt_state, own.step)
        )
        return TrainState(*received, own.model_state)

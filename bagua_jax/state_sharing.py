"""A fault-tolerant JAX job's admission, from the state's side: who is given the committed state, how, and what a
joiner does with it (:class:`StateSharing`, the part of :class:`~bagua_jax.fault_tolerance.FaultTolerantTrainer`
that runs once per admission).

The state's holder (:attr:`Epoch.state_holder`) gives it to the joiners (and to survivors behind the others) while
the members go on training where the algorithm lets them: over a communicator of the holder and the joiners, split
from the job's at the admission, while the joiners take their first step weighed out (gradient allreduce, PowerSGD)
or sit it out ((low-precision) decentralized); by a broadcast while the members train the DiLoCo round the joiners
sit out; else while everyone waits (Streaming DiLoCo, which sits a joiner out for a step)."""

from __future__ import annotations

import json
from functools import partial
from typing import Any

import numpy as np

from bagua_common.fault_tolerance import Epoch
from bagua_common.fault_tolerance.background import in_background
from bagua_common.job.signature import check_same_job
from bagua_jax import state_transfer
from bagua_jax.algorithms.diloco import skip_untrained
from bagua_jax.host_communicator import HostCommunicator
from bagua_jax.signature import job_signature
from bagua_jax.train_state import TrainState, rewrap_state, unwrap_state

__all__ = ["StateSharing"]


class StateSharing:
    """The state's sharing at an admission, mixed into :class:`~bagua_jax.fault_tolerance.FaultTolerantTrainer`,
    whose attributes it reads (the trainer, communicator, membership, data, the algorithm's steps and rules) and
    whose ``_sitting_out``, ``_transfer``, ``_incoming`` and ``committed`` it sets."""

    @property
    def _state_travels_over_a_group(self) -> bool:
        """Whether joiners take their first step while their state travels (weighed out of it, or sitting it out), over
        a communicator of the holder and the joiners, rather than by a broadcast on the job's."""
        return self._weighed_out_step is not None or self._unaveraged_step is not None

    def _split_state_group(self, epoch: Epoch) -> None:
        """At an admission, on every rank before it compiles anything: the holder's and joiners' communicator (that of
        an admission whose members changed before the state went is closed)."""
        if self._state_group is not None:
            self._state_group.close()
        grouped = epoch.joined and self._state_travels_over_a_group
        self._state_group = state_transfer.transfer_group(self.communicator, epoch) if grouped else None

    def _share_state(self, state: Any, epoch: Epoch) -> Any:
        """The holder gives the committed state to joiners and survivors behind, having checked they train the same
        job (position, who sits out: through the store); the algorithm's replicated state first, through the store,
        for a joiner weighed out of its first step. Returns this rank's state to go on from."""
        holder, key = epoch.state_holder, epoch.prefix("transfer")
        weighed, grouped = self._weighed_out_step is not None, self._state_travels_over_a_group
        if self._sits_out or grouped or (self._diloco is not None and self._is_transaction(state)):
            self._sitting_out |= {member.id for rank, member in enumerate(epoch.members) if epoch.is_joiner(rank)}
        if epoch.rank == holder:  # the algorithm's replicated state first: the record says both are there
            if weighed:
                epoch.store.set(f"{key}/algorithm", state_transfer.algorithm_state_bytes(self._roles, state))
            record = {
                "committed": self.committed,
                "position": self.data.state(),
                "sitting_out": sorted(self._sitting_out),
            }
            epoch.store.set(key, json.dumps(record))
        host = HostCommunicator(self.communicator)
        signature = job_signature(unwrap_state(state).params, self.trainer.algorithm)

        def broadcast() -> np.ndarray:
            check_same_job(signature, lambda x: np.asarray(host.allgather(x)))
            return state_transfer.broadcast_state(host, state, holder)

        group, self._state_group = self._state_group, None
        in_group = partial(state_transfer.transfer_in_group, group, epoch, state, signature)
        if not epoch.is_joiner():
            if group is not None:  # the holder
                self._transfer = in_background(in_group, "bagua-ft-state")
            elif self._sits_out:
                self._transfer = in_background(broadcast, f"bagua-ft-transfer-{epoch.number}")
            elif not grouped:
                broadcast()
            return state
        if weighed:
            self._incoming = in_background(in_group, "bagua-ft-state")
        else:
            received = state_transfer.state_from_bytes(in_group() if grouped else broadcast(), state)
        raw = epoch.store.get(key, wait=self.membership.settings.quorum_timeout)
        if raw is None:
            raise TimeoutError(f"fault tolerance: no state record for the joiners of epoch {epoch.number}")
        record, user_state = json.loads(raw), None if isinstance(state, TrainState) else state  # flax's comes back
        self.committed = int(record["committed"])
        self.data.load_state(record["position"])
        self._sitting_out = frozenset(record["sitting_out"])
        if weighed:  # applied once its first step commits: a change before then gives it the state again
            algorithm = state_transfer.with_algorithm_state(epoch.store.get(f"{key}/algorithm"), self._roles, state)
            return rewrap_state(user_state, algorithm)
        if self._sitting_out:  # applied once its first exchange commits: a change before then gives it the state again
            return rewrap_state(user_state, self._sit_out(received))
        self.membership.applied(self.committed)
        return rewrap_state(user_state, received)

    def _sit_out(self, state: TrainState) -> TrainState:
        """``state`` (just received) at the step before the exchange it joins, marked untrained, the data past it."""
        skipped = 0 if self._is_transaction(state) else self._diloco.steps_to_exchange(int(state.step)) - 1
        for _ in range(skipped):
            self.data.advance(self._training_place(self.epoch)[1])
        return state._replace(opt_state=skip_untrained(state.opt_state, skipped), step=state.step + skipped)

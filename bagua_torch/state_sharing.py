"""A fault-tolerant torch job's admission, from the state's side (:class:`StateSharing`, the part of
:class:`~bagua_torch.fault_tolerance.FaultTolerance` that runs as an epoch with joiners is entered): who gives the
committed state to whom, and how the members train while it travels (:mod:`bagua_torch.state_transfer` moves it).
The same concept as :mod:`bagua_jax.state_sharing`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bagua_common.fault_tolerance import DataPosition, Epoch, Membership, MembershipChanged
from bagua_torch import state_transfer
from bagua_torch.algorithms.base import WeighedOut
from bagua_torch.communicator.epoch_groups import trainers_communicator

if TYPE_CHECKING:
    import torch

    from bagua_torch.bagua_module import BaguaModule

__all__ = ["StateSharing"]


class StateSharing:
    """The state's sharing at an admission, mixed into :class:`~bagua_torch.fault_tolerance.FaultTolerance`, whose
    attributes it reads (epoch, membership, models, data, link) and whose ``step``, ``committed``, ``_sitting_out``,
    ``_weighed_out`` and ``_incoming`` it sets."""

    epoch: Epoch | None
    membership: Membership | None
    modules: list[BaguaModule]
    data: DataPosition | None
    backend: str
    device: torch.device
    timeout: float
    group: Any
    step: int
    committed: int

    def _receive_or_send_state(self) -> None:
        """The first member that has the job's state sends it to each one that needs it (a joiner, or a survivor
        that had not applied the last step): :mod:`bagua_torch.state_transfer`. Under gradient allreduce a receiver
        takes part in the next step weighed out while the state travels; under DiLoCo (one fragment) it sits out the
        round in flight and joins its exchange with an uncounted zero pseudo-gradient; under (low-precision)
        decentralized training it sits out the next step, which the members train without exchanging weights (both:
        :attr:`_sitting_out`); otherwise the members wait for the transfer."""
        epoch = self.epoch
        assert epoch is not None and self.membership is not None
        receivers = tuple(r for r in range(epoch.size) if epoch.is_joiner(r))
        link = (self.backend, self.device, self.timeout)
        sit_out = state_transfer.steps_to_sit_out(self.modules)
        scales = state_transfer.weighed_out_scales(self.modules, epoch.size - len(receivers))
        if sit_out and epoch.rank not in receivers:
            for module in self.modules:
                module.algorithm_impl.others_sit_out(sit_out)
            if self.group is not None:  # the loop's collectives: the trainers', before the state goes
                self.group.use(trainers_communicator(epoch, receivers, self.backend, self.timeout))
        if epoch.rank == epoch.state_holder:
            state = state_transfer.job_state(self.step, self.committed, self.data, self.modules)
            if scales:  # the position first, the rest while they take their first step weighed out
                send = state_transfer.send_position_then_state
            else:  # while they sit out the round, or while everyone waits
                send = state_transfer.send_state if sit_out is None else state_transfer.send_state_in_background
            send(epoch, receivers, state, state_transfer.replicated_tensors(self.modules), *link)
        elif epoch.rank in receivers and scales:  # its state arrives during its first step
            self._incoming = state_transfer.IncomingState(epoch, self.modules, *link)
            self.step, self.committed = state_transfer.load_job_state(self._incoming.position, self.data, self.modules)
        elif epoch.rank in receivers:
            received = state_transfer.receive_state(epoch, state_transfer.replicated_tensors(self.modules), *link)
            self.step, self.committed = state_transfer.load_job_state(received, self.data, self.modules)
            sit_out = state_transfer.steps_to_sit_out(self.modules)  # as the holder's state has it
            if sit_out is None:
                self.membership.applied(self.committed)
            else:  # applied once its first exchange commits: a change before then gives it the state again
                self._sitting_out = receivers
                for _ in range(sit_out):
                    self._step_done()
                for module in self.modules:
                    module.algorithm_impl.sit_out(sit_out)
        if scales or sit_out is not None:
            self._sitting_out, self._weighed_out = receivers, bool(scales)
        for module, scale in zip(self.modules, scales or ()):
            module.algorithm_impl.weighed_out = WeighedOut(epoch.rank not in receivers, scale)
        if sit_out and epoch.rank in receivers and all(m.algorithm_impl.transaction_per_step for m in self.modules):
            for _ in range(sit_out):  # decentralized: the members commit the step it sat out once it voted
                if not self.commit():
                    raise MembershipChanged(f"step {self.committed + 1} was not committed: the members changed")

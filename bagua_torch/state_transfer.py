"""A fault-tolerant torch job's state, sent by the member that holds it to one that needs it (a joiner, or a
survivor behind the others) over a process group of the two, never through a file.

The state: the step, the transactions committed, the data position and, per wrapped model, its
parameters and buffers, its optimizers' state and its algorithm's carried state. The holder sends
it while the others wait, or, where the algorithm lets the receiver sit out until its next exchange
(DiLoCo's round, :meth:`~bagua_torch.algorithms.base.AlgorithmImpl.steps_to_next_exchange`), sends a
copy from a thread while the others train. Where the algorithm can leave a rank's gradients out of
the average (:meth:`~bagua_torch.algorithms.base.AlgorithmImpl.weighed_out_scale`), the holder
sends the position (step, transactions, data) and the algorithms' carried state at once, and the
rest from a thread: the receiver takes part in the next step, weighed out, and loads the rest
before its optimizer applies it (:class:`IncomingState`).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from bagua_common.fault_tolerance import DataPosition, Epoch, MembershipChanged
from bagua_common.fault_tolerance.background import in_background, wait_unless
from bagua_torch.broadcast import broadcast_structure, broadcast_tensors
from bagua_torch.communicator import CommunicationError
from bagua_torch.communicator.abandon import caused_by_a_change
from bagua_torch.communicator.epoch_groups import pair_communicator
from bagua_torch.replica_check import model_tensors

if TYPE_CHECKING:
    from bagua_torch.bagua_module import BaguaModule

__all__ = [
    "IncomingState",
    "job_state",
    "load_job_state",
    "receive_state",
    "replicated_tensors",
    "send_position_then_state",
    "send_state",
    "send_state_in_background",
    "steps_to_sit_out",
    "weighed_out_scales",
]

_POSITION = ("step", "committed", "position", "algorithms")
"""What a joiner weighed out of its first step needs before that step: where the job is, and the algorithms' carried
state, which decides what the step computes (PowerSGD's step count and ``Q``: a few kB)."""


def job_state(step: int, committed: int, data: DataPosition | None, modules: Sequence[BaguaModule]) -> dict[str, Any]:
    """The state a receiver loads (:func:`load_job_state`); the tensors it holds are the live ones."""
    return {
        "step": step,
        "committed": committed,
        "position": None if data is None else data.state(),
        "algorithms": [m.algorithm_impl.carried_state() for m in modules],
        "optimizers": [[opt.state_dict() for opt in m.stepping_optimizers] for m in modules],
    }


def load_job_state(state: dict[str, Any], data: DataPosition | None, modules: Sequence[BaguaModule]) -> tuple[int, int]:
    """Load :func:`job_state`'s ``state`` into ``data`` and ``modules``: its data position, algorithms' and optimizers'
    state, each where it has one; returns its step and transactions committed."""
    if data is not None and state["position"] is not None:
        data.load_state(state["position"])
    _load_models_state(state, modules)
    return int(state["step"]), int(state["committed"])


def _load_models_state(state: dict[str, Any], modules: Sequence[BaguaModule]) -> None:
    for module, carried in zip(modules, state.get("algorithms", ())):
        module.algorithm_impl.load_carried_state(carried)
        module.algorithm_impl.received()
    for module, optimizers_state in zip(modules, state.get("optimizers", ())):
        for optimizer, optimizer_state in zip(module.stepping_optimizers, optimizers_state):
            optimizer.load_state_dict(optimizer_state)


def replicated_tensors(modules: Sequence[BaguaModule]) -> list[torch.Tensor]:
    """Every model's parameters and buffers, in a fixed order."""
    return [t for module in modules for t in model_tensors(module)]


def steps_to_sit_out(modules: Sequence[BaguaModule]) -> int | None:
    """How many steps a member given the state now sits out before it joins an exchange without having trained
    (the same for every wrapped model), or None: the algorithm needs the state before the next step."""
    steps = {module.algorithm_impl.steps_to_next_exchange() for module in modules}
    return steps.pop() if len(steps) == 1 and None not in steps else None


def weighed_out_scales(modules: Sequence[BaguaModule], trainers: int) -> list[float] | None:
    """Per wrapped model, the factor that averages its reduced gradients over ``trainers`` ranks, the others
    contributing zeros; None unless every model's algorithm can leave a rank out so."""
    scales = [module.algorithm_impl.weighed_out_scale(trainers) for module in modules]
    return None if None in scales else scales


def send_state(
    epoch: Epoch,
    receivers: Sequence[int],
    state: dict[str, Any],
    tensors: list[torch.Tensor],
    backend: str,
    device: torch.device,
    timeout: float,
) -> None:
    """Send ``state`` and ``tensors`` (:func:`replicated_tensors`) to each of ``receivers`` in turn, from this
    member (the epoch's state holder), each over a group of the two."""
    for receiver in receivers:
        pair = pair_communicator(epoch, epoch.rank, receiver, backend, timeout)
        broadcast_structure(state, pair, device)
        broadcast_tensors(pair, tensors)


def send_state_in_background(
    epoch: Epoch, receivers: Sequence[int], state: dict[str, Any], tensors: list[torch.Tensor], *link: Any
) -> None:
    """:func:`send_state` of a copy of ``state`` and ``tensors`` taken now, from a thread; a lost member ends it
    quietly (the epoch failed: the next one gives the state again). ``link``: send_state's last three arguments."""
    snapshot = copy.deepcopy(state), [t.detach().clone() for t in tensors]

    def send() -> None:
        try:
            send_state(epoch, receivers, *snapshot, *link)
        except (MembershipChanged, CommunicationError):
            pass

    threading.Thread(target=send, name="bagua-ft-state", daemon=True).start()


def send_position_then_state(
    epoch: Epoch, receivers: Sequence[int], state: dict[str, Any], tensors: list[torch.Tensor], *link: Any
) -> None:
    """For :class:`IncomingState`: send each of ``receivers`` the position of ``state`` and its algorithms' state now,
    then :func:`send_state_in_background` the optimizers' state and ``tensors``. ``link``: send_state's last three
    arguments."""
    backend, device, timeout = link
    for receiver in receivers:
        pair = pair_communicator(epoch, epoch.rank, receiver, backend, timeout, purpose="position")
        broadcast_structure({key: state[key] for key in _POSITION}, pair, device)
    send_state_in_background(epoch, receivers, {"optimizers": state["optimizers"]}, tensors, *link)


class IncomingState:
    """What :func:`send_position_then_state` sends this joiner: ``position`` (step, transactions, data, the algorithms'
    state; for :func:`load_job_state` before the step) at once, and the rest received from a thread into copies of
    the models' tensors while the joiner's first step runs; :meth:`load` waits for it and loads it."""

    def __init__(
        self, epoch: Epoch, modules: Sequence[BaguaModule], backend: str, device: torch.device, timeout: float
    ):
        pair = pair_communicator(epoch, epoch.state_holder, epoch.rank, backend, timeout, purpose="position")
        self.position: dict[str, Any] = broadcast_structure(None, pair, device)
        self._epoch, self._modules = epoch, modules
        self._copies = [t.detach().clone() for t in replicated_tensors(modules)]
        self._rest = in_background(
            lambda: receive_state(epoch, self._copies, backend, device, timeout), f"bagua-ft-state-{epoch.number}"
        )

    def load(self) -> None:
        """Wait for the rest of the state and load it into the models: MembershipChanged if a lost member stopped
        it, or once the epoch failed (a holder that hangs holds the transfer up to its timeout); any other error is
        raised as it was."""
        why = "the joiner's state did not arrive: the members changed"
        try:
            rest = wait_unless(self._rest, self._epoch.failed, why)
        except MembershipChanged:
            raise
        except Exception as error:
            if caused_by_a_change(error):
                raise MembershipChanged(f"the joiner's state did not arrive: {error}") from error
            raise
        with torch.no_grad():
            for tensor, received in zip(replicated_tensors(self._modules), self._copies):
                tensor.copy_(received)
        _load_models_state(rest, self._modules)


def receive_state(
    epoch: Epoch, tensors: list[torch.Tensor], backend: str, device: torch.device, timeout: float
) -> dict[str, Any]:
    """Receive the state from the epoch's holder: ``tensors`` (:func:`replicated_tensors`) are overwritten; returns
    the rest, for :func:`load_job_state`."""
    pair = pair_communicator(epoch, epoch.state_holder, epoch.rank, backend, timeout)
    state = broadcast_structure(None, pair, device)
    broadcast_tensors(pair, tensors)
    return state

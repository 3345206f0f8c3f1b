"""A fault-tolerant torch job's state, sent by the member that holds it to one that needs it (a joiner, or a
survivor behind the others) over a process group of the two, never through a file.

The state: the step, the transactions committed, the data position and, per wrapped model, its
parameters and buffers, its optimizers' state and its algorithm's carried state. The holder sends
it while the others wait, or, where the algorithm lets the receiver sit out until its next exchange
(DiLoCo's round, :meth:`~bagua_torch.algorithms.base.AlgorithmImpl.steps_to_next_exchange`), sends a
copy from a thread while the others train.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from bagua_common.fault_tolerance import DataPosition, Epoch, MembershipChanged
from bagua_torch.broadcast import broadcast_structure, broadcast_tensors
from bagua_torch.communicator import CommunicationError
from bagua_torch.communicator.epoch_groups import pair_communicator
from bagua_torch.replica_check import model_tensors

if TYPE_CHECKING:
    from bagua_torch.bagua_module import BaguaModule

__all__ = [
    "job_state",
    "load_job_state",
    "receive_state",
    "replicated_tensors",
    "send_state",
    "send_state_in_background",
    "steps_to_sit_out",
]


def job_state(step: int, committed: int, data: DataPosition | None, modules: Sequence[BaguaModule]) -> dict[str, Any]:
    """The state a receiver loads (:func:`load_job_state`); the tensors it holds are the live ones."""
    return {
        "step": step,
        "committed": committed,
        "position": None if data is None else data.state(),
        "modules": [
            {"optimizers": [opt.state_dict() for opt in m.optimizers], "algorithm": m.algorithm_impl.carried_state()}
            for m in modules
        ],
    }


def load_job_state(state: dict[str, Any], data: DataPosition | None, modules: Sequence[BaguaModule]) -> tuple[int, int]:
    """Load :func:`job_state`'s ``state`` into ``data`` and ``modules``; returns its step and transactions committed."""
    if data is not None and state["position"] is not None:
        data.load_state(state["position"])
    for module, saved in zip(modules, state["modules"]):
        for optimizer, optimizer_state in zip(module.optimizers, saved["optimizers"]):
            optimizer.load_state_dict(optimizer_state)
        module.algorithm_impl.load_carried_state(saved["algorithm"])
    return int(state["step"]), int(state["committed"])


def replicated_tensors(modules: Sequence[BaguaModule]) -> list[torch.Tensor]:
    """Every model's parameters and buffers, in a fixed order."""
    return [t for module in modules for t in model_tensors(module)]


def steps_to_sit_out(modules: Sequence[BaguaModule]) -> int | None:
    """How many steps a member given the state now sits out before it joins an exchange without having trained
    (the same for every wrapped model), or None: the algorithm needs the state before the next step."""
    steps = {module.algorithm_impl.steps_to_next_exchange() for module in modules}
    return steps.pop() if len(steps) == 1 and None not in steps else None


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


def receive_state(
    epoch: Epoch, modules: Sequence[BaguaModule], backend: str, device: torch.device, timeout: float
) -> dict[str, Any]:
    """Receive the state from the epoch's holder: the models' tensors are overwritten; returns the rest, for
    :func:`load_job_state`."""
    pair = pair_communicator(epoch, epoch.state_holder, epoch.rank, backend, timeout)
    state = broadcast_structure(None, pair, device)
    broadcast_tensors(pair, replicated_tensors(modules))
    return state

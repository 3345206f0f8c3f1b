"""The check that a fault-tolerant torch job's replicas are bit-identical (the digest itself is shared:
:mod:`bagua_common.fault_tolerance.replica_hash`). Hashed: the step and data position, and, per wrapped model,
its parameters, buffers and optimizer state where its algorithm keeps them replicated, and the algorithm's own
replicated tensors (PowerSGD's ``Q``, DiLoCo's round start)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from bagua_common.fault_tolerance import ReplicaDigest, check_digests
from bagua_torch.communicator import ProcessGroupCommunicator

if TYPE_CHECKING:
    from bagua_torch.bagua_module import BaguaModule

__all__ = ["PARTS", "check_replicas", "model_tensors"]

PARTS = ("position", "parameters", "optimizer", "algorithm")
"""The parts of the replicated state the check hashes (and names when they differ)."""


def model_tensors(module: BaguaModule) -> list[torch.Tensor]:
    """``module``'s parameters, then its buffers, in a fixed order."""
    return [p for _, p in module.module.named_parameters()] + [b for _, b in module.module.named_buffers()]


def check_replicas(
    world: ProcessGroupCommunicator,
    device: torch.device,
    modules: Sequence[BaguaModule],
    position: Sequence[int],
    when: str,
) -> None:
    """Hash this member's replicated state (``position``: the step, the transactions and the data position) and
    compare it across ``world`` (collective; the digests travel on ``device``): ReplicaMismatch on every member,
    naming ``when`` and the parts that differ, unless every part is bit-identical."""
    digest = ReplicaDigest(PARTS)
    digest.add("position", np.array(position))
    for module in modules:
        config = module.algorithm.config_class
        if config is not None and config.replicated:
            for tensor in model_tensors(module):
                digest.add("parameters", _bytes(tensor))
            for optimizer in module.stepping_optimizers:
                for state in optimizer.state_dict()["state"].values():
                    for value in state.values():
                        if isinstance(value, torch.Tensor):
                            digest.add("optimizer", _bytes(value))
        for tensor in module.algorithm_impl.replicated_tensors():
            digest.add("algorithm", _bytes(tensor))
    gathered = world.allgather(torch.from_numpy(digest.digest()).to(device)).cpu().numpy()
    check_digests(PARTS, gathered, when)


def _bytes(tensor: torch.Tensor) -> np.ndarray:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else np.zeros(0, np.uint8)

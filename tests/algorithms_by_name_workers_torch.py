"""Rank bodies for test_algorithms_by_name_torch.py: every PyTorch entry point trains with an algorithm given by its
name and options, and again with the algorithm object built with the same options.

Each rank fits one shared linear map on inputs of its own, the same batch every step, so its loss falls; the ranks'
inputs differ, so their parameters drift apart between the steps that synchronize them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gradient_allreduce_bytegrad_workers_torch import loss_fn, make_mlp, make_optimizer, params_of
from torch import nn

STEPS = 12


def batch(seed: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs ``[8, 10]`` and their images under the map every rank fits."""
    x = torch.randn(8, 10, generator=torch.Generator().manual_seed(seed * 1009 + rank))
    target_map = torch.randn(10, 3, generator=torch.Generator().manual_seed(seed)) / 3
    return x, x @ target_map


def _with_bagua(by_name: bool, model: nn.Module, optimizer: torch.optim.Optimizer):
    import bagua_torch
    from bagua_torch.algorithms import DiLoCoAlgorithm

    if by_name:
        wrapped = bagua_torch.with_bagua(model, [optimizer], "diloco", sync_every=5)
    else:
        wrapped = bagua_torch.with_bagua(model, [optimizer], DiLoCoAlgorithm(sync_every=5))
    return wrapped, wrapped.close, wrapped.algorithm


def _distributed_data_parallel(by_name: bool, model: nn.Module, optimizer: torch.optim.Optimizer):
    import bagua_torch
    from bagua_torch.algorithms import ByteGradAlgorithm

    if by_name:
        options = {"algorithm": "bytegrad", "error_feedback": True}
    else:
        options = {"algorithm": ByteGradAlgorithm(error_feedback=True)}
    wrapped = bagua_torch.DistributedDataParallel(model, optimizers=[optimizer], **options)
    return wrapped, wrapped.close, wrapped.algorithm


def _qadam(by_name: bool, model: nn.Module, optimizer: torch.optim.Optimizer):
    import bagua_torch
    from bagua_torch.algorithms import QAdamAlgorithm, QAdamOptimizer

    own = QAdamOptimizer(model.parameters(), lr=0.01, warmup_steps=4)
    wrapped = bagua_torch.with_bagua(model, [own], "qadam" if by_name else QAdamAlgorithm(own))
    return wrapped, wrapped.close, wrapped.algorithm, own


def _bagua_with_bagua(by_name: bool, model: nn.Module, optimizer: torch.optim.Optimizer):
    import bagua_torch.torch_api as bagua
    from bagua_torch.torch_api.algorithms.decentralized import DecentralizedAlgorithm

    if by_name:
        wrapped = model.with_bagua([optimizer], "decentralized", peer_selection_mode="shift_one")
    else:
        wrapped = model.with_bagua([optimizer], DecentralizedAlgorithm(peer_selection_mode="shift_one"))
    assert isinstance(wrapped, bagua.distributed.BaguaModule)
    return wrapped, wrapped.close, wrapped.algorithm


def _bagua_distributed_data_parallel(by_name: bool, model: nn.Module, optimizer: torch.optim.Optimizer):
    from bagua_torch.torch_api.algorithms.decentralized import LowPrecisionDecentralizedAlgorithm
    from bagua_torch.torch_api.data_parallel import DistributedDataParallel

    if by_name:
        options = {"algorithm": "low_precision_decentralized", "communication_interval": 2}
    else:
        options = {"algorithm": LowPrecisionDecentralizedAlgorithm(communication_interval=2)}
    wrapped = DistributedDataParallel(model, optimizers=[optimizer], **options)
    return wrapped, wrapped.close, wrapped.algorithm


def _comm_hook_state(by_name: bool, model: nn.Module, optimizer: torch.optim.Optimizer):
    from bagua_torch.algorithms import PowerSGDAlgorithm
    from bagua_torch.ddp_hooks import CommHookState, powersgd_hook

    ddp = nn.parallel.DistributedDataParallel(model)
    if by_name:
        state = CommHookState("powersgd", model, rank=1, start_iter=2)
    else:
        state = CommHookState(PowerSGDAlgorithm(rank=1, start_iter=2), model)
    ddp.register_comm_hook(state, powersgd_hook)
    return ddp, state.close, state.algorithm


ENTRY_POINTS = {
    "with_bagua diloco": _with_bagua,
    "DistributedDataParallel bytegrad": _distributed_data_parallel,
    "with_bagua qadam": _qadam,
    "bagua with_bagua decentralized": _bagua_with_bagua,
    "bagua DistributedDataParallel low_precision_decentralized": _bagua_distributed_data_parallel,
    "CommHookState powersgd": _comm_hook_state,
}


def _run(wrap: Callable, by_name: bool, seed: int, rank: int) -> dict:
    model = make_mlp(seed)
    optimizer = make_optimizer(model)
    wrapped, close, algorithm, *own = wrap(by_name, model, optimizer)
    optimizer = own[0] if own else optimizer  # QAdam's own
    x, y = batch(seed, rank)
    losses, history = [], []
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = loss_fn(wrapped, x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        history.append(np.concatenate([p.ravel() for p in params_of(model).values()]))
    close()
    return {"losses": losses, "history": history, "config": repr(algorithm.config)}


def every_entry_point(seed: int) -> dict:
    """Per entry point: ``{"name": run, "object": run}``, each run its losses, parameters after each step and the
    wrapper's algorithm configuration."""
    torch.set_num_threads(1)
    import bagua_torch.torch_api as bagua

    bagua.init_process_group()
    rank = bagua.get_rank()
    return {
        entry: {form: _run(wrap, form == "name", seed, rank) for form in ("name", "object")}
        for entry, wrap in ENTRY_POINTS.items()
    }

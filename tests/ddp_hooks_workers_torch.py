"""Rank bodies for test_ddp_hooks_torch.py: torch's DDP (plain and prepared by HF Accelerate) with Bagua's
communication hooks, against the project's own wrapper with the same algorithm, same data and seed."""

from __future__ import annotations

import io

import numpy as np
import torch
from gradient_allreduce_bytegrad_workers_torch import batch, loss_fn, make_mlp, make_optimizer, params_of
from torch import nn

STEPS = 4
ALGORITHMS = {
    "gradient_allreduce": {},
    "gradient_allreduce/hierarchical": {"hierarchical": True},
    "bytegrad": {"hierarchical": False},
    "bytegrad/error_feedback": {"error_feedback": True},
    "powersgd": {"rank": 2, "start_iter": 1},
}


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int, steps: range, rank: int, backward=None):
    for step in steps:
        x, y = batch(seed, step, rank)
        optimizer.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward() if backward is None else backward(loss)
        optimizer.step()


def _hooked(seed: int, name: str):
    from bagua_torch.ddp_hooks import HOOKS, CommHookState

    algorithm = name.split("/")[0]
    model = make_mlp(seed)
    ddp = nn.parallel.DistributedDataParallel(model)
    state = CommHookState(algorithm, model, **ALGORITHMS[name])
    ddp.register_comm_hook(state, HOOKS[algorithm])
    return model, ddp, state, make_optimizer(model)


def hooks_match_the_wrapper(seed: int) -> dict:
    """Per algorithm: the parameters after DDP with the hook, after ``with_bagua``, after Accelerate's DDP with the
    hook, and the checkpoint round trip of the hook's state (resumed with and without it)."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    import bagua_torch
    from bagua_torch.algorithms import get_algorithm

    bagua_torch.init_process_group(timeout=60)
    rank = dist.get_rank()
    out = {"initial": params_of(make_mlp(seed))}
    for name in ALGORITHMS:
        algorithm = name.split("/")[0]
        model, ddp, state, opt = _hooked(seed, name)
        _train(ddp, opt, seed, range(STEPS), rank)
        out[f"{name}/hook"] = params_of(model)
        checkpoint = io.BytesIO()
        torch.save({"model": ddp.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}, checkpoint)
        _train(ddp, opt, seed, range(STEPS, 2 * STEPS), rank)
        out[f"{name}/continued"] = params_of(model)
        state.close()
        for with_state in (True, False):
            model, ddp, state, opt = _hooked(seed + 1, name)
            checkpoint.seek(0)
            saved = torch.load(checkpoint)
            ddp.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            if with_state:
                state.load_state_dict(saved["hook"])
            _train(ddp, opt, seed, range(STEPS, 2 * STEPS), rank)
            out[f"{name}/resumed" + ("" if with_state else "_without_state")] = params_of(model)
            state.close()

        model = make_mlp(seed)
        opt = make_optimizer(model)
        wrapped = bagua_torch.with_bagua(model, [opt], get_algorithm(algorithm, **ALGORITHMS[name]))
        out[f"{name}/buckets"] = len(wrapped.buckets)
        _train(wrapped, opt, seed, range(STEPS), rank)
        out[f"{name}/wrapper"] = params_of(model)
        wrapped.close()
    out["accelerate"] = _through_accelerate(seed, rank)
    out["communicator"] = type(bagua_torch.get_process_group().world).__name__
    return out


def _through_accelerate(seed: int, rank: int) -> dict[str, np.ndarray]:
    """ByteGrad with error feedback registered on the DDP model ``accelerator.prepare`` returns."""
    from accelerate import Accelerator

    from bagua_torch.ddp_hooks import CommHookState, bytegrad_hook

    accelerator = Accelerator(cpu=True)
    torch.set_num_threads(1)  # Accelerate sets one per core; the wrapper's run had one (matmul rounding)
    model = make_mlp(seed)
    prepared, opt = accelerator.prepare(model, make_optimizer(model))
    if not isinstance(prepared, nn.parallel.DistributedDataParallel):
        raise AssertionError(f"accelerate prepared a {type(prepared).__name__}, not DDP")
    state = CommHookState("bytegrad", prepared.module, **ALGORITHMS["bytegrad/error_feedback"])
    prepared.register_comm_hook(state, bytegrad_hook)
    _train(prepared, opt, seed, range(STEPS), rank, backward=accelerator.backward)
    state.close()
    return params_of(model)

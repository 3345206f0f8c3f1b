"""Rank bodies for test_fused_optimizer_torch.py: a fused optimizer stepping a wrapped model's buckets."""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn

STEPS = 6
SMALL_BUCKET = 1500  # bytes: the MLP below gets 3 buckets, the first cut by the two param groups


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))


def make_adam(model: nn.Module) -> torch.optim.Optimizer:
    """Two groups that cut the first bucket (4.bias, 4.weight | 2.bias) in two."""
    first, second, last = model[0], model[2], model[4]
    return torch.optim.Adam(
        [
            {"params": [first.weight, first.bias, second.bias]},
            {"params": [second.weight, last.weight, last.bias], "lr": 3e-3, "weight_decay": 0.01},
        ],
        lr=1e-2,
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1009 + rank)
    return torch.randn(6, 10, generator=g) * (1 + rank), torch.randn(6, 3, generator=g)


def wrapped_model_fused_and_unfused(algorithms: list[str]) -> dict:
    """Per algorithm: parameters after each step, unfused and fused, and the fused run's copy counters."""
    import bagua_torch

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    bagua_torch.init_process_group(timeout=60)
    out = {}
    for algorithm in algorithms:
        runs = {}
        for fused in (False, True):
            model = bagua_torch.with_bagua(make_mlp(0), [], algorithm, bucket_bytes=SMALL_BUCKET)
            optimizer = make_adam(model.module)
            if fused:
                optimizer = bagua_torch.fuse_optimizer(optimizer, module=model)
            steps = []
            for step in range(STEPS):
                optimizer.zero_grad(set_to_none=False)
                x, y = batch(step, rank)
                nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
                steps.append({n: p.detach().numpy().copy() for n, p in model.module.named_parameters()})
            runs[fused] = {
                "steps": steps,
                "stats": optimizer.stats() if fused else None,
                "buckets": len(model.buckets),
                "grads_are_bucket_views": all(
                    p.grad.data_ptr() == view.data_ptr()
                    for b in model.buckets
                    for p, view in zip(b.params, model.reducer.grad_views(b))
                ),
            }
            model.close()
        out[algorithm] = runs
    return {k: {str(f): r for f, r in v.items()} for k, v in out.items()} | {"rank": np.int64(rank)}

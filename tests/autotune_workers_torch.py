"""Rank bodies for test_autotune_torch.py: a wrapped model tuning its bucket size while it trains."""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from torch import nn

STEPS = 90


def make_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 1024), nn.Tanh(), nn.Linear(1024, 512), nn.Tanh(), nn.Linear(512, 4))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 1009 + rank)
    return torch.randn(8, 64, generator=g), torch.randn(8, 4, generator=g)


def tuned_against_plain(cache_path: str) -> dict:
    """Train the same model with autotuning off and on (rank 1 slowed at random); parameters and bucket sizes."""
    import bagua_torch

    os.environ["BAGUA_AUTOTUNE_CACHE"] = cache_path
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    bagua_torch.init_process_group(timeout=60)
    skew = np.random.default_rng(rank).uniform(0, 0.004, STEPS) if rank == 1 else np.zeros(STEPS)
    out: dict = {"rank": np.int64(rank)}
    for autotune in ("off", "once", "cached"):
        model = bagua_torch.with_bagua(make_mlp(), [], "gradient_allreduce", autotune=autotune)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        sizes = []
        for step in range(STEPS):
            time.sleep(skew[step])
            x, y = batch(step, rank)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            sizes.append(model.bucket_bytes)
        tuner = model.bucket_tuner
        out[autotune] = {
            "params": {n: p.detach().numpy().copy() for n, p in model.module.named_parameters()},
            "sizes": np.array(sizes),
            "finished": tuner is not None and tuner.finished,
        }
        model.close()
    try:
        bagua_torch.with_bagua(make_mlp(), [], "bytegrad", autotune="once")
        out["bytegrad"] = "accepted"
    except ValueError as error:
        out["bytegrad"] = str(error)
    return out

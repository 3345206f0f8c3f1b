"""Rank bodies for test_autotune_torch.py: a wrapped model tuning its bucket size while it trains."""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from torch import nn

STEPS = 90


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 1024), nn.Tanh(), nn.Linear(1024, 512), nn.Tanh(), nn.Linear(512, 4))


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    return torch.randn(8, 64, generator=g), torch.randn(8, 4, generator=g)


def tuned_against_plain(seed: int, cache_path: str) -> dict:
    """Train the same model with autotuning off and on (rank 1 slowed at random); parameters and bucket sizes."""
    import bagua_torch

    os.environ["BAGUA_AUTOTUNE_CACHE"] = cache_path
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    bagua_torch.init_process_group(timeout=60)
    skew = np.random.default_rng([seed, rank]).uniform(0, 0.004, STEPS) if rank == 1 else np.zeros(STEPS)
    out: dict = {"rank": np.int64(rank)}
    for autotune in ("off", "once", "cached"):
        model = bagua_torch.with_bagua(make_mlp(seed), [], "gradient_allreduce", autotune=autotune)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        sizes = []
        for step in range(STEPS):
            time.sleep(skew[step])
            x, y = batch(seed, step, rank)
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
        bagua_torch.with_bagua(make_mlp(seed), [], "bytegrad", autotune="once")
        out["bytegrad"] = "accepted"
    except ValueError as error:
        out["bytegrad"] = str(error)
    return out


def knobs_on_two_levels(seed: int, cache_path: str, steps: int) -> dict:
    """Four ranks as two nodes of two (the native MPI engine; rank 3 slowed at random), trained without and with
    tuning: per step the bucket size, hierarchical flag, whether two levels are in use and the ring thresholds in
    force; the final parameters."""
    import bagua_torch

    os.environ["BAGUA_AUTOTUNE_CACHE"] = cache_path
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    job = bagua_torch.init_process_group(timeout=60, local_world_size=2, local_rank=rank % 2, native=True)
    skew = np.random.default_rng([seed, rank]).uniform(0, 0.002, steps) if rank == 3 else np.zeros(steps)
    out: dict = {"rank": rank}
    for autotune in ("off", "once"):
        torch.manual_seed(seed)
        model = bagua_torch.with_bagua(
            nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4)), [], "gradient_allreduce", autotune=autotune
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        settings = []
        for step in range(steps):
            time.sleep(skew[step])
            g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
            optimizer.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            levels = model.algorithm_impl.levels
            settings.append(
                (
                    model.bucket_bytes,
                    model.algorithm.hierarchical,
                    levels is not None,
                    *(c.mpi_ring_min_bytes for c in job.communicators),
                )
            )
        out[autotune] = {
            "params": {n: p.detach().numpy().copy() for n, p in model.module.named_parameters()},
            "settings": np.array(settings, np.int64),
            "finished": model.bucket_tuner is not None and model.bucket_tuner.finished,
        }
        model.close()
    job.close()
    return out

"""Rank bodies for test_convergence_torch.py: every PyTorch algorithm trains an MLP on digits.

One job of 4 gloo processes laid out as 2 nodes x 2 ranks (so hierarchical algorithms use
both levels) trains one fresh model per variant, one variant after the other. The data and
the model are those of the JAX convergence test (``digits.py``): global batches of 128
examples, rank ``r`` taking rows ``32 r .. 32 r + 31`` of each.
"""

from __future__ import annotations

import os
import time

import digits
import numpy as np
import torch
from torch import nn

STEPS, BATCH, LR = 300, 128, 3e-3
WARMUP = 50  # QAdam, 1-bit Adam and async: steps of full-precision gradient allreduce first


class MLP(nn.Module):
    """``relu(x w1 + b1) w2 + b2`` (64-32-10), initialized like ``digits.init_mlp``."""

    def __init__(self, seed: int = 0):
        super().__init__()
        for name, value in digits.init_mlp(seed).items():
            self.register_parameter(name, nn.Parameter(torch.from_numpy(value.copy())))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w1 + self.b1) @ self.w2 + self.b2


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        predicted = model(torch.from_numpy(x)).argmax(-1).numpy()
    return float(np.mean(predicted == y))


def global_batches() -> list[dict]:
    x, y, _, _ = digits.load()
    return list(digits.batches(x, y, BATCH, STEPS))


def adam(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=LR)


VARIANTS: dict[str, tuple[str, dict]] = {
    "gradient_allreduce": ("gradient_allreduce", {}),
    "bytegrad": ("bytegrad", {}),
    "bytegrad/flat+error_feedback": ("bytegrad", {"hierarchical": False, "error_feedback": True}),
    "decentralized": ("decentralized", {}),
    "decentralized/shift_one": ("decentralized", {"peer_selection_mode": "shift_one"}),
    "low_precision_decentralized": ("low_precision_decentralized", {}),
    "async": ("async", {"sync_interval_ms": 5, "warmup_steps": WARMUP}),
    "qadam": ("qadam", {}),
    "onebit_adam": ("onebit_adam", {}),
    "powersgd": ("powersgd", {}),
    "diloco": ("diloco", {"sync_every": 10}),
}
"""Variant -> (registry name, options). Adam (lr 3e-3) for all but QAdam and 1-bit Adam, which bring their own
optimizer (Adam during a warm-up of WARMUP steps)."""


def variant(name: str, model: nn.Module):
    """(optimizer, algorithm) of variant ``name``."""
    from bagua_torch.algorithms import get_algorithm

    algorithm, options = VARIANTS[name]
    if algorithm in ("qadam", "onebit_adam"):
        if algorithm == "qadam":
            from bagua_torch.algorithms.qadam import QAdamOptimizer as Optimizer
        else:
            from bagua_torch.algorithms.onebit_adam import (
                OneBitAdamOptimizer as Optimizer,
            )
        opt = Optimizer(model.parameters(), lr=LR, warmup_steps=WARMUP)
        return opt, get_algorithm(algorithm, optimizer=opt)
    return adam(model), get_algorithm(algorithm, **options)


def job(variants: list[str]) -> dict:
    torch.set_num_threads(1)
    import bagua_torch

    rank = int(os.environ["RANK"])
    group = bagua_torch.init_process_group(timeout=60, local_world_size=2, local_rank=rank % 2)
    batches = global_batches()
    _, _, x_test, y_test = digits.load()
    rows = slice(rank * (BATCH // group.size), (rank + 1) * (BATCH // group.size))
    out = {"rank": rank, "hierarchical": group.communicators.hierarchical}
    for name in variants:
        start = time.perf_counter()
        model = MLP()
        opt, algorithm = variant(name, model)
        wrapped = bagua_torch.with_bagua(model, [opt], algorithm)
        losses = []
        for batch in batches:
            opt.zero_grad()
            logits = wrapped(torch.from_numpy(batch["x"][rows]))
            loss = nn.functional.cross_entropy(logits, torch.from_numpy(batch["y"][rows]).long())
            loss.backward()
            opt.step()
            losses.append(float(loss))
        wrapped.close()  # async: stops the rounds (on every rank at the same one)
        out[name] = {
            "accuracy": accuracy(model, x_test, y_test),
            "loss_first": float(np.mean(losses[:20])),
            "loss_last": float(np.mean(losses[-20:])),
            "seconds": time.perf_counter() - start,
        }
        if name.startswith("async"):
            out[name]["rounds"] = wrapped.algorithm_impl.rounds
    return out

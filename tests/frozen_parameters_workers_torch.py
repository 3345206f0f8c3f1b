"""Rank body for test_frozen_parameters_torch.py: frozen parameters under every algorithm.

For each algorithm the MLP of gradient_allreduce_bytegrad_workers_torch gets its first layer frozen
(``requires_grad=False``) and a trainable parameter its forward never uses, is wrapped, and trains a
few steps on the rank's own data; the rank returns, per algorithm, how far the frozen, the unused
and the trained parameters moved.
"""

from __future__ import annotations

import time

import torch
from gradient_allreduce_bytegrad_workers_torch import SMALL_BUCKET, batch, loss_fn, make_mlp, params_of, setup
from torch import nn

STEPS, WARMUP, LR = 6, 2, 0.01


def _optimizer_and_algorithm(name: str, params: list[torch.nn.Parameter]):
    from bagua_torch.algorithms import get_algorithm

    if name in ("qadam", "onebit_adam"):
        if name == "qadam":
            from bagua_torch.algorithms.qadam import QAdamOptimizer as Optimizer
        else:
            from bagua_torch.algorithms.onebit_adam import (
                OneBitAdamOptimizer as Optimizer,
            )
        optimizer = Optimizer(params, lr=LR, warmup_steps=WARMUP)
        return optimizer, get_algorithm(name, optimizer=optimizer)
    optimizer = torch.optim.SGD(params, lr=LR, momentum=0.9)
    options = {"sync_interval_ms": 5} if name == "async" else {}
    return optimizer, get_algorithm(name, **options)


def frozen_first_layer(seed: int) -> dict[str, dict[str, float]]:
    """Per algorithm: the largest change of any frozen, of the unused and of any trained parameter."""
    import bagua_torch
    from bagua_torch.algorithms import available_algorithms

    rank = setup().rank
    moved = {}
    for name in available_algorithms():
        model = make_mlp(seed)
        for p in model[0].parameters():
            p.requires_grad_(False)
        # Its gradient is always zero; on the last layer it shares a bucket (and a compressed chunk) with used ones.
        model[4].register_parameter("unused", nn.Parameter(torch.randn(5)))
        optimizer, algorithm = _optimizer_and_algorithm(name, [p for p in model.parameters() if p.requires_grad])
        wrapped = bagua_torch.with_bagua(model, [optimizer], algorithm, bucket_bytes=SMALL_BUCKET)
        before = params_of(model)  # after the wrap's broadcast from rank 0
        for step in range(STEPS):
            optimizer.zero_grad()
            loss_fn(wrapped, *batch(seed, step, rank)).backward()
            optimizer.step()
            if name == "async":
                time.sleep(0.02)  # let averaging rounds run between steps
        if name == "async":
            wrapped.algorithm_impl.abort()
        after = params_of(model)
        change = {n: float(abs(after[n] - before[n]).max()) for n in before}
        moved[name] = {
            "frozen": max(v for n, v in change.items() if n.startswith("0.")),
            "unused": change["4.unused"],
            "trained": max(v for n, v in change.items() if not n.startswith("0.") and n != "4.unused"),
        }
        wrapped.close()
    return moved

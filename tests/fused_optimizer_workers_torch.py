"""Rank bodies for test_fused_optimizer_torch.py: a fused optimizer stepping a wrapped model, every algorithm."""

from __future__ import annotations

import os
import time
from collections import Counter

import numpy as np
import torch
from torch import nn

STEPS = 6
SMALL_BUCKET = 1500  # bytes: the MLP below gets 3 buckets, the first cut by the two param groups
ASYNC_WARMUP = 2
COLLECTIVES = ("allreduce", "allreduce_async", "send_recv", "allgather", "alltoall", "reduce_scatter", "broadcast")


class CountingCommunicator:
    """A communicator that counts the collectives called on it, by name, and forwards everything."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str):
        value = getattr(self.inner, name)
        if name not in COLLECTIVES:
            return value

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return value(*args, **kwargs)

        return counted


def make_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3))


def param_groups(model: nn.Module) -> list[dict]:
    """Two groups that cut the first bucket (4.bias, 4.weight | 2.bias) in two."""
    first, second, last = model[0], model[2], model[4]
    return [
        {"params": [first.weight, first.bias, second.bias]},
        {"params": [second.weight, last.weight, last.bias], "lr": 3e-3},
    ]


def make_adam(model: nn.Module) -> torch.optim.Optimizer:
    groups = param_groups(model)
    groups[1]["weight_decay"] = 0.01
    return torch.optim.Adam(groups, lr=1e-2)


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    return torch.randn(6, 10, generator=g) * (1 + rank), torch.randn(6, 3, generator=g)


def build(name: str, model: nn.Module):
    """The optimizer and algorithm of case ``name`` (an algorithm's registry name)."""
    from bagua_torch import algorithms
    from bagua_torch.algorithms.onebit_adam import OneBitAdamOptimizer
    from bagua_torch.algorithms.qadam import QAdamOptimizer

    if name in ("qadam", "onebit_adam"):
        cls = QAdamOptimizer if name == "qadam" else OneBitAdamOptimizer
        optimizer = cls(param_groups(model), lr=1e-2, warmup_steps=2)
        return optimizer, algorithms.get_algorithm(name, optimizer=optimizer)
    options = {
        "powersgd": {"rank": 2, "start_iter": 2},
        "async": {"sync_interval_ms": 0, "warmup_steps": ASYNC_WARMUP},
        "diloco": {"sync_every": 2},
    }.get(name, {})
    return make_adam(model), algorithms.get_algorithm(name, **options)


def train(model, optimizer, seed: int, rank: int, steps: int) -> list[dict]:
    out = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=False)
        x, y = batch(seed, step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        out.append({n: p.detach().numpy().copy() for n, p in model.module.named_parameters()})
    return out


def run_case(name: str, fused: bool, seed: int, rank: int) -> dict:
    """Train case ``name`` fused or not; what was trained, communicated and (fused) copied, or the refusal."""
    import bagua_torch

    world = CountingCommunicator(bagua_torch.get_process_group().world)
    model = make_mlp(seed)
    optimizer, algorithm = build(name, model)
    # Asynchronous averaging makes a communicator of its own from the world: it gets the real one.
    group = world.inner if name == "async" else world
    model = bagua_torch.with_bagua(model, [optimizer], algorithm, bucket_bytes=SMALL_BUCKET, process_group=group)
    try:
        if fused:
            try:
                optimizer = bagua_torch.fuse_optimizer(optimizer, module=model)
            except TypeError as error:
                return {"refused": str(error)}
        world.calls.clear()
        steps = train(model, optimizer, seed, rank, STEPS)
        result = {"steps": steps, "calls": dict(world.calls), "buckets": len(model.buckets)}
        impl = model.algorithm_impl
        if name == "async":
            result["async_steps"], result["warm"] = impl.steps, not impl.need_gradient_hooks
            deadline = time.monotonic() + 20
            while impl.rounds < 1 and time.monotonic() < deadline:  # rounds come from the thread's clock
                optimizer.step()
            impl.abort()
            result["rounds"] = impl.rounds
        elif name in ("decentralized", "low_precision_decentralized"):
            result["rounds"] = impl.step
        if fused:
            result["stats"] = optimizer.stats()
            result["grads_are_bucket_views"] = all(
                p.grad.data_ptr() == view.data_ptr()
                for b in model.buckets
                for p, view in zip(b.params, model.reducer.grad_views(b))
            )
        return result
    finally:
        model.close()


def every_algorithm_fused_and_unfused(seed: int, names: list[str]) -> dict:
    """Per algorithm: the unfused and the fused run (see :func:`run_case`), keyed "False" and "True"."""
    import bagua_torch

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    bagua_torch.init_process_group(timeout=60)
    out = {name: {str(fused): run_case(name, fused, seed, rank) for fused in (False, True)} for name in names}
    return out | {"rank": np.int64(rank)}

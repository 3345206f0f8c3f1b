"""Rank bodies for test_powersgd_torch.py: PowerSGD under with_bagua, and torch's own PowerSGD hook."""

from __future__ import annotations

import copy
import os

import torch
from torch import nn

STEPS, BATCH = 8, 8


def make_model(seed: int) -> nn.Module:
    """A conv layer (7 x 3 x 3 x 3, compressed as 7 x 27), two linear layers and their biases.

    The conv's ``P`` (7 rows) is orthogonalized in one batch with the last layer's (10 rows), padded: with
    small buckets the two lie in different buckets, and 7 rows (not a multiple of the 8-float vector) round
    differently alone than padded, so a per-bucket orthogonalization would show in the bits.
    """
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 7, 3), nn.Flatten(), nn.Tanh(), nn.Linear(7 * 4 * 4, 24), nn.Tanh(), nn.Linear(24, 10)
    )


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + 1000 * step + rank)
    return torch.randn(BATCH, 3, 6, 6, generator=generator), torch.randint(0, 10, (BATCH,), generator=generator)


def loss_of(model: nn.Module, seed: int, step: int, rank: int) -> torch.Tensor:
    x, y = batch(seed, step, rank)
    return nn.functional.cross_entropy(model(x), y)


def by_name(wrapped, matrices: list[torch.Tensor]) -> dict:
    """Each of a PowerSGD impl's per-matrix tensors (``Q``, residuals: in its buckets' order) by parameter name."""
    names = [
        bucket.names[i] for bucket, layout in zip(wrapped.buckets, wrapped.algorithm_impl.layout) for i, _, _ in layout
    ]
    return {name: matrix.numpy().copy() for name, matrix in zip(names, matrices)}


def bagua_gradients(seed: int, config: dict, bucket_sizes: list[int]) -> list[dict]:
    """Per bucket size, each step: this rank's local gradients (at the shared parameters) and the gradients
    PowerSGD applied, from the same initial model."""
    return [_bagua_run(seed, config, bucket_bytes) for bucket_bytes in bucket_sizes]


def _bagua_run(seed: int, config: dict, bucket_bytes: int, weighing=None) -> dict:
    import bagua_torch
    from bagua_torch.algorithms.powersgd import PowerSGDAlgorithm

    rank = int(os.environ["RANK"])
    model = make_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    wrapped = bagua_torch.with_bagua(model, [optimizer], PowerSGDAlgorithm(**config), bucket_bytes=bucket_bytes)
    names = [name for name, _ in model.named_parameters()]
    initial_qs = by_name(wrapped, wrapped.algorithm_impl.qs)
    local, applied = [], []
    for step in range(STEPS):
        grads = torch.autograd.grad(loss_of(model, seed, step, rank), list(model.parameters()))
        local.append([g.numpy().copy() for g in grads])
        optimizer.zero_grad()
        wrapped.algorithm_impl.weighed_out = weighing
        loss_of(wrapped, seed, step, rank).backward()
        applied.append([p.grad.numpy().copy() for p in model.parameters()])
        optimizer.step()
    wrapped.close()
    return {
        "names": names,
        "buckets": len(wrapped.buckets),
        "initial_qs": initial_qs,
        "local": local,
        "applied": applied,
        "params": [p.detach().numpy().copy() for p in model.parameters()],
        "residuals": by_name(wrapped, wrapped.algorithm_impl.residuals),
    }


def losses(kind: str, seed: int, config: dict, steps: int) -> list[float]:
    """The loss curve of PowerSGD under with_bagua (``kind="bagua"``) or DDP's hook (``"ddp"``), same data."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    import bagua_torch
    from bagua_torch.algorithms.powersgd import PowerSGDAlgorithm

    rank = int(os.environ["RANK"])
    model = make_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if kind == "bagua":
        trained = bagua_torch.with_bagua(model, [optimizer], PowerSGDAlgorithm(**config))
    else:
        trained = nn.parallel.DistributedDataParallel(model)
        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=config["rank"],
            start_powerSGD_iter=max(config["start_iter"], 2),  # the hook's smallest allowed value
            min_compression_rate=config["min_compression_rate"],
            use_error_feedback=config["error_feedback"],
            warm_start=config["warm_start"],
        )
        trained.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    curve = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = loss_of(trained, seed, step % 16, rank)
        loss.backward()
        optimizer.step()
        curve.append(float(loss))
    dist.barrier()
    return curve


def resume(seed: int, config: dict) -> dict:
    """Train 3 steps, checkpoint, train 3 more; a fresh wrap loaded from the checkpoint must repeat them."""
    import bagua_torch
    from bagua_torch.algorithms.powersgd import PowerSGDAlgorithm

    rank = int(os.environ["RANK"])

    def run(wrapped, optimizer, steps) -> list[list[float]]:
        for step in steps:
            optimizer.zero_grad()
            loss_of(wrapped, seed, step, rank).backward()
            optimizer.step()
        return [p.detach().reshape(-1).tolist() for p in wrapped.module.parameters()]

    model = make_model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    wrapped = bagua_torch.with_bagua(model, [optimizer], PowerSGDAlgorithm(**config))
    run(wrapped, optimizer, range(3))
    checkpoint = copy.deepcopy({"model": wrapped.state_dict(), "optimizer": optimizer.state_dict()})
    continued = run(wrapped, optimizer, range(3, 6))
    wrapped.close()
    model = make_model(seed + 1)  # other initial weights, which loading the checkpoint replaces
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    wrapped = bagua_torch.with_bagua(model, [optimizer], PowerSGDAlgorithm(**config))
    wrapped.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    resumed = run(wrapped, optimizer, range(3, 6))
    wrapped.close()
    return {"continued": continued, "resumed": resumed}


def every_run(seed: int, config: dict, bucket_sizes: list[int], steps: int) -> dict:
    """What each test of test_powersgd_torch.py reads, from one process group: :func:`bagua_gradients`,
    :func:`resume`, and :func:`losses` of both kinds."""
    import bagua_torch

    torch.set_num_threads(1)
    bagua_torch.init_process_group(timeout=60)
    return {
        "gradients": bagua_gradients(seed, config, bucket_sizes),
        "resume": resume(seed, config),
        **{kind: losses(kind, seed, config, steps) for kind in ("bagua", "ddp")},
    }


def weighed_out(seed: int, config: dict) -> dict:
    """Every step with the last rank weighed out (a fault-tolerant job's joiner: its gradients replaced by zeros, the
    others' average rescaled to theirs): :func:`_bagua_run`'s record, with this rank's residuals."""
    import bagua_torch
    from bagua_torch.algorithms.base import WeighedOut
    from bagua_torch.bucketing import DEFAULT_BUCKET_BYTES

    torch.set_num_threads(1)
    bagua_torch.init_process_group(timeout=60)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return _bagua_run(seed, config, DEFAULT_BUCKET_BYTES, WeighedOut(rank < world - 1, world / (world - 1)))

"""Rank bodies for test_gradient_allreduce_bytegrad_torch.py: the PyTorch bridge (with_bagua, DistributedDataParallel).

One job per configuration runs several scenarios and returns a dict per scenario; the
test process checks them (and computes the single-process references). Models and
data are deterministic functions of a seed, so the test process can rebuild them.
"""

from __future__ import annotations

import copy
import io
import os
import time

import numpy as np
import torch
from scenarios import Registry, Scenario, raised
from torch import nn

scenario = Registry()

STEPS = 4
BATCH = 6
SMALL_BUCKET = 1500  # bytes: the MLP below gets 3 buckets (see test_bucket_layout)


# ----------------------------------------------------------------------------- shared with the test


def make_mlp(seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 3)).to(dtype)


def make_bn(seed: int) -> nn.Module:
    """A model with buffers (BatchNorm running statistics) and a frozen parameter (the BatchNorm scale)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))
    model[1].weight.requires_grad_(False)
    return model


def state_of(model: nn.Module) -> dict[str, np.ndarray]:
    return {name: t.detach().float().cpu().numpy().copy() for name, t in model.state_dict().items()}


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)


def batch(seed: int, step: int, rank: int, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``: inputs ``[rows, 10]`` and targets ``[rows, 3]`` on very different scales."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(rows, 10, generator=g) * (1 + rank)
    y = torch.randn(rows, 3, generator=g) * 10 ** (rank % 3 - 1)
    return x, y


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(x), y)


def params_of(model: nn.Module) -> dict[str, np.ndarray]:
    return {name: p.detach().float().cpu().numpy().copy() for name, p in model.named_parameters()}


def load_checkpoint(buffer: io.BytesIO, wrapped: nn.Module, model: nn.Module, optimizer, with_state: bool) -> None:
    """Load the checkpoint ``{"model": wrapped.state_dict(), "optimizer": ...}`` in ``buffer`` into a freshly
    ``wrapped`` ``model`` and its ``optimizer``; ``with_state=False``: the weights and the optimizer only, not the
    algorithm's state."""
    buffer.seek(0)
    saved = torch.load(buffer)  # the safe (weights_only) loader reads the algorithm state too
    if with_state:
        wrapped.load_state_dict(saved["model"])
    else:
        model.load_state_dict(
            {k.removeprefix("module."): v for k, v in saved["model"].items() if k.startswith("module.")}
        )
    optimizer.load_state_dict(saved["optimizer"])


def saved_after_training(algorithm, seed: int, train) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, io.BytesIO]:
    """``(wrapped, model, optimizer, checkpoint)``: a model wrapped with ``algorithm``, trained by
    ``train(wrapped, optimizer)``, then saved (the wrapped model's and the optimizer's state) into a new buffer."""
    import bagua_torch

    model = make_mlp(seed)
    opt = make_optimizer(model)
    wrapped = bagua_torch.with_bagua(model, [opt], algorithm, bucket_bytes=SMALL_BUCKET)
    train(wrapped, opt)
    buffer = io.BytesIO()
    torch.save({"model": wrapped.state_dict(), "optimizer": opt.state_dict()}, buffer)
    return wrapped, model, opt, buffer


def resumed_params(buffer: io.BytesIO, algorithm, seed: int, with_state: bool, train) -> dict[str, np.ndarray]:
    """The parameters of a fresh model wrapped with ``algorithm``, loaded from the checkpoint in ``buffer`` (see
    :func:`load_checkpoint`) and trained by ``train(wrapped, optimizer)``."""
    import bagua_torch

    fresh = make_mlp(seed + 77)
    fresh_opt = make_optimizer(fresh)
    wrapped = bagua_torch.with_bagua(fresh, [fresh_opt], algorithm, bucket_bytes=SMALL_BUCKET)
    load_checkpoint(buffer, wrapped, fresh, fresh_opt, with_state)
    train(wrapped, fresh_opt)
    wrapped.close()
    return params_of(fresh)


# ----------------------------------------------------------------------------- setup


def setup(**kwargs):
    torch.set_num_threads(1)  # deterministic kernels, same as the test process's reference
    import bagua_torch

    return bagua_torch.init_process_group(timeout=60, **kwargs)


def train(model, optimizer, seed: int, steps: range, rank: int) -> list[float]:
    """Train ``model`` on this rank's batches of ``steps``; the losses."""
    losses = []
    for step in steps:
        x, y = batch(seed, step, rank)
        optimizer.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
    return losses


# ----------------------------------------------------------------------------- scenarios


@scenario
def ddp_equivalence(seed: int, rank: int) -> dict:
    """GradientAllReduce (with_bagua, both sync points, our DDP wrapper) against torch's DDP, same data and seed."""
    import torch.distributed as dist

    import bagua_torch
    from bagua_torch.algorithms import GradientAllReduceAlgorithm

    out = {}
    reference = make_mlp(seed)
    ddp = nn.parallel.DistributedDataParallel(reference)
    opt = make_optimizer(reference)
    train(ddp, opt, seed, range(STEPS), rank)
    out["torch_ddp"] = params_of(reference)
    variants = {
        "with_bagua": lambda m, o: bagua_torch.with_bagua(
            m, [o], GradientAllReduceAlgorithm(), bucket_bytes=SMALL_BUCKET
        ),
        "with_bagua_step": lambda m, o: bagua_torch.with_bagua(
            m, o, "gradient_allreduce", bucket_bytes=SMALL_BUCKET, sync_point="step"
        ),
        "bagua_ddp": lambda m, o: bagua_torch.DistributedDataParallel(m, bucket_cap_mb=SMALL_BUCKET / 2**20),
        "bagua_ddp_default_bucket": lambda m, o: bagua_torch.DistributedDataParallel(m),
        "hierarchical": lambda m, o: bagua_torch.with_bagua(
            m, [o], GradientAllReduceAlgorithm(hierarchical=True), bucket_bytes=SMALL_BUCKET
        ),
        "torch_group": lambda m, o: bagua_torch.with_bagua(
            m, [o], bucket_bytes=SMALL_BUCKET, process_group=dist.group.WORLD
        ),
        "sum": lambda m, o: bagua_torch.with_bagua(
            m, [o], GradientAllReduceAlgorithm(average=False), bucket_bytes=SMALL_BUCKET
        ),
    }
    for name, wrap in variants.items():
        model = make_mlp(seed + 1000 * (rank + 1))  # different on every rank: the wrap broadcasts rank 0's
        if rank == 0:
            model.load_state_dict(make_mlp(seed).state_dict())
        opt = make_optimizer(model)
        wrapped = wrap(model, opt)
        out[f"{name}/buckets"] = len(wrapped.buckets)
        out[f"{name}/losses"] = train(wrapped, opt, seed, range(STEPS), rank)
        out[name] = params_of(model)
        wrapped.close()

    # Buffers and a frozen parameter: broadcast from rank 0 on wrap (and buffers at every forward, as torch's DDP).
    reference = make_bn(seed)
    ddp = nn.parallel.DistributedDataParallel(reference)
    opt = make_optimizer(reference)
    train(ddp, opt, seed, range(STEPS), rank)
    out["bn/torch_ddp"] = state_of(reference)
    model = make_bn(seed)
    if rank != 0:
        with torch.no_grad():
            model[1].running_mean.add_(rank)
            model[1].weight.mul_(rank + 2)
            model[0].weight.add_(rank)
    opt = make_optimizer(model)
    wrapped = bagua_torch.DistributedDataParallel(model)
    out["bn/after_wrap"] = state_of(model)
    train(wrapped, opt, seed, range(STEPS), rank)
    out["bn/bagua_ddp"] = state_of(model)
    wrapped.close()
    out["communicator"] = type(bagua_torch.get_process_group().world).__name__
    out["hierarchical_levels"] = bagua_torch.get_process_group().communicators.hierarchical
    out["rank"], out["size"] = rank, dist.get_world_size()
    return out


@scenario
def bytegrad(seed: int, rank: int, sync_point: str = "backward", **options) -> dict:
    """ByteGrad(**options) training for STEPS steps, waiting at ``sync_point``; returns the final parameters and
    the bucket layout."""
    import bagua_torch
    from bagua_torch.algorithms import ByteGradAlgorithm

    model = make_mlp(seed)
    opt = make_optimizer(model)
    wrapped = bagua_torch.with_bagua(
        model, [opt], ByteGradAlgorithm(**options), bucket_bytes=SMALL_BUCKET, sync_point=sync_point
    )
    losses = train(wrapped, opt, seed, range(STEPS), rank)
    layout = [(list(b.names), b.size) for b in wrapped.buckets]
    levels = wrapped.algorithm_impl.levels
    wrapped.close()
    return {"params": params_of(model), "layout": layout, "losses": losses, "levels": levels is not None}


@scenario
def overlap(seed: int, rank: int) -> dict:
    """Several large layers, one per bucket: when does each bucket launch, relative to the backward pass?"""
    import bagua_torch

    torch.manual_seed(seed)
    layers = [nn.Linear(512, 512) for _ in range(6)]
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.Tanh())])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    bucket_bytes = 512 * 512 * 4 + 512 * 4  # exactly one layer per bucket
    wrapped = bagua_torch.with_bagua(model, [opt], "gradient_allreduce", bucket_bytes=bucket_bytes)
    first_layer_grad = []
    # Fires when the first layer's weight gradient is accumulated: near the very end of the backward pass.
    layers[0].weight.register_post_accumulate_grad_hook(lambda p: first_layer_grad.append(time.perf_counter()))
    results = []
    for step in range(3):
        x = torch.randn(256, 512, generator=torch.Generator().manual_seed(seed * 1_000_003 + step * 10 + rank))
        wrapped.events = []
        first_layer_grad.clear()
        opt.zero_grad()
        start = time.perf_counter()
        wrapped(x).square().mean().backward()
        end = time.perf_counter()
        opt.step()
        results.append({"events": wrapped.events, "first_layer_grad": first_layer_grad[0], "start": start, "end": end})
    buckets = [list(b.names) for b in wrapped.buckets]
    wrapped.close()

    # Registration order differs from use order: bucket 1 (layer "a") is ready before bucket 0 (layer "b").
    class Swapped(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(seed + 1)
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)  # registered (and drawn) a first

        def forward(self, x):
            return self.a(torch.tanh(self.b(x)))

    swapped = Swapped()
    sopt = torch.optim.SGD(swapped.parameters(), lr=0.1)
    sw = bagua_torch.with_bagua(swapped, [sopt], "gradient_allreduce", bucket_bytes=8 * 8 * 4 + 8 * 4)
    sw.events = []
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed * 1_000_003 + rank))
    sw(x).sum().backward()
    grads = {name: p.grad.numpy().copy() for name, p in swapped.named_parameters()}
    local = copy.deepcopy(swapped)  # for the expected average: this rank's own gradient
    for p in local.parameters():
        p.grad = None
    local(x).sum().backward()
    sw_events = sw.events
    swapped_buckets = [list(b.names) for b in sw.buckets]
    sw.close()
    return {
        "steps": results,
        "buckets": buckets,
        "swapped_events": sw_events,
        "swapped_buckets": swapped_buckets,
        "swapped_grads": grads,
        "swapped_local": {n: p.grad.numpy().copy() for n, p in local.named_parameters()},
    }


@scenario
def no_sync(seed: int, rank: int) -> dict:
    """Two micro-batches (the first under no_sync) against one step on the concatenated batch."""
    import bagua_torch

    out = {}
    for sync_point in ("backward", "step"):
        accumulated, whole = make_mlp(seed), make_mlp(seed)
        opt_a, opt_w = make_optimizer(accumulated), make_optimizer(whole)
        wa = bagua_torch.with_bagua(
            accumulated, [opt_a], "gradient_allreduce", bucket_bytes=SMALL_BUCKET, sync_point=sync_point
        )
        ww = bagua_torch.with_bagua(whole, [opt_w], "gradient_allreduce", bucket_bytes=SMALL_BUCKET)
        launches_inside = []
        for step in range(2):
            x, y = batch(seed, step, rank, rows=2 * BATCH)
            opt_a.zero_grad()
            wa.events = []
            with wa.no_sync():
                (loss_fn(wa, x[:BATCH], y[:BATCH]) / 2).backward()
            launches_inside.append(sum(kind == "launch" for kind, _, _ in wa.events))
            (loss_fn(wa, x[BATCH:], y[BATCH:]) / 2).backward()
            opt_a.step()
            opt_w.zero_grad()
            loss_fn(ww, x, y).backward()
            opt_w.step()
        out[sync_point] = {
            "accumulated": params_of(accumulated),
            "whole": params_of(whole),
            "launches_inside_no_sync": launches_inside,
        }
        wa.close()
        ww.close()
    return out


class _Branchy(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.always = nn.Linear(6, 6)
        self.rank0_only = nn.Linear(6, 6)
        self.never = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, x, use_branch: bool):
        h = torch.tanh(self.always(x))
        if use_branch:
            h = h + torch.tanh(self.rank0_only(h))
        return self.head(h)


@scenario
def unused_parameters(seed: int, rank: int, size: int) -> dict:
    """A branch used on rank 0 only and a layer used nowhere: no hang, zeros stand in for missing gradients."""
    import torch.distributed as dist

    import bagua_torch

    out = {}
    for sync_point in ("backward", "step"):
        model = _Branchy(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapped = bagua_torch.with_bagua(model, [opt], "gradient_allreduce", bucket_bytes=200, sync_point=sync_point)
        grads, expected = [], []
        for step in range(2):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(seed * 1_000_003 + 100 * step + rank))
            local = copy.deepcopy(model)
            local.zero_grad(set_to_none=True)
            local(x, rank == 0).sum().backward()
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in local.parameters()]
            )
            dist.all_reduce(flat)  # the expected average, on torch's default group
            expected.append((flat / size).numpy())
            opt.zero_grad()
            wrapped(x, use_branch=rank == 0).sum().backward()
            wrapped.wait_gradients()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy())
            opt.step()
        out[sync_point] = {
            "grads": grads,
            "expected": expected,
            "params": params_of(model),
            "never_grad_is_zero": bool(torch.all(model.never.weight.grad == 0)),
        }
        wrapped.close()
    return out


@scenario
def checkpoint(seed: int, rank: int) -> dict:
    """ByteGrad with error feedback: save after 3 steps, continue 3; a fresh model loaded from the checkpoint
    continues identically; one that gets the weights but not the algorithm state does not."""
    import bagua_torch
    from bagua_torch.algorithms import ByteGradAlgorithm

    algorithm = ByteGradAlgorithm(hierarchical=False, error_feedback=True)
    wrapped, model, opt, buffer = saved_after_training(algorithm, seed, lambda w, o: train(w, o, seed, range(3), rank))
    residual_norm = float(sum(r.norm() for r in wrapped.algorithm_impl.residuals))
    train(wrapped, opt, seed, range(3, 6), rank)
    continued = params_of(model)
    keys = sorted(wrapped.state_dict())
    wrapped.close()

    def resume(with_state: bool) -> dict:
        return resumed_params(buffer, algorithm, seed, with_state, lambda w, o: train(w, o, seed, range(3, 6), rank))

    resumed = resume(True)
    without_state = resume(False)

    # A checkpoint of one algorithm cannot be loaded into another.
    other = make_mlp(seed)
    wo = bagua_torch.with_bagua(other, [make_optimizer(other)], "gradient_allreduce", bucket_bytes=SMALL_BUCKET)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    wrong_algorithm = raised(lambda: wo.load_state_dict(saved["model"]))
    wo.close()
    return {
        "continued": continued,
        "resumed": resumed,
        "without_state": without_state,
        "keys": keys,
        "residual_norm": residual_norm,
        "wrong_algorithm": wrong_algorithm,
    }


def wrapped_allreduce():
    """A custom algorithm (not a dataclass) delegating to GradientAllReduce."""
    from bagua_torch.algorithms import Algorithm, GradientAllReduceAlgorithm

    class WrappedAllReduce(Algorithm):
        def __init__(self) -> None:
            self.inner = GradientAllReduceAlgorithm()

        def reify(self, context):
            return self.inner.reify(context)

    return WrappedAllReduce()


@scenario
def errors(seed: int, rank: int) -> dict:
    """Wrong inputs, each refused with a clear message on every rank (and nothing left hanging)."""
    import bagua_torch
    from bagua_torch.algorithms import ByteGradAlgorithm

    found = {}
    model = make_mlp(seed)
    opt = make_optimizer(model)
    found["not_module"] = raised(lambda: bagua_torch.with_bagua("model", [opt], "bytegrad"))
    found["unknown_algorithm"] = raised(lambda: bagua_torch.with_bagua(model, [opt], "bytegrade"))
    found["bad_bucket"] = raised(lambda: bagua_torch.with_bagua(model, [opt], bucket_bytes=0))
    found["bad_sync_point"] = raised(lambda: bagua_torch.with_bagua(model, [opt], sync_point="later"))
    found["step_without_optimizer"] = raised(lambda: bagua_torch.with_bagua(model, [], sync_point="step"))
    found["not_optimizer"] = raised(lambda: bagua_torch.with_bagua(model, ["sgd"]))
    found["ddp_dim"] = raised(lambda: bagua_torch.DistributedDataParallel(model, dim=1))
    found["ddp_device"] = raised(lambda: bagua_torch.DistributedDataParallel(model, device_ids=[0]))
    # Below, each call communicates; every rank makes the same calls.
    double = make_mlp(seed, torch.float64)
    found["bytegrad_float64"] = raised(lambda: bagua_torch.with_bagua(double, [], "bytegrad"))
    different = make_mlp(seed) if rank == 0 else nn.Sequential(nn.Linear(10, 31), nn.Tanh(), nn.Linear(31, 3))
    found["different_models"] = raised(lambda: bagua_torch.with_bagua(different, []))
    found["different_algorithms"] = raised(
        lambda: bagua_torch.with_bagua(model, [], ByteGradAlgorithm(hierarchical=rank == 0))
    )
    # A custom algorithm that is not a dataclass: its repr differs per process, its signature does not.
    found["custom_algorithm"] = raised(lambda: bagua_torch.with_bagua(model, [], wrapped_allreduce()).close())
    wrapped = bagua_torch.with_bagua(model, [opt], sync_point="step")
    found["wrap_twice"] = raised(lambda: bagua_torch.with_bagua(wrapped, [opt]))
    x, y = batch(seed, 0, rank)
    loss_fn(wrapped, x, y).backward()

    def second_backward():
        loss_fn(wrapped.module, x, y).backward()

    found["second_backward"] = raised(second_backward)
    wrapped.wait_gradients()
    opt.step()
    found["after_errors_still_works"] = train(wrapped, opt, seed, range(2), rank)
    wrapped.close()
    return found


# ----------------------------------------------------------------------------- jobs


def job(seed: int, scenarios: list[Scenario], local_world_size: int | None = None) -> dict:
    """``scenarios`` on this rank. Started by the python launcher, init_process_group uses gloo; under mpiexec it
    picks the native MPI communicator. ``local_world_size`` lays the ranks out as nodes of that many ranks (the
    harness sets LOCAL_RANK = RANK, so the local rank is passed too)."""
    kwargs = {}
    if local_world_size:
        rank = int(os.environ["RANK"])
        kwargs = {"local_world_size": local_world_size, "local_rank": rank % local_world_size}
    group = setup(**kwargs)
    out = {"rank": group.rank, "size": group.size, "native": group.native, "world": type(group.world).__name__}
    out.update(scenario.run(scenarios, seed=seed, rank=group.rank, size=group.size))
    return out

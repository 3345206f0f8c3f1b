"""Rank body for test_composition_matrix_torch.py: every torch algorithm under each feature of the matrix.

One 2-rank gloo job runs, per feature and algorithm in sequence, a few steps of the MLP of
gradient_allreduce_bytegrad_workers_torch on each rank's own data and returns what the cell's
assertion needs: the parameters per step and the algorithm's step and round counters. ``plain``
is the single-feature run the others are compared with.
"""

from __future__ import annotations

import io
import time

import torch
from gradient_allreduce_bytegrad_workers_torch import SMALL_BUCKET, batch, loss_fn, make_mlp, params_of, setup

STEPS, WARMUP, LR = 4, 2, 0.01
OPTIONS = {
    "async": {"sync_interval_ms": 5, "warmup_steps": 1},
    "powersgd": {"rank": 2, "start_iter": 1},
    "diloco": {"sync_every": 2},
}


def optimizer_and_algorithm(name: str, groups: list[dict]):
    """The optimizer over ``groups`` (QAdam's and 1-bit Adam's own, else SGD with momentum) and algorithm ``name``."""
    from bagua_torch.algorithms import get_algorithm
    from bagua_torch.algorithms.onebit_adam import OneBitAdamOptimizer
    from bagua_torch.algorithms.qadam import QAdamOptimizer

    if name in ("qadam", "onebit_adam"):
        optimizer = (QAdamOptimizer if name == "qadam" else OneBitAdamOptimizer)(groups, lr=LR, warmup_steps=WARMUP)
        return optimizer, get_algorithm(name, optimizer=optimizer)
    return torch.optim.SGD(groups, lr=LR, momentum=0.9), get_algorithm(name, **OPTIONS.get(name, {}))


def wrapped_model(name: str, seed: int, groups=None, dtype: torch.dtype = torch.float32, **wrap_options):
    """``(wrapped, optimizer)``: the MLP in ``dtype`` wrapped with algorithm ``name``; ``groups(model)`` its param
    groups (one group by default), ``wrap_options`` more arguments of ``with_bagua``."""
    import bagua_torch

    model = make_mlp(seed, dtype)
    optimizer, algorithm = optimizer_and_algorithm(name, groups(model) if groups else [{"params": model.parameters()}])
    return bagua_torch.with_bagua(model, [optimizer], algorithm, bucket_bytes=SMALL_BUCKET, **wrap_options), optimizer


def counters(wrapped) -> dict:
    """The algorithm's own step and round counters, where it keeps them."""
    impl = wrapped.algorithm_impl
    return {key: getattr(impl, key) for key in ("step", "steps", "rounds") if isinstance(getattr(impl, key, None), int)}


def run_steps(
    wrapped, optimizer, seed: int, rank: int, steps: range, micro_batches: int = 1, autocast: bool = False
) -> list:
    """Train ``steps``; each step's batch split into ``micro_batches``, all but the last under ``no_sync()``."""
    history = []
    for step in steps:
        x, y = (t.to(wrapped.module[0].weight.dtype) for t in batch(seed, step, rank))
        optimizer.zero_grad()
        for i, (xs, ys) in enumerate(zip(x.chunk(micro_batches), y.chunk(micro_batches))):
            last = i == micro_batches - 1
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                if last:
                    loss = loss_fn(wrapped, xs, ys) / micro_batches
                else:
                    with wrapped.no_sync():
                        loss = loss_fn(wrapped, xs, ys) / micro_batches
            loss.backward()
        optimizer.step()
        history.append(params_of(wrapped.module))
    return history


def finish(wrapped, result: dict) -> dict:
    """Close ``wrapped`` (letting asynchronous averaging complete a round first) and add its counters."""
    if wrapped.algorithm_impl.__class__.__name__.startswith("AsyncModelAverage"):
        deadline = time.monotonic() + 10
        while wrapped.algorithm_impl.rounds < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        wrapped.algorithm_impl.abort()
    result.update(counters(wrapped))
    wrapped.close()
    return result


def two_groups(model) -> list[dict]:
    """The first layer at ``LR``, the rest at learning rate 0 (so they must not move)."""
    return [{"params": model[0].parameters()}, {"params": [*model[2].parameters(), *model[4].parameters()], "lr": 0.0}]


def plain(name: str, seed: int, rank: int) -> dict:
    wrapped, optimizer = wrapped_model(name, seed)
    return finish(wrapped, {"history": run_steps(wrapped, optimizer, seed, rank, range(STEPS))})


def accumulation(name: str, seed: int, rank: int) -> dict:
    wrapped, optimizer = wrapped_model(name, seed)
    return finish(wrapped, {"history": run_steps(wrapped, optimizer, seed, rank, range(STEPS), micro_batches=2)})


def param_groups(name: str, seed: int, rank: int) -> dict:
    wrapped, optimizer = wrapped_model(name, seed, groups=two_groups)
    return finish(wrapped, {"history": run_steps(wrapped, optimizer, seed, rank, range(STEPS))})


def autocast(name: str, seed: int, rank: int) -> dict:
    wrapped, optimizer = wrapped_model(name, seed)
    return finish(wrapped, {"history": run_steps(wrapped, optimizer, seed, rank, range(STEPS), autocast=True)})


def bf16_parameters(name: str, seed: int, rank: int) -> dict:
    wrapped, optimizer = wrapped_model(name, seed, dtype=torch.bfloat16)
    return finish(wrapped, {"history": run_steps(wrapped, optimizer, seed, rank, range(STEPS))})


def checkpoint(name: str, seed: int, rank: int) -> dict:
    """Train half the steps, save model and optimizer, train on; a fresh wrap loads the save and trains on."""
    half = range(STEPS // 2)
    rest = range(STEPS // 2, STEPS)
    wrapped, optimizer = wrapped_model(name, seed)
    run_steps(wrapped, optimizer, seed, rank, half)
    buffer = io.BytesIO()
    torch.save({"model": wrapped.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    continued = run_steps(wrapped, optimizer, seed, rank, rest)
    finish(wrapped, {})
    fresh, fresh_optimizer = wrapped_model(name, seed)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=False)
    fresh.load_state_dict(saved["model"])
    fresh_optimizer.load_state_dict(saved["optimizer"])
    resumed = run_steps(fresh, fresh_optimizer, seed, rank, rest)
    return finish(fresh, {"continued": continued, "resumed": resumed})


def autotune(name: str, seed: int, rank: int) -> dict:
    """Wrapping with ``autotune="once"``: the error it raised, or None."""
    try:
        wrapped, _ = wrapped_model(name, seed, autotune="once")
    except ValueError as error:
        return {"refused": str(error)}
    wrapped.close()
    return {"refused": None}


FEATURES = {f.__name__: f for f in (plain, accumulation, param_groups, autocast, bf16_parameters, checkpoint, autotune)}


def every_algorithm_under_each_feature(seed: int, features: list[str], algorithms: list[str]) -> dict:
    """Per feature, per algorithm: what :data:`FEATURES`' run of it with data and model of ``seed`` returned on this
    rank."""
    rank = setup().rank
    return {f: {name: FEATURES[f](name, seed, rank) for name in algorithms} for f in features}

"""Rank bodies for test_decentralized_torch.py: Decentralized and LowPrecisionDecentralized on PyTorch.

One job per configuration runs several scenarios and returns a dict per scenario; the test
process checks them against single-process simulations of all ranks. The model, data and
optimizer are those of gradient_allreduce_bytegrad_workers_torch.py (deterministic functions of a seed).

Scenario names: ``dec:<options>`` and ``lowprec:<options>`` with options ``mode=all|shift_one``,
``interval=<int>``, ``hier=0|1``; ``peers``, ``checkpoint``, ``errors``.
"""

from __future__ import annotations

import os

import torch
from gradient_allreduce_bytegrad_workers_torch import (
    SMALL_BUCKET,
    STEPS,
    batch,
    loss_fn,
    make_mlp,
    make_optimizer,
    params_of,
    resumed_params,
    saved_after_training,
    setup,
    train,
)
from scenarios import Registry, Scenario, raised
from torch import nn

scenario = Registry()


def _copies(impl) -> dict:
    if not hasattr(impl, "weights"):
        return {}
    return {key: [t.numpy().copy() for t in getattr(impl, key)] for key in ("weights", "left", "right")}


@scenario
def decentralized(seed: int, rank: int, **options) -> dict:
    """:func:`train_run` with ``DecentralizedAlgorithm(**options)``."""
    from bagua_torch.algorithms.decentralized import DecentralizedAlgorithm

    return train_run(seed, rank, DecentralizedAlgorithm(**options))


@scenario
def low_precision_decentralized(seed: int, rank: int, **options) -> dict:
    """:func:`train_run` with ``LowPrecisionDecentralizedAlgorithm(**options)``."""
    from bagua_torch.algorithms.low_precision_decentralized import LowPrecisionDecentralizedAlgorithm

    return train_run(seed, rank, LowPrecisionDecentralizedAlgorithm(**options))


def train_run(seed: int, rank: int, algorithm) -> dict:
    """STEPS steps of momentum SGD; the weights the optimizer starts from at each step (after a Decentralized
    average) and after it, the final weights, the bucket layout and the algorithm's copies."""
    import bagua_torch

    model = make_mlp(seed + 1000 * (rank + 1))  # different on every rank: the wrap broadcasts rank 0's
    if rank == 0:
        model.load_state_dict(make_mlp(seed).state_dict())
    opt = make_optimizer(model)
    wrapped = bagua_torch.with_bagua(model, [opt], algorithm, bucket_bytes=SMALL_BUCKET)
    before = []  # registered after the wrapper's pre-hook, so it sees the averaged weights
    opt.register_step_pre_hook(lambda o, a, k: before.append(params_of(model)))
    after = []
    for step in range(STEPS):
        x, y = batch(seed, step, rank)
        opt.zero_grad()
        loss_fn(wrapped, x, y).backward()
        opt.step()
        after.append(params_of(model))
    impl = wrapped.algorithm_impl
    out = {
        "params": params_of(model),
        "before": before,
        "after": after,
        "layout": [(list(b.names), b.numel, b.size) for b in wrapped.buckets],
        "levels": impl.levels is not None,
        "step": impl.step,
        "copies": _copies(impl),
    }
    wrapped.close()
    return out


@scenario
def peers(rank: int, size: int) -> dict:
    """Which rank does shift_one pair this rank with? Weights set to the rank's index before each step, lr 0:
    after the step they are ``(rank + peer) / 2`` (exact), or ``rank`` on steps that do not communicate."""
    import bagua_torch
    from bagua_torch.algorithms.decentralized import DecentralizedAlgorithm

    out = {}
    for interval in (1, 2):
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        algorithm = DecentralizedAlgorithm("shift_one", communication_interval=interval, hierarchical=False)
        wrapped = bagua_torch.with_bagua(model, [opt], algorithm)
        values, reported = [], []
        for _ in range(2 * size):
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float(rank))
            opt.step()  # no gradients: the optimizer changes nothing, the pre-hook averages
            mixed = {float(v) for p in model.parameters() for v in p.detach().reshape(-1)}
            assert len(mixed) == 1, mixed
            values.append(mixed.pop())
            reported.append(wrapped.algorithm_impl.last_peer)
        out[interval] = {"values": values, "last_peer": reported}
        wrapped.close()
    return out


@scenario
def checkpoint(seed: int, rank: int) -> dict:
    """Save after 3 steps, continue 3; a fresh wrapped model loaded from the checkpoint continues identically, one
    that gets the weights but not the algorithm state does not."""
    from bagua_torch.algorithms.decentralized import DecentralizedAlgorithm
    from bagua_torch.algorithms.low_precision_decentralized import LowPrecisionDecentralizedAlgorithm

    out = {}
    for label, algorithm in (
        ("dec", DecentralizedAlgorithm("shift_one", communication_interval=2)),
        ("lowprec", LowPrecisionDecentralizedAlgorithm()),
    ):
        wrapped, model, opt, buffer = saved_after_training(
            algorithm, seed, lambda w, o: train(w, o, seed, range(3), rank)
        )
        saved_state = wrapped.algorithm_impl.state_dict()
        train(wrapped, opt, seed, range(3, 6), rank)
        continued = params_of(model)
        wrapped.close()

        def resume(with_state: bool, algorithm=algorithm, buffer=buffer) -> dict:
            return resumed_params(
                buffer, algorithm, seed, with_state, lambda w, o: train(w, o, seed, range(3, 6), rank)
            )

        out[label] = {
            "continued": continued,
            "resumed": resume(True),
            "without_state": resume(False),
            "saved_step": saved_state["step"],
            "saved_keys": sorted(saved_state),
        }
    return out


@scenario
def errors(rank: int) -> dict:
    """Configurations refused with a clear message on every rank (each call communicates only on wrap)."""
    import bagua_torch
    from bagua_torch.algorithms.decentralized import DecentralizedAlgorithm

    found = {}
    model = make_mlp(0)
    found["dec_no_optimizer"] = raised(lambda: bagua_torch.with_bagua(model, [], "decentralized"))
    found["lowprec_no_optimizer"] = raised(lambda: bagua_torch.with_bagua(model, [], "low_precision_decentralized"))
    double = make_mlp(0, torch.float64)
    found["lowprec_float64"] = raised(
        lambda: bagua_torch.with_bagua(double, [make_optimizer(double)], "low_precision_decentralized")
    )
    # float64 is fine for full-precision averaging, in both modes (shift_one averages in torch, not the kernel).
    for mode in ("all", "shift_one"):
        wrapped = bagua_torch.with_bagua(
            double, [opt := make_optimizer(double)], DecentralizedAlgorithm(peer_selection_mode=mode)
        )
        for step in range(2):
            x, y = batch(0, step, rank)
            opt.zero_grad()
            loss_fn(wrapped, x.double(), y.double()).backward()
            opt.step()
        found[f"dec_float64_{mode}"] = params_of(double)
        wrapped.close()
    # A checkpoint of another shape is refused by the algorithm itself.
    wrapped = bagua_torch.with_bagua(
        model, [make_optimizer(model)], "low_precision_decentralized", bucket_bytes=SMALL_BUCKET
    )
    state = wrapped.algorithm_impl.state_dict()
    state["left"] = state["left"][:-1]
    found["lowprec_bad_state"] = raised(lambda: wrapped.algorithm_impl.load_state_dict(state))
    wrapped.close()
    return found


def job(seed: int, scenarios: list[Scenario], local_world_size: int | None = None) -> dict:
    """``scenarios`` on this rank (gloo under the python launcher, the native MPI communicator under mpiexec);
    ``local_world_size`` lays the ranks out as nodes of that many ranks."""
    kwargs = {}
    if local_world_size:
        rank = int(os.environ.get("RANK", os.environ.get("PMI_RANK", "0")))
        kwargs = {"local_world_size": local_world_size, "local_rank": rank % local_world_size}
    group = setup(**kwargs)
    out = {
        "rank": group.rank,
        "size": group.size,
        "native": group.native,
        "world": type(group.world).__name__,
        "hierarchical": group.communicators.hierarchical,
    }
    out.update(scenario.run(scenarios, seed=seed, rank=group.rank, size=group.size))
    return out

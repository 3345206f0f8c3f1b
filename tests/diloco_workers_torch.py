"""Rank bodies for test_diloco_torch.py: DiLoCo through with_bagua over gloo.

The model and its targets are tests/diloco_reference.py's, so the test process can compare
each rank's parameters after every step with the NumPy simulation of all ranks.
"""

from __future__ import annotations

import io

import diloco_reference as ref
import numpy as np
import torch
from scenarios import Registry, Scenario, raised
from torch import nn

import bagua_torch
from bagua_torch.algorithms import DiLoCoAlgorithm

scenario = Registry()


class Quadratic(nn.Module):
    """Parameters ``a``, ``b``, ``c`` pulled towards the targets given to ``forward``."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        for name, value in ref.initial(seed).items():
            self.register_parameter(name, nn.Parameter(torch.from_numpy(value)))

    def forward(self, goal: dict[str, np.ndarray]) -> torch.Tensor:
        return sum(0.5 * ((getattr(self, k) - torch.from_numpy(goal[k])) ** 2).sum() for k in ref.SHAPES)


def wrap(seed: int, algorithm) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Quadratic(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=ref.INNER_LR)
    return bagua_torch.with_bagua(model, [optimizer], algorithm), optimizer


def train(model, optimizer, seed: int, rank: int, steps: range) -> list[dict[str, np.ndarray]]:
    history = []
    for t in steps:
        optimizer.zero_grad()
        model(ref.target(seed, t, rank)).backward()
        optimizer.step()
        history.append({k: p.detach().numpy().copy() for k, p in model.module.named_parameters()})
    return history


@scenario
def simulate(seed: int, rank: int, steps: int, **options) -> list[dict[str, np.ndarray]]:
    model, optimizer = wrap(seed, DiLoCoAlgorithm(**options))
    try:
        return train(model, optimizer, seed, rank, range(1, steps + 1))
    finally:
        model.close()


@scenario
def h1_and_allreduce(seed: int, rank: int) -> tuple[list, list]:
    runs = []
    outer = lambda params: torch.optim.SGD(params, lr=1.0)  # noqa: E731
    for algorithm in (DiLoCoAlgorithm(sync_every=1, outer_optimizer=outer), "gradient_allreduce"):
        model, optimizer = wrap(seed, algorithm)
        runs.append(train(model, optimizer, seed, rank, range(1, 7)))
        model.close()
    return runs[0], runs[1]


@scenario
def resume(seed: int, rank: int) -> tuple[list, list]:
    """Eleven steps straight, and the last five again from a checkpoint taken after step 6: fragment 0 mid-round,
    fragment 1's exchange on the wire."""
    algorithm = DiLoCoAlgorithm(sync_every=4, fragments=2, fragment_sync_delay=1, outer_exchange="uint8")
    model, optimizer = wrap(seed, algorithm)
    train(model, optimizer, seed, rank, range(1, 7))
    assert model.algorithm_impl.pending[1] is not None
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    straight = train(model, optimizer, seed, rank, range(7, 12))
    model.close()
    model, optimizer = wrap(seed + 1, algorithm)  # other starting weights, replaced by the checkpoint's
    buffer.seek(0)
    saved = torch.load(buffer)
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    resumed = train(model, optimizer, seed, rank, range(7, 12))
    model.close()
    return straight, resumed


def impl_state(model) -> dict[str, list[np.ndarray]]:
    """The algorithm's state as NumPy arrays: round start, pending averages, residuals, outer momentum."""
    state = model.algorithm_impl.state_dict()
    momentum = [v["momentum_buffer"] for outer in state["outer"] for v in outer["state"].values()]
    return {
        "step": state["step"],
        **{key: [t.numpy().copy() for t in state[key]] for key in ("round_start", "pending", "residuals")},
        "momentum": [t.numpy().copy() for t in momentum],
    }


@scenario
def reshard(seed: int, rank: int) -> dict:
    """Both ranks train six steps and save through bagua_torch.checkpoint; rank 0 alone restores into a world of one
    rank and trains on."""
    import os

    import torch.distributed as dist

    from bagua_torch.checkpoint import restore, save

    algorithm = DiLoCoAlgorithm(
        sync_every=4, fragments=2, fragment_sync_delay=1, outer_exchange="uint4", error_feedback=True
    )
    root = os.path.join(os.environ["BAGUA_TEST_WORKDIR"], "checkpoints")
    model, optimizer = wrap(seed, algorithm)
    saved_params = train(model, optimizer, seed, rank, range(1, 7))[-1]
    save(root, model, optimizer, step=6)
    out = {"saved": {"params": saved_params, **impl_state(model)}}
    model.close()
    if rank == 0:
        alone = dist.new_group([0], use_local_synchronization=True)
        model = Quadratic(seed + 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=ref.INNER_LR)
        model = bagua_torch.with_bagua(model, [optimizer], algorithm, process_group=alone)
        out["restored_step"] = restore(root, model, optimizer)
        params = {k: p.detach().numpy().copy() for k, p in model.module.named_parameters()}
        out["restored"] = {"params": params, **impl_state(model)}
        out["trained_on"] = train(model, optimizer, seed, rank, range(7, 10))[-1]
        model.close()
    return out


@scenario
def errors(seed: int) -> dict[str, str]:
    model = Quadratic(seed)
    return {
        "sync_every": raised(lambda: DiLoCoAlgorithm(sync_every=0)),
        "delay": raised(
            lambda: bagua_torch.algorithms.get_algorithm("diloco", sync_every=4, fragments=2, fragment_sync_delay=2)
        ),
        "fragments": raised(lambda: wrap(seed, DiLoCoAlgorithm(sync_every=4, fragments=4))),
        "no_optimizer": raised(lambda: bagua_torch.with_bagua(model, [], DiLoCoAlgorithm(sync_every=2))),
    }


SCENARIOS = [
    Scenario("simulate", {"steps": 9, "sync_every": 3}),
    Scenario(
        "simulate",
        {"steps": 9, "sync_every": 4, "fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.25},
    ),
    Scenario("h1_and_allreduce"),
    Scenario("resume"),
    Scenario("reshard"),
    Scenario("errors"),
]


def job(seed: int, scenarios: list[Scenario], local_world_size: int | None = None) -> dict:
    """``scenarios`` on this rank of a gloo job."""
    torch.set_num_threads(1)
    group = bagua_torch.init_process_group("gloo", timeout=60)
    out = {"rank": group.rank, "size": group.size}
    out.update(scenario.run(scenarios, seed=seed, rank=group.rank))
    return out

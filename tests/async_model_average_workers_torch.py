"""Rank bodies for test_async_model_average_torch.py: AsyncModelAverageAlgorithm through the PyTorch wrapper.

One job per configuration (gloo on 2 and 4 ranks, the native MPI communicator under
mpiexec) runs several scenarios and returns a dict per scenario. The task is the linear
regression of ``async_model_average_reference.py`` (plain NumPy data, each rank with its own optimum, so
ranks training alone drift apart), so the test process rebuilds every batch.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from async_model_average_reference import DIM, LR, abort_and_resume, batch, one_rank_stalls, rank_params
from scenarios import Registry, Scenario, raised
from torch import nn

scenario = Registry()


class Linear(nn.Module):
    """``x w + b`` from zeros: the linear model of async_model_average_reference.py."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(DIM))
        self.b = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + self.b


class TwoDtypes(nn.Module):
    """A float32 matrix and a bfloat16 vector (two buckets), for the update rule."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(5, 3))
        self.b = nn.Parameter(torch.zeros(7, dtype=torch.bfloat16))


def flat(model: Linear) -> np.ndarray:
    return np.concatenate([model.w.detach().numpy(), model.b.detach().numpy().reshape(1)]).copy()


def wrap(model: nn.Module, optimizer, algorithm, group):
    import bagua_torch

    return bagua_torch.with_bagua(model, [optimizer], algorithm, process_group=group)


def step(wrapped, optimizer, x: np.ndarray, y: np.ndarray) -> float:
    optimizer.zero_grad()
    residual = wrapped(torch.from_numpy(x)) - torch.from_numpy(y)
    loss = 0.5 * (residual**2).mean()
    loss.backward()
    optimizer.step()
    return float(loss)


def set_params(model: nn.Module, values: dict) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(np.asarray(values[name]).astype(np.float32)).to(p.dtype))


def params_np(model: nn.Module) -> dict:
    return {name: p.detach().float().numpy().copy() for name, p in model.named_parameters()}


# ----------------------------------------------------------------------------- scenarios


@scenario
def train(
    seed: int,
    rank: int,
    group,
    steps: int,
    warmup_steps: int,
    sync_interval_ms: float,
    sleep_s: float,
    compare_allreduce: bool = False,
) -> dict:
    """SGD with AsyncModelAverage: weights after every step, whether the thread ran after each step, rounds."""
    from bagua_torch.algorithms import AsyncModelAverageAlgorithm

    out = {}
    if compare_allreduce:  # the same steps with GradientAllReduce, in the same job
        model = Linear()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        wrapped = wrap(model, opt, "gradient_allreduce", group)
        history = []
        for t in range(steps):
            step(wrapped, opt, *batch(seed, rank, t))
            history.append(flat(model))
        wrapped.close()
        out["allreduce"] = np.stack(history)
    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    algo = AsyncModelAverageAlgorithm(sync_interval_ms=sync_interval_ms, warmup_steps=warmup_steps)
    wrapped = wrap(model, opt, algo, group)
    impl = wrapped.algorithm_impl
    history, running, hooks = [], [], []
    for t in range(steps):
        hooks.append(impl.need_gradient_hooks)
        step(wrapped, opt, *batch(seed, rank, t))
        history.append(flat(model))
        running.append(impl.running)
        time.sleep(sleep_s)
    impl.abort()
    out.update(
        history=np.stack(history),
        running=running,
        hooks=hooks,
        rounds=impl.rounds,
        joined=not impl.running,
        steps=impl.steps,
        comm=type(impl.comm).__name__,
    )
    wrapped.close()
    return out


@scenario
def one_round(seed: int, rank: int, group) -> dict:
    """Force exactly one round with the snapshot ``p0``, apply it to ``p1``; a later step, with no round
    finished, must leave the weights ``p2`` unchanged. Steps are ``opt.step()`` with no gradients (the
    optimizer skips the parameters; the wrapper's step hooks run)."""
    from bagua_torch.algorithms import AsyncModelAverageAlgorithm

    p0, p1, p2 = (rank_params(seed, rank, tag) for tag in range(3))
    model = TwoDtypes()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    # A minute between rounds: round 0 starts at once, round 1 never within this test.
    wrapped = wrap(model, opt, AsyncModelAverageAlgorithm(sync_interval_ms=60_000), group)
    impl = wrapped.algorithm_impl
    started = impl.running and not impl.need_gradient_hooks
    set_params(model, p0)
    deadline = time.monotonic() + 30
    corrected_from = None
    while impl.rounds < 1 and time.monotonic() < deadline:
        opt.step()  # hands p0 over as the snapshot when the thread asks
        if any(not np.array_equal(v, np.asarray(p0[k]).astype(np.float32)) for k, v in params_np(model).items()):
            corrected_from = 0  # the round finished between the check and the step
            break
        time.sleep(0.001)
    if corrected_from is None:
        corrected_from = 1
        set_params(model, p1)
        opt.step()
    out_params = {name: p.detach().clone() for name, p in model.named_parameters()}
    set_params(model, p2)
    start = time.monotonic()
    opt.step()
    idle_step_s = time.monotonic() - start
    unchanged = all(np.array_equal(v, np.asarray(p2[k]).astype(np.float32)) for k, v in params_np(model).items())
    impl.abort()
    result = {
        "started": started,
        "corrected_from": corrected_from,
        "out": {k: (v.float().numpy(), str(v.dtype)) for k, v in out_params.items()},
        "unchanged": unchanged,
        "idle_step_s": idle_step_s,
        "rounds": impl.rounds,
        "joined": not impl.running,
    }
    wrapped.close()
    return result


@scenario
def abort_resume(seed: int, rank: int, group) -> dict:
    """Abort at staggered times on every rank, resume, abort on rank 0 only, resume and abort at once."""
    from bagua_torch.algorithms import AsyncModelAverageAlgorithm

    model = TwoDtypes()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    wrapped = wrap(model, opt, AsyncModelAverageAlgorithm(sync_interval_ms=1), group)
    impl = wrapped.algorithm_impl
    set_params(model, rank_params(seed, rank, 0))

    def steps(n: int) -> None:
        for _ in range(n):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * (rank + 1))  # local progress
            opt.step()
            time.sleep(0.001)

    out = abort_and_resume(impl, steps, rank, lambda: raised(lambda: (impl.resume(), impl.resume())))
    impl.resume()
    wrapped.close()  # close() aborts too
    out["closed"] = (impl.rounds, impl.running)
    return out


@scenario
def never_waits(rank: int, group, stall_s: float) -> dict:
    """Rank 1 stops stepping for ``stall_s`` seconds, which keeps rank 0's round in flight; rank 0 keeps
    stepping and times every ``opt.step()`` (where rounds are applied)."""
    from bagua_torch.algorithms import AsyncModelAverageAlgorithm

    model = nn.Linear(256, 256)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    wrapped = wrap(model, opt, AsyncModelAverageAlgorithm(sync_interval_ms=1), group)
    impl = wrapped.algorithm_impl
    deadline = time.monotonic() + 30
    while impl.rounds < 3 and time.monotonic() < deadline:  # get rounds going first
        opt.step()
        time.sleep(0.001)
    group.world.barrier()

    def timed_step() -> float:
        t0 = time.perf_counter()
        opt.step()
        return time.perf_counter() - t0

    out = one_rank_stalls(impl, opt.step, timed_step, rank, stall_s)
    wrapped.close()
    return out


@scenario
def checkpoint(seed: int, rank: int, group) -> dict:
    """Warm-up of 5 steps interrupted after 3: the restored step counter keeps the gradient allreduce for
    exactly 2 more steps, and the weights equal an uninterrupted run's."""
    from bagua_torch.algorithms import AsyncModelAverageAlgorithm

    algo = AsyncModelAverageAlgorithm(sync_interval_ms=1, warmup_steps=5)

    def fresh():
        model = Linear()
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        return model, opt, wrap(model, opt, algo, group)

    model, opt, wrapped = fresh()
    for t in range(5):
        step(wrapped, opt, *batch(seed, rank, t))
    straight = flat(model)
    wrapped.close()

    model, opt, wrapped = fresh()
    for t in range(3):
        step(wrapped, opt, *batch(seed, rank, t))
    saved = wrapped.state_dict()
    wrapped.close()
    model, opt, wrapped = fresh()
    wrapped.load_state_dict(saved)
    set_params(model, {"w": saved["module.w"], "b": saved["module.b"]})
    impl = wrapped.algorithm_impl
    out = {"saved_state": saved["_extra_state"]["algorithm_state"], "hooks": [], "running": []}
    for t in range(3, 5):
        out["hooks"].append(impl.need_gradient_hooks)
        out["running"].append(impl.running)
        step(wrapped, opt, *batch(seed, rank, t))
    out["hooks"].append(impl.need_gradient_hooks)
    out["running"].append(impl.running)
    out["resumed"], out["straight"] = flat(model), straight
    out["bad_state"] = [raised(lambda s=s: impl.load_state_dict(s)) for s in ({"steps": -1}, {"steps": 1, "x": 2}, {})]
    wrapped.close()
    return out


@scenario
def errors(rank: int, group) -> dict:
    import bagua_torch
    from bagua_torch.algorithms import AsyncModelAverageAlgorithm

    out = {}
    model = Linear()
    out["no_optimizer"] = raised(lambda: bagua_torch.with_bagua(model, [], "async", process_group=group))
    model64 = Linear().double()
    opt = torch.optim.SGD(model64.parameters(), lr=LR)
    out["float64"] = raised(lambda: wrap(model64, opt, "async", group))
    model = Linear()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    wrapped = wrap(model, opt, AsyncModelAverageAlgorithm(warmup_steps=2), group)
    out["resume_running"] = raised(wrapped.algorithm_impl.resume)
    wrapped.close()
    wrapped.close()  # idempotent
    return out


# ----------------------------------------------------------------------------- the job


def job(seed: int, scenarios: list[Scenario], local_world_size: None = None) -> dict:
    """``scenarios`` on this rank, in one process group (gloo, or the native MPI communicator under mpiexec)."""
    torch.set_num_threads(1)
    import bagua_torch

    group = bagua_torch.init_process_group(timeout=60)
    out = {"rank": group.rank, "size": group.size, "native": group.native}
    out.update(scenario.run(scenarios, seed=seed, rank=group.rank, group=group))
    # Rank 0 hosts the store: no rank may exit while another still sets up a group through it.
    torch.distributed.barrier()
    return out

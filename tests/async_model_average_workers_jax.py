"""Rank bodies for test_async_model_average_jax.py (run under mpiexec, one process per rank).

One job per world size runs several scenarios (``job``) and returns a dict per scenario. The data are
``async_model_average_reference.py``'s, so that the tests rebuild exactly the batches each rank trained on.
"""

from __future__ import annotations

import time

import numpy as np
from async_model_average_reference import DIM, LR, abort_and_resume, batch, one_rank_stalls, rank_params
from scenarios import Registry, Scenario

scenario = Registry()


def _setup(sync_interval_ms: float, warmup_steps: int):
    """The world communicator, the algorithm, its jitted train step and zero parameters."""
    import jax
    import jax.numpy as jnp
    import optax

    from bagua_jax.algorithms.async_model_average import AsyncModelAverage
    from bagua_jax.algorithms.base import Communicators
    from bagua_jax.native_communicator import NativeCommunicator

    world = NativeCommunicator.mpi_world(timeout=60)
    algo = AsyncModelAverage(sync_interval_ms=sync_interval_ms, warmup_steps=warmup_steps)
    tx = algo.transformation(optax.sgd(LR), Communicators(world))

    def loss(params, x, y):
        return 0.5 * jnp.mean((x @ params["w"] + params["b"] - y) ** 2)

    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = {"w": jnp.zeros(DIM, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    return world, algo, step, params, tx.init(params)


def _flat(params) -> np.ndarray:
    return np.concatenate([np.asarray(params["w"]), np.asarray(params["b"]).reshape(1)])


@scenario
def train(seed: int, steps: int, warmup_steps: int, sync_interval_ms: float, sleep_s: float) -> dict:
    """Train the linear model with SGD and AsyncModelAverage; return the weights after every step,
    whether the thread ran after each step, and the rounds completed."""
    from bagua_jax.native_communicator import NativeCommunicator

    world, algo, step, params, opt_state = _setup(sync_interval_ms, warmup_steps)
    rank = int(world.rank())
    averager = algo.averager(params, NativeCommunicator.mpi_world(timeout=60))
    history, running = [], []
    for t in range(steps):
        x, y = batch(seed, rank, t)
        params, opt_state = step(params, opt_state, x, y)
        params = averager.apply(params)
        history.append(_flat(params))
        running.append(averager.running)
        time.sleep(sleep_s)
    averager.abort()
    return {
        "rank": rank,
        "history": np.stack(history),
        "running": running,
        "rounds": averager.rounds,
        "joined": not averager.running,
    }


@scenario
def one_round(seed: int) -> dict:
    """Force exactly one round with the snapshot ``p0``, then apply it to ``p1``; a later call,
    with no round finished, must return its input unchanged."""
    import jax
    import jax.numpy as jnp

    from bagua_jax.algorithms.async_model_average import AsyncModelAverage
    from bagua_jax.counting import CountingCommunicator
    from bagua_jax.native_communicator import NativeCommunicator

    comm = NativeCommunicator.mpi_world(timeout=60)
    rank = int(comm.rank())
    p0, p1, p2 = (jax.tree.map(jnp.asarray, rank_params(seed, rank, tag)) for tag in range(3))
    # A minute between rounds: round 0 starts at once, round 1 never within this test. The
    # warm-up is over already (as after restoring a checkpoint), so the thread starts at once.
    algo = AsyncModelAverage(sync_interval_ms=60_000, warmup_steps=3)
    averager = algo.averager(p0, CountingCommunicator(comm), steps_done=3)  # a wrapper: its engine runs the rounds
    started = averager.running
    deadline = time.monotonic() + 30
    corrected_from, out = None, None
    while averager.rounds < 1 and time.monotonic() < deadline:
        out = averager.apply(p0)  # hands p0 over as the snapshot when the thread asks
        if out is not p0:  # the round finished between the check and the call
            corrected_from = 0
            break
        time.sleep(0.001)
    if corrected_from is None:
        corrected_from, out = 1, averager.apply(p1)
    start = time.monotonic()
    unchanged = averager.apply(p2) is p2
    idle_apply_s = time.monotonic() - start
    averager.abort()
    return {
        "rank": rank,
        "started": started,
        "corrected_from": corrected_from,
        "out": jax.tree.map(np.asarray, out),
        "unchanged": unchanged,
        "idle_apply_s": idle_apply_s,
        "rounds": averager.rounds,
        "joined": not averager.running,
    }


@scenario
def abort_resume(seed: int) -> dict:
    """Abort at staggered times on every rank, resume, abort on rank 0 only, resume and abort at once."""
    import jax
    import jax.numpy as jnp

    from bagua_jax.algorithms.async_model_average import AsyncModelAverage
    from bagua_jax.native_communicator import NativeCommunicator

    comm = NativeCommunicator.mpi_world(timeout=60)
    rank = int(comm.rank())
    params = jax.tree.map(jnp.asarray, rank_params(seed, rank, 0))
    drift = jax.jit(lambda p: jax.tree.map(lambda x: x + 0.01 * (rank + 1), p))
    averager = AsyncModelAverage(sync_interval_ms=1).averager(params, comm)

    def steps(n: int):
        nonlocal params
        for _ in range(n):
            params = averager.apply(drift(params))
            time.sleep(0.001)

    return {"rank": rank, **abort_and_resume(averager, steps, rank, averager.resume)}


@scenario
def never_waits(stall_s: float) -> dict:
    """Rank 1 stops calling apply() for ``stall_s`` seconds, which keeps rank 0's round in flight;
    rank 0 keeps stepping and times every apply()."""
    import jax
    import jax.numpy as jnp

    from bagua_jax.algorithms.async_model_average import AsyncModelAverage
    from bagua_jax.native_communicator import NativeCommunicator

    world = NativeCommunicator.mpi_world(timeout=60)
    rank = int(world.rank())
    params = {"w": jnp.full((512, 512), float(rank), jnp.float32)}
    local_step = jax.jit(lambda p: jax.tree.map(lambda x: x * 0.999 + 0.001, p))
    averager = AsyncModelAverage(sync_interval_ms=1).averager(params, NativeCommunicator.mpi_world(timeout=60))
    # Get rounds going (and the correction compiled) before measuring.
    deadline = time.monotonic() + 30
    while averager.rounds < 3 and time.monotonic() < deadline:
        params = averager.apply(local_step(params))
        time.sleep(0.001)
    world.barrier(jnp.zeros(())).block_until_ready()

    def step() -> None:
        nonlocal params
        params = averager.apply(local_step(params))

    def timed_apply() -> float:
        nonlocal params
        params = local_step(params)
        t0 = time.perf_counter()
        params = jax.block_until_ready(averager.apply(params))
        return time.perf_counter() - t0

    return {"rank": rank, **one_rank_stalls(averager, step, timed_apply, rank, stall_s)}


def job(seed: int, scenarios: list[Scenario], local_world_size: None = None) -> dict:
    """``scenarios`` on this rank, one after the other (each on communicators of its own over the MPI world)."""
    from bagua_jax.native_communicator import NativeCommunicator

    return {"rank": int(NativeCommunicator.mpi_world(timeout=60).rank()), **scenario.run(scenarios, seed=seed)}

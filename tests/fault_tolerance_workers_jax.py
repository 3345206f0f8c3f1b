"""Ranks of the JAX trainer's fault-tolerance test (test_fault_tolerance_jax.py).

Three members train a linear model with gradient allreduce over the native MPI engine, each its own
``mpiexec -n 1`` job joined through the fault-tolerant membership (rank 0's store on MASTER_PORT). ``FAULT``
happens to member ``VICTIM`` while the others are blocked in step ``FAULT_STEP``'s allreduce: ``kill``
(SIGKILL), ``raise`` (an exception ends the process) or ``stop`` (SIGSTOP: a hang, found by heartbeats). A fourth
process joins the running job once the survivors committed that step, and trains to the end with them.
Every member records, per committed step, the sample indices it trained on, its loss, and the times.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np

from bagua_common.fault_tolerance import DataPosition, FaultToleranceSettings, Membership

SAMPLES, FEATURES, BATCH_PER_RANK, STEPS, LR = 120, 5, 4, 10, 0.1
SETTINGS = FaultToleranceSettings(heartbeat_period=0.1, dead_after=1.0, quorum_timeout=30.0, hash_every=2)


def dataset() -> tuple[np.ndarray, np.ndarray]:
    """A seeded linear-regression data set (the test's reference uses the same)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    y = (x @ rng.standard_normal(FEATURES) + 0.1 * rng.standard_normal(SAMPLES)).astype(np.float32)
    return x, y


def train(victim: int, fault: str, fault_step: int, start_size: int) -> dict:
    """Train to STEPS committed steps; returns this member's record (the victim never returns)."""
    import jax.numpy as jnp
    import optax

    from bagua_jax.fault_tolerance import FaultTolerantTrainer
    from bagua_jax.native_communicator import NativeCommunicator
    from bagua_jax.trainer import DataParallel

    rank = int(os.environ["RANK"])
    signals = os.environ["BAGUA_TEST_SIGNALS"]  # files the test and the members exchange
    with open(os.path.join(signals, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    master = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    joiner = rank >= start_size
    started = time.time()
    if joiner:
        while not os.path.exists(os.path.join(signals, "start-joiner")):
            time.sleep(0.05)
        with open(os.path.join(signals, "joiner-asks"), "w"):
            pass
        membership = Membership.join(SETTINGS, *master, timeout=60)
        epoch = membership.epoch
        comm = NativeCommunicator.mpi_join(epoch.store, epoch.prefix("mpi/"), epoch.rank, epoch.size, timeout=60)
    else:
        membership = Membership.start(SETTINGS, rank, start_size, *master, timeout=60)
        comm = NativeCommunicator.mpi_through_store(membership.epoch.store, "world/", rank, start_size, timeout=60)
    admitted = time.time()
    x, y = dataset()

    def loss_fn(params, batch):
        features, targets = batch
        return jnp.mean((features @ params["w"] + params["b"] - targets) ** 2)

    trainer = DataParallel(loss_fn, optax.sgd(LR), "gradient_allreduce", communicator=comm)
    ft = FaultTolerantTrainer(trainer, membership, DataPosition(SAMPLES, BATCH_PER_RANK, seed=3))
    state = ft.init({"w": jnp.zeros(FEATURES, jnp.float32), "b": jnp.zeros((), jnp.float32)})
    steps = []

    def batch_of(indices):
        transaction = ft.committed + 1
        steps.append(
            {
                "transaction": transaction,
                "epoch": ft.epoch.number,
                "size": ft.epoch.size,
                "rank": ft.epoch.rank,
                "indices": indices.tolist(),
                "start": time.time(),
            }
        )
        if rank == victim and transaction == fault_step:
            time.sleep(0.5)  # the others are blocked in the step's allreduce by now
            with open(os.path.join(signals, "fault-time"), "w") as f:
                f.write(repr(time.time()))
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            raise RuntimeError("the victim fails on purpose")
        if transaction > fault_step and ft.epoch.size < start_size:  # give the joiner's request time to arrive
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(signals, "joiner-asks")) and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.3)
        return x[indices], y[indices]

    first_commit = None
    while ft.committed < STEPS:
        state, loss = ft.step(state, batch_of)
        steps[-1].update(committed=ft.committed, loss=float(loss), end=time.time())
        first_commit = first_commit or time.time()
        if ft.committed == fault_step and ft.epoch.rank == 0:  # the survivors went on: let the joiner come
            with open(os.path.join(signals, "start-joiner"), "w"):
                pass
    params = {k: np.asarray(v) for k, v in state.params.items()}
    membership.close()
    return {
        "steps": [s for s in steps if "committed" in s],
        "attempts": steps,
        "params": params,
        "recoveries": ft.recoveries,
        "started": started,
        "admitted": admitted,
        "first_commit": first_commit,
        "compiled": trainer._step_fn(False, False)._cache_size(),
    }

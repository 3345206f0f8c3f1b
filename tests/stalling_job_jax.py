"""A fault-tolerant JAX job whose rank 1 starts one step past the collective timeout at every attempt, alive.

``tests/test_fault_tolerance_jax.py`` runs it under ``bagua-launch --fault-tolerant --mpi`` with a short
``BAGUA_COMM_TIMEOUT``: every attempt of that step times out with nobody lost, and the members stop with NoProgress.
"""

from __future__ import annotations

import os
import time

import jax.numpy as jnp
import numpy as np
import optax

from bagua_common.fault_tolerance import DataPosition, FaultToleranceSettings, Membership
from bagua_jax import DataParallel, NativeCommunicator
from bagua_jax.fault_tolerance import FaultTolerantTrainer

STALLED_STEP = 5


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] - y) ** 2)


def main() -> None:
    x = np.random.default_rng(0).normal(size=(512, 4)).astype(np.float32)
    y = x.sum(axis=1)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    settings = FaultToleranceSettings.from_environment()
    membership = Membership.start(settings, rank, size, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    comm = NativeCommunicator.mpi_through_store(membership.epoch.store, "world/", rank, size)
    trainer = DataParallel(loss_fn, optax.sgd(0.1), "gradient_allreduce", communicator=comm)
    ft = FaultTolerantTrainer(trainer, membership, DataPosition(len(x), batch_per_rank=16))
    # An unused 1.3-MB leaf: a step this large leaves JAX's ordering token failed when its collective fails.
    state = ft.init({"w": np.zeros(4, np.float32), "unused": np.zeros(327_680, np.float32)})
    late = float(os.environ["BAGUA_COMM_TIMEOUT"]) + 1.5

    def batch_of(indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if rank == 1 and int(state.step) == STALLED_STEP:
            time.sleep(late)
        return x[indices], y[indices]

    while int(state.step) < 20:
        state, _ = ft.step(state, batch_of)


if __name__ == "__main__":
    main()

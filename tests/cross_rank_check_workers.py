"""Rank functions for tests/test_cross_rank_check_jax.py (run by multiprocess.run_ranks).

Each rank builds a :class:`bagua_jax.DataParallel` trainer from the case's per-rank model
and algorithm and calls ``init``, which compares the ranks before the first step. A rank
returns ``"ok"`` and its first step's loss, or the text of the error ``init`` raised.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from bagua_jax.algorithms import ByteGrad, GradientAllReduce
from bagua_jax.native_communicator import NativeCommunicator
from bagua_jax.trainer import DataParallel


class CustomAverage:
    """A custom algorithm that is not a dataclass (its ``repr`` holds its address)."""

    def __init__(self, scale: float):
        self.scale = scale

    def transformation(self, optimizer, comms):
        def update(grads, state, params=None, **extra):
            grads = jax.tree.map(
                lambda g: comms.world.allreduce(g * self.scale, "avg"), grads
            )
            return optimizer.update(grads, state, params)

        return optax.GradientTransformationExtraArgs(optimizer.init, update)


def model(rank: int, case: str) -> dict:
    width = 5 if case == "shape" and rank == 1 else 4
    dtype = jnp.bfloat16 if case == "dtype" and rank == 1 else jnp.float32
    params = {
        "dense": {
            "w": jnp.zeros((3, width), dtype),
            "b": jnp.zeros((width,), jnp.float32),
        }
    }
    if case == "extra_leaf" and rank == 1:
        params["head"] = jnp.zeros((2,), jnp.float32)
    return params


def algorithm(rank: int, case: str):
    if case == "algorithm":
        return ByteGrad() if rank == 1 else GradientAllReduce()
    if case == "field":
        return GradientAllReduce(average=rank != 1)
    if case in ("custom_same", "custom_field"):
        return CustomAverage(2.0 if case == "custom_field" and rank == 1 else 1.0)
    return GradientAllReduce()


def loss_fn(params, batch):
    dense = params["dense"]
    out = batch @ dense["w"].astype(jnp.float32) + dense["b"]
    return jnp.mean(out**2)


def check(case: str, mode: str) -> str:
    """Build this rank's trainer for ``case`` in ``mode`` ("native" or "mesh"), init it, take one step."""
    if mode == "native":
        comm = NativeCommunicator.mpi_world(timeout=60)
        rank = int(comm.rank())
        kwargs = {"communicator": comm}
    else:
        from bagua_jax.distributed import initialize

        initialize()
        rank = jax.process_index()
        kwargs = {"mesh": Mesh(np.array(jax.devices()), ("r",))}
    dp = DataParallel(loss_fn, optax.sgd(0.1), algorithm(rank, case), **kwargs)
    try:
        state = dp.init(model(rank, case))
    except ValueError as error:
        return str(error)
    batch = np.ones(
        (dp.size if mode == "mesh" and jax.process_count() == 1 else 1, 3), np.float32
    )
    _, loss = dp.step(state, batch)
    return f"ok {float(loss)}"

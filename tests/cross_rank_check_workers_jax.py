"""Rank functions for tests/test_cross_rank_check_jax.py (run by multiprocess.run_ranks).

For each case every rank builds a :class:`bagua_jax.trainer.DataParallel` trainer from its
own model and algorithm (differing on rank 1 as the case says) and calls ``init``, which
compares the ranks before the first step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from bagua_jax.algorithms import ByteGrad, GradientAllReduce
from bagua_jax.distributed import initialize
from bagua_jax.native_communicator import NativeCommunicator
from bagua_jax.trainer import DataParallel


class CustomAverage:
    """A custom algorithm that is not a dataclass (its ``repr`` holds its address)."""

    def __init__(self, scale: float):
        self.scale = scale

    def transformation(self, optimizer, comms):
        def update(grads, state, params=None, **extra):
            grads = jax.tree.map(lambda g: comms.world.allreduce(g * self.scale, "avg"), grads)
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


CASES = (
    "same",
    "shape",
    "dtype",
    "extra_leaf",
    "algorithm",
    "field",
    "custom_same",
    "custom_field",
)


def check_cases(mode: str) -> dict[str, str]:
    """Every case in turn on this rank, in ``mode`` ("native": the MPI engine, or "mesh":
    ``jax.distributed``): ``"ok <first loss>"`` or the text of the error ``init`` raised."""
    if mode == "native":
        comm = NativeCommunicator.mpi_world(timeout=60)
        rank = int(comm.rank())
        kwargs = {"communicator": comm}
    else:
        initialize(timeout=60)
        rank = jax.process_index()
        kwargs = {"mesh": Mesh(np.array(jax.devices()), ("r",))}
    results = {}
    for case in CASES:
        dp = DataParallel(loss_fn, optax.sgd(0.1), algorithm(rank, case), **kwargs)
        try:
            state = dp.init(model(rank, case))
        except ValueError as error:
            results[case] = str(error)
            continue
        _, loss = dp.step(state, np.full((1, 3), rank + 1.0, np.float32))
        results[case] = f"ok {float(loss)}"
    return results

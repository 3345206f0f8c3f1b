"""Rank bodies for test_mpi_ring_min_bytes.py (run under mpiexec): the ring threshold set at run time."""

import os

import numpy as np
from native_communicator_workers_jax import rank_data

SMALL = 1000  # floats: far below the default threshold


def jax_threshold(seed: int, large: int) -> dict:
    """The JAX communicator's threshold as read and set, and allreduces around each setting, through one
    jitted function (compiled once whatever the threshold)."""
    import jax

    from bagua_jax.native_communicator import NativeCommunicator

    comm = NativeCommunicator.mpi_world(timeout=60)
    rank = int(comm.rank())
    out = {"rank": rank, "spans_nodes": comm.spans_nodes, "initial": comm.mpi_ring_min_bytes}
    total = jax.jit(lambda v: comm.allreduce(v, "sum"))
    small, big = rank_data(rank, seed, (SMALL,)), rank_data(rank, seed, (large,))
    out["small_default"] = np.asarray(total(small))
    comm.set_mpi_ring_min_bytes(0)
    out["after_zero"] = comm.mpi_ring_min_bytes
    out["small_ring"] = np.asarray(total(small))
    out["compiles"] = total._cache_size()  # the same program before and after the switch
    out["split_inherits"] = comm.split(rank % 2, rank, "half").mpi_ring_min_bytes
    comm.set_mpi_ring_min_bytes(2**62)
    out["big_never"] = np.asarray(total(big))
    for bad in (-1, True, 1.5):
        try:
            comm.set_mpi_ring_min_bytes(bad)
            out[f"bad {bad!r}"] = "accepted"
        except (TypeError, ValueError) as error:
            out[f"bad {bad!r}"] = f"{type(error).__name__}: {error}"
    out["unchanged"] = comm.mpi_ring_min_bytes
    return out


def torch_threshold(seed: int) -> dict:
    """The torch native communicator's threshold, set at 0 between two allreduces of a small tensor."""
    import torch

    from bagua_torch.communicator import NativeCommunicator

    comm = NativeCommunicator.mpi_world(timeout=60)
    x = torch.from_numpy(rank_data(comm.rank, seed, (SMALL,)))
    out = {"rank": comm.rank, "spans_nodes": comm.spans_nodes, "initial": comm.mpi_ring_min_bytes}
    out["small_default"] = comm.allreduce(x, "sum").numpy()
    comm.set_mpi_ring_min_bytes(0)
    out["small_ring"] = comm.allreduce(x, "sum").numpy()
    out["after_zero"] = comm.mpi_ring_min_bytes
    comm.close()
    return out


def environment_threshold(per_rank: list[str] | None = None) -> str:
    """What ``BAGUA_MPI_RING_MIN_BYTES`` (``per_rank[rank]`` if given) makes of a new world communicator:
    its threshold, or the error."""
    from bagua_jax.native_communicator import NativeCommunicator

    if per_rank is not None:
        os.environ["BAGUA_MPI_RING_MIN_BYTES"] = per_rank[int(os.environ["RANK"])]

    try:
        return str(NativeCommunicator.mpi_world(timeout=60).mpi_ring_min_bytes)
    except ValueError as error:
        return f"ValueError: {error} ({os.environ['BAGUA_MPI_RING_MIN_BYTES']})"

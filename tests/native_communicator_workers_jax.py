"""Rank bodies for test_native_communicator_jax.py (run under mpiexec): a job runs several scenarios (``job``)."""

import os

import numpy as np
from every_primitive import OPS, rank_data, run_every_primitive
from scenarios import Registry, Scenario

scenario = Registry()


@scenario
def every_primitive(seed: int) -> dict:
    """Run each collective of the MPI world once inside one jitted step; return the local results."""
    from bagua_jax.native_communicator import NativeCommunicator

    return run_every_primitive(NativeCommunicator.mpi_world(timeout=60), seed)


@scenario
def large_allreduces(seed: int, count: int) -> dict:
    """Allreduces of ``count`` elements: float32 with every op (jitted), float16, bfloat16 and
    int32 sums, and a float32 sum in place through the engine's DLPack binding."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    from bagua_common.comm.collectives import ReduceOp
    from bagua_jax.native_communicator import NativeCommunicator

    comm = NativeCommunicator.mpi_world(timeout=60)
    rank = int(comm.rank())
    x = rank_data(rank, seed, (count,))
    out = {f"float32_{op}": np.asarray(jax.jit(lambda v, op=op: comm.allreduce(v, op))(x)) for op in OPS}
    for dtype in (np.float16, ml_dtypes.bfloat16):
        out[f"{np.dtype(dtype).name}_sum"] = np.asarray(comm.allreduce(jnp.asarray(x.astype(dtype))))
    out["int32_sum"] = np.asarray(comm.allreduce(jnp.asarray((x * 1000).astype(np.int32))))
    in_place = x.copy()
    comm.engine.allreduce(comm.handle, in_place, in_place, ReduceOp.SUM.code)
    out["float32_sum_in_place"] = in_place
    return {"rank": rank, **out}


def dies_or_waits(rank_to_die: int, count: int = 1000) -> str:
    """One rank exits abruptly; the others enter an allreduce of ``count`` floats and must get an error."""
    import jax.numpy as jnp

    from bagua_jax.native_communicator import NativeCommunicator

    comm = NativeCommunicator.mpi_world(timeout=3)
    if int(comm.rank()) == rank_to_die:
        os._exit(17)
    try:
        comm.allreduce(jnp.ones(count)).block_until_ready()
    except Exception as error:  # what a user sees
        return f"{type(error).__name__}: {error}"
    return "no error"


@scenario
def opposite_orders(n: int) -> np.ndarray:
    """Rank 0 sends then receives; rank 1 receives then sends, in one jitted step.

    The messages are large (beyond MPI's eager limit), so a send only completes once
    matched: if either rank's two calls were reordered, both would wait forever.
    """
    import jax
    import jax.numpy as jnp

    from bagua_jax.native_communicator import NativeCommunicator

    comm = NativeCommunicator.mpi_world(timeout=30)
    rank = int(comm.rank())
    mine = jnp.full(n, rank + 1.0, jnp.float32)

    @jax.jit
    def step(x):
        if rank == 0:
            comm.send(x, 1)
            return comm.recv((n,), jnp.float32, 1)
        received = comm.recv((n,), jnp.float32, 0)
        comm.send(x * 10, 0)
        return received

    return np.asarray(step(mine))


def job(seed: int, scenarios: list[Scenario], local_world_size: None = None) -> dict:
    """``scenarios`` on this rank, one after the other."""
    from bagua_jax.native_communicator import NativeCommunicator

    return {"rank": int(NativeCommunicator.mpi_world(timeout=60).rank()), **scenario.run(scenarios, seed=seed)}


def weighed_average(seed: int, count: int) -> dict:
    """The last rank sends zeros in an average that divides by the others, then in one over all; through one jitted
    function (the divisor is run-time state); and the divisor's refusals."""
    import jax

    from bagua_jax.native_communicator import NativeCommunicator

    comm = NativeCommunicator.mpi_world(timeout=60)
    rank, size = int(comm.rank()), comm.size
    mean = jax.jit(lambda v: comm.allreduce(v, "avg"))
    data = rank_data(rank, seed, (count,))
    comm.set_average_divisor(size - 1)
    out = {"weighed": np.asarray(mean(data if rank < size - 1 else np.zeros_like(data)))}
    comm.set_average_divisor(None)
    out["all"], out["compiles"] = np.asarray(mean(data)), mean._cache_size()
    for bad in (0, size + 1):
        try:
            comm.set_average_divisor(bad)
            out[f"bad {bad}"] = "accepted"
        except ValueError as error:
            out[f"bad {bad}"] = str(error)
    return out


def late_peer(count: int, late_seconds: float) -> dict:
    """:func:`exchange_with_a_late_peer` over the MPI engine."""
    from bagua_jax.native_communicator import NativeCommunicator

    return exchange_with_a_late_peer(NativeCommunicator.mpi_world(timeout=60), count, late_seconds)


def exchange_with_a_late_peer(comm, count: int, late_seconds: float) -> dict:
    """Rank 0 enters a ``send_recv`` of ``count`` floats with rank 1 at once, rank 1 ``late_seconds`` later; rank 1
    counts the loopback bytes sent while it waits (rank 0's data, had it not waited for rank 1's receive)."""
    import time

    import jax
    import jax.numpy as jnp
    from harness.links import bytes_sent

    rank = int(comm.rank())
    exchange = jax.jit(lambda x: comm.send_recv(x, jnp.array([1 - rank], jnp.int32))[0])
    mine = jnp.full(count, rank + 1.0, jnp.float32)
    exchange.lower(mine).compile()
    np.asarray(exchange(jnp.zeros(1, jnp.float32)))  # connects the two
    before = bytes_sent(loopback=True)
    np.asarray(exchange(jnp.zeros(1, jnp.float32)))  # rank 0 goes on only once rank 1 has counted
    sent_while_late = None
    if rank == 1:
        time.sleep(late_seconds)
        sent_while_late = bytes_sent(loopback=True) - before
    return {"received": np.asarray(exchange(mine)), "sent_while_late": sent_while_late}

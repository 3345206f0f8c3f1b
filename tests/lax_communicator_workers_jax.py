"""Rank functions for tests/test_lax_communicator_processes_jax.py (run by multiprocess.run_ranks).

Each process is one JAX process with one CPU device; ``jax.distributed`` joins
them, and XLA's gloo CPU collectives carry the data between processes. The test
launches the ranks with its own ``XLA_FLAGS`` (not the four simulated devices
conftest.py sets for the in-process tests), so importing this module has no
side effects and the test can reuse the input generators below.
"""

from __future__ import annotations

import os
import time

import jax
import ml_dtypes
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bagua_jax import LaxCommunicator

BF16 = np.dtype(ml_dtypes.bfloat16)


def initialize(heartbeat_timeout_seconds: int = 100, shutdown_timeout_seconds: int = 300) -> tuple[int, int]:
    """Join the JAX distributed system from the launcher's environment; return (rank, world size)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        num_processes=world,
        process_id=rank,
        initialization_timeout=60,
        heartbeat_timeout_seconds=heartbeat_timeout_seconds,
        shutdown_timeout_seconds=shutdown_timeout_seconds,
    )
    assert jax.process_index() == rank and jax.process_count() == world
    assert jax.local_device_count() == 1 and jax.device_count() == world, (
        f"expected one CPU device per process, got {jax.devices()} (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})"
    )
    return rank, world


def rank_inputs(seed: int, rank: int, world: int) -> dict[str, np.ndarray]:
    """This rank's inputs; the test regenerates every rank's with the same function."""
    rng = np.random.default_rng([seed, rank])
    return {
        "f32": (rng.standard_normal((world, 3, 5)) * 10.0 ** rng.uniform(-2, 2)).astype(np.float32),
        "bf16": rng.standard_normal(17).astype(BF16),
        "i32": rng.integers(-1000, 1000, size=(world, 4)).astype(np.int32),
        "v": rng.standard_normal(9).astype(np.float32),
    }


def alltoall_v_counts(seed: int, world: int, m: int) -> np.ndarray:
    """counts[i, j]: elements rank i sends to rank j (every row sums to at most m)."""
    rng = np.random.default_rng([seed, 10_000])
    return rng.integers(0, m // world + 1, size=(world, world)).astype(np.int64)


def ring_peers(rank: int, world: int) -> np.ndarray:
    return np.array([(rank - 1) % world, (rank + 1) % world], np.int32)


def pairing_schedule(world: int) -> np.ndarray:
    """Two rounds of one peer each (rank ^ 1, then the rank half a world away), for ``send_recv_scheduled``."""
    ranks = np.arange(world)
    return np.stack([ranks ^ 1, (ranks + world // 2) % world])[..., None]


def collectives(seed: int, root: int) -> dict[str, np.ndarray]:
    """Run every LaxCommunicator method once across the processes; return this rank's results."""
    rank, world = initialize()
    mesh = Mesh(np.array(jax.devices()), ("r",))
    comm = LaxCommunicator("r", world)
    local = rank_inputs(seed, rank, world)
    counts = alltoall_v_counts(seed, world, local["v"].size)
    local |= {"send": counts[rank], "recv": np.ascontiguousarray(counts[:, rank]), "peers": ring_peers(rank, world)}
    # One row per process on the leading axis: the global arrays are [world, *local shape].
    sharding = NamedSharding(mesh, P("r"))
    global_inputs = {k: jax.make_array_from_process_local_data(sharding, v[None]) for k, v in local.items()}

    def body(d):
        d = {k: v[0] for k, v in d.items()}
        f, b, i, v = d["f32"], d["bf16"], d["i32"], d["v"]
        out = {f"allreduce_{op}": comm.allreduce(f, op) for op in ("sum", "avg", "min", "max")}
        out |= {
            "allreduce_bf16_sum": comm.allreduce(b, "sum"),
            "allreduce_i32_sum": comm.allreduce(i, "sum"),
            "reduce_max": comm.reduce(f, root, "max"),
            "broadcast": comm.broadcast(f, root),
            "broadcast_bf16": comm.broadcast(b, root),
            "reduce_scatter_sum": comm.reduce_scatter(f, "sum"),
            "reduce_scatter_min": comm.reduce_scatter(f, "min"),
            "allgather": comm.allgather(v),
            "gather": comm.gather(i, root),
            "scatter": comm.scatter(i, root),
            "alltoall": comm.alltoall(i),
            "alltoall_v": comm.alltoall_v(v, d["send"], d["recv"], 2 * v.size),
            "send_recv": comm.send_recv(v, d["peers"]),
            "send_recv_scheduled": comm.send_recv_scheduled(v, pairing_schedule(world), seed),
            "barrier": comm.barrier(v),
            "rank": comm.rank(),
        }
        return {k: x[None] for k, x in out.items()}

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("r"), out_specs=P("r")))
    results = step(global_inputs)
    return {k: np.asarray(x.addressable_shards[0].data)[0] for k, x in results.items()}


def dead_peer(victim: int, warmup: bool, heartbeat_timeout_seconds: int, hang_seconds: float = 0.0) -> dict:
    """Rank ``victim`` leaves after joining; the others run allreduces until one fails.

    With ``warmup`` every rank first completes one allreduce together, so the gloo connections
    exist before the victim leaves. The victim exits abruptly (``os._exit(1)``), or with
    ``hang_seconds`` first stays alive (heartbeating) without joining the collective for that
    long. A survivor returns what it raised and when; a survivor that JAX's failure detection
    terminates returns nothing (the test reads its exit code and log).
    """
    rank, world = initialize(heartbeat_timeout_seconds=heartbeat_timeout_seconds, shutdown_timeout_seconds=5)
    mesh = Mesh(np.array(jax.devices()), ("r",))
    comm = LaxCommunicator("r", world)
    sharding = NamedSharding(mesh, P("r"))
    step = jax.jit(jax.shard_map(lambda x: comm.allreduce(x, "sum"), mesh=mesh, in_specs=P("r"), out_specs=P("r")))
    x = jax.make_array_from_process_local_data(sharding, np.full((1, 1024), rank + 1, np.float32))
    if warmup:
        np.asarray(step(x).addressable_shards[0].data)
    if rank == victim:
        if hang_seconds:
            print(f"rank {rank}: alive but not joining for {hang_seconds}s", flush=True)
            time.sleep(hang_seconds)
        print(f"rank {rank}: exiting abruptly", flush=True)
        os._exit(1)
    start = time.monotonic()
    try:
        while True:  # the test's timeout bounds this; a collective must fail first
            np.asarray(step(x).addressable_shards[0].data)
            time.sleep(0.05)
    except Exception as e:  # noqa: BLE001 - the point is to see what JAX raises
        elapsed = time.monotonic() - start
        print(f"rank {rank}: raised after {elapsed:.1f}s: {type(e).__name__}: {e}", flush=True)
        return {"raised": type(e).__name__, "message": str(e), "elapsed": elapsed}

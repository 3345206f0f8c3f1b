"""Rank bodies for test_tcp_engine_jax.py: plain processes (no mpiexec) whose world is built through the store the
test runs."""

import os
import threading
import time

import numpy as np
from every_primitive import run_every_primitive
from native_communicator_workers_jax import exchange_with_a_late_peer

from bagua_common.fault_tolerance.kv_store import KVClient

HOST = "127.0.0.1"


def _world(port: int, secret: bytes, timeout: float = 30.0, host: str = HOST):
    from bagua_jax.native_communicator import NativeCommunicator

    store = KVClient(HOST, port, 10, secret=secret)
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return NativeCommunicator.tcp_through_store(store, "world/", rank, size, host, timeout), store


def every_primitive(port: int, secret: bytes, seed: int) -> dict:
    comm, _ = _world(port, secret)
    return run_every_primitive(comm, seed)


def late_peer(port: int, secret: bytes, count: int, late_seconds: float, hosts: list[str]) -> dict:
    """:func:`exchange_with_a_late_peer` over the TCP engine, rank r listening on ``hosts[r]``."""
    comm, _ = _world(port, secret, host=hosts[int(os.environ["RANK"])])
    return exchange_with_a_late_peer(comm, count, late_seconds)


def survive_a_death(port: int, secret: bytes, victim: int) -> dict:
    """An allreduce on every rank; then ``victim`` exits, and the others' next allreduce fails (timed), they shrink
    to themselves and allreduce again."""
    import jax.numpy as jnp

    comm, _ = _world(port, secret)
    rank, size = int(comm.rank()), comm.size
    x = jnp.full(100_000, rank + 1.0, jnp.float32)
    first = np.asarray(comm.allreduce(x))
    if rank == victim:
        os._exit(3)
    started, error = time.monotonic(), None
    try:
        np.asarray(comm.allreduce(x))
    except Exception as failure:  # noqa: BLE001 - the test reads it
        error = str(failure)
    seconds = time.monotonic() - started
    comm.shrink([r for r in range(size) if r != victim])
    after = np.asarray(comm.allreduce(x))
    return {"first": first[0], "error": error, "seconds": seconds, "after": after[0], "rank": int(comm.rank())}


def mismatched_allreduces(port: int, secret: bytes) -> str:
    """Rank r allreduces 10 * (r + 1) elements: every rank fails, naming the mismatch."""
    import jax.numpy as jnp

    comm, _ = _world(port, secret)
    try:
        np.asarray(comm.allreduce(jnp.ones(10 * (int(comm.rank()) + 1))))
    except Exception as failure:  # noqa: BLE001 - the test reads it
        return str(failure)
    return "no error"


def revoked_while_waiting(port: int, secret: bytes) -> dict:
    """Rank 0 waits for a message rank 1 never sends; a thread revokes rank 0's communicator after 0.5 s."""
    import jax.numpy as jnp

    comm, store = _world(port, secret)
    if int(comm.rank()) == 1:
        store.get("done", wait=30)
        return {}
    threading.Timer(0.5, comm.revoke, ("member 1 was taken for dead",)).start()
    started = time.monotonic()
    try:
        np.asarray(comm.recv((4,), jnp.float32, 1))
        error = "no error"
    except Exception as failure:  # noqa: BLE001 - the test reads it
        error = str(failure)
    store.set("done", "1")
    return {"error": error, "seconds": time.monotonic() - started}


def grow_by_one(port: int, secret: bytes) -> dict:
    """Ranks 0 and 1 form a world, then admit rank 2 (started alone): all three allreduce."""
    import jax.numpy as jnp

    from bagua_jax.native_communicator import NativeCommunicator

    rank = int(os.environ["RANK"])
    store = KVClient(HOST, port, 10, secret=secret)
    if rank < 2:
        comm = NativeCommunicator.tcp_through_store(store, "world/", rank, 2, HOST, 30)
        before = np.asarray(comm.allreduce(jnp.full(3, rank + 1.0)))
        comm.grow(store, "grow/", 3, 30)
    else:
        comm, before = NativeCommunicator.tcp_self(HOST, 30), None
        comm.join(store, "grow/", 2, 3, 30)
    after = np.asarray(comm.allreduce(jnp.full(3, rank + 1.0)))
    return {"before": before, "after": after, "rank": int(comm.rank()), "size": comm.size}


def abandoned_rebuild(port: int, secret: bytes) -> dict:
    """Three ranks rebuild their communicator; rank 1 publishes its address and never builds (alive and listening),
    so rank 0 waits for its connection and rank 2 for it to take one. Their build is abandoned after 0.5 s; then
    ranks 0 and 2 rebuild the communicator of the two of them and allreduce."""
    import jax.numpy as jnp

    comm, store = _world(port, secret)
    rank = int(comm.rank())
    if rank == 1:
        store.set("second/address/1", comm.engine.addresses(comm.handle)[1])
        store.get("done", wait=30)
        return {}
    abandoned = threading.Event()
    threading.Timer(0.5, abandoned.set).start()
    started, error = time.monotonic(), "no error"
    try:
        comm.rebuild(store, "second/", rank, 3, abandoned)
    except RuntimeError as failure:
        error = str(failure)
    seconds = time.monotonic() - started
    comm.rebuild(store, "third/", rank // 2, 2)
    after = np.asarray(comm.allreduce(jnp.full(3, rank + 1.0)))
    store.set("done", "1")
    return {"error": error, "seconds": seconds, "after": after, "size": comm.size}

"""Ranks of the native MPI engine's membership-change test (test_membership_change_jax.py).

Each rank runs as its own ``mpiexec -n 1`` job (``run_ranks(..., launcher="mpiexec-per-rank")``) and builds the
world through the key-value store the test serves. The victim (rank 1 or 2) kills itself (SIGKILL) after one
allreduce; the survivors are blocked in a jitted allreduce that only a revoke can end (the test's stand-in for the
job's membership closing the epoch), shrink to the two of them and run the same compiled step again; they give up a
grow that no newcomer connects to; then a newcomer joins (rank 3 of the start, rank 2 of the grown world) and receives
rank 0's state by broadcast.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from bagua_common.fault_tolerance import KVClient, job_secret
from bagua_jax.epoch_communicator import communication_failure
from bagua_jax.native_communicator import NativeCommunicator

TIMEOUT = 60.0


def _store() -> KVClient:
    return KVClient("127.0.0.1", int(os.environ["BAGUA_TEST_STORE_PORT"]), TIMEOUT, secret=job_secret())


def shrink_and_grow(victim: int) -> dict:
    """Returns what the rank saw; the victim never returns."""
    rank = int(os.environ["RANK"])
    store = _store()
    if rank == 3:  # the newcomer: starts once the survivors shrank
        store.get("test/shrunk", wait=TIMEOUT)
        comm = NativeCommunicator.mpi_join(store, "test/grow/", 2, 3, timeout=TIMEOUT)
        state = comm.broadcast(jnp.zeros(5, jnp.float32), 0)
        mean = comm.allreduce(jnp.full(4, float(rank)), "avg")
        return {"rank": int(comm.rank()), "size": comm.size, "state": np.asarray(state), "third": np.asarray(mean)}
    comm = NativeCommunicator.mpi_through_store(store, "test/world/", rank, 3, timeout=TIMEOUT)

    @jax.jit
    def step(x):
        return comm.allreduce(x, "avg"), comm.rank()

    mean, me = step(jnp.full(4, float(rank)))
    seen = {"first": np.asarray(mean), "first_rank": int(me)}
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    store.get("test/victim-gone", wait=TIMEOUT)  # the test saw the victim's job end
    # Blocked in an allreduce with the dead rank until the "membership" revokes the communicator.
    reason = f"rank {victim} died"
    revoker = threading.Timer(0.5, comm.revoke, args=(reason,))
    started = time.monotonic()
    revoker.start()
    try:
        jax.block_until_ready(step(jnp.ones(4)))
        seen["blocked_step"] = "completed"
    except Exception as error:  # noqa: BLE001 - the test checks the message
        seen["blocked_step"] = str(error)
    seen["revoked_after"] = time.monotonic() - started
    started = time.monotonic()
    comm.shrink([r for r in range(3) if r != victim])
    seen["shrink_seconds"] = time.monotonic() - started
    compiled = step._cache_size()
    mean, me = step(jnp.full(4, float(rank)))
    seen.update(second=np.asarray(mean), second_rank=int(me), size=comm.size, recompiled=step._cache_size() - compiled)
    # A grow no newcomer connects to, which survivor 1 alone gives up after 0.5 s: the other gives it up with it.
    abandoned = threading.Event()
    if int(me) == 1:
        threading.Timer(0.5, abandoned.set).start()
    started = time.monotonic()
    seen["abandoned_grow"] = _error_of(lambda: comm.grow(store, "test/no-newcomer/", 3, TIMEOUT, abandoned))
    seen["abandoned_grow_seconds"] = time.monotonic() - started
    if int(me) == 0:
        store.set("test/shrunk", b"")
    comm.grow(store, "test/grow/", 3, timeout=TIMEOUT)
    state = comm.broadcast(jnp.arange(5, dtype=jnp.float32) + 10 * rank, 0)
    mean, me = step(jnp.full(4, float(rank)))
    seen.update(third=np.asarray(mean), third_rank=int(me), grown_size=comm.size, state=np.asarray(state))
    # A call that fails leaves the communicator unusable, in words the fault-tolerant loop takes for a communication
    # failure (MPICH gives up a send to a dead peer so): here a message longer than the receive it meets.
    if int(me) == 0:
        jax.block_until_ready(comm.send(jnp.ones(8, jnp.float32), 1))
    elif int(me) == 1:
        seen["failed_call"] = _error_of(lambda: comm.recv((2,), jnp.float32, 0))
        seen["next_call"] = _error_of(lambda: comm.allreduce(jnp.ones(4), "sum"))
    return seen


def _error_of(call) -> tuple[str, bool] | None:
    """The error ``call`` raised, and whether the fault-tolerant loop retries the work in the next epoch for it."""
    try:
        jax.block_until_ready(call())
    except Exception as error:  # noqa: BLE001 - the test checks it
        return str(error), communication_failure(error)
    return None

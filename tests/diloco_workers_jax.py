"""Ranks of tests/test_diloco_jax.py under mpiexec: Streaming DiLoCo with its exchanges on the background thread.

The model is tests/diloco_reference.py's (each rank pulls its parameters towards its own targets).
"""

from __future__ import annotations

import time
from typing import Any

import diloco_reference as ref
import jax
import jax.numpy as jnp
import optax

from bagua_jax.algorithms.diloco import diloco
from bagua_jax.counting import CountingCommunicator
from bagua_jax.native_communicator import NativeCommunicator

STREAMING = {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1, "round_start_memory": "device"}
"""Fragment 0 is exchanged after steps 4 and 8, fragment 1 after steps 2, 6 and 10; each applied one step later."""
STARTS_FRAGMENT_1 = 6


class InlineCommunicator:
    """The native communicator behind a plain wrapper: :func:`diloco` then exchanges inside the applying step
    (the synchronous path, the reference for the background one)."""

    def __init__(self, comm: NativeCommunicator) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)


def make_step(comm: Any, options: dict):
    """A jitted inner SGD step chained with :func:`diloco` over ``comm``, and the optimizer."""
    tx = optax.chain(optax.sgd(ref.INNER_LR), diloco(comm, **options))

    def loss(params, target):
        return sum(0.5 * jnp.sum((params[k] - target[k]) ** 2) for k in params)

    @jax.jit
    def step(params, opt_state, target):
        updates, opt_state = tx.update(jax.grad(loss)(params, target), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return tx, step


def train(step, state, seed: int, rank: int, first: int, last: int) -> tuple[Any, list]:
    """Steps ``first..last``; returns the state and each step's parameters."""
    history = []
    for t in range(first, last + 1):
        state = jax.block_until_ready(step(*state, ref.target(seed, t, rank)))
        history.append(jax.device_get(state[0]))
    return state, history


def streaming_ranks(seed: int, wire: str, steps: int, late_s: float) -> dict:
    """Streaming DiLoCo with ``wire`` exchanges (error feedback where compressed), on two ranks.

    Returns rank r's parameters after every step with the exchanges on the background thread
    (``overlapped``), inside the step (``inline``), behind a CountingCommunicator (``counted``: the
    parameters, whether the step hands the exchanges to the thread, the bytes counted), and the background run
    resumed from a copy of its state taken while fragment 1 was on the wire (``resumed``, steps
    STARTS_FRAGMENT_1 + 1 on; the thread has already handed that exchange's result out, as a restarted process
    never had it).
    Rank 1 begins steps STARTS_FRAGMENT_1 and STARTS_FRAGMENT_1 + 1 (which applies fragment 1) ``late_s``
    seconds late; ``times`` says when rank 0 finished each of them and when rank 1 began it. Then rank 1
    leaves and rank 0 returns the error of its next exchange (``dead_peer``).
    """
    comm = NativeCommunicator.mpi_world(timeout=60)
    rank = int(comm.rank())
    options = {**STREAMING, "outer_exchange": wire, "error_feedback": wire != "fp32"}
    params = ref.initial(seed)
    tx, step = make_step(comm, options)
    state, overlapped = train(step, (params, tx.init(params)), seed, rank, 1, STARTS_FRAGMENT_1 - 1)
    times: dict[str, list[float]] = {"began": [], "finished": []}
    for t in (STARTS_FRAGMENT_1, STARTS_FRAGMENT_1 + 1):
        if rank == 1:
            time.sleep(late_s)
        times["began"].append(time.time())
        state, history = train(step, state, seed, rank, t, t)
        times["finished"].append(time.time())
        overlapped += history
        if t == STARTS_FRAGMENT_1:
            saved = jax.device_get(state)
    _, rest = train(step, state, seed, rank, STARTS_FRAGMENT_1 + 2, steps)
    _, resumed = train(step, jax.device_put(saved), seed, rank, STARTS_FRAGMENT_1 + 1, steps)
    tx, step = make_step(InlineCommunicator(comm), options)
    _, inline = train(step, (params, tx.init(params)), seed, rank, 1, steps)
    counter = CountingCommunicator(comm)
    tx, step = make_step(counter, options)
    program = str(jax.make_jaxpr(step)(params, tx.init(params), ref.target(seed, 1, rank)))
    _, counted = train(step, (params, tx.init(params)), seed, rank, 1, steps)
    out = {"overlapped": overlapped + rest, "resumed": resumed, "inline": inline, "times": times}
    out["counted"] = {"params": counted, "on_the_thread": "io_callback" in program, "bytes": counter.bytes_sent}

    short = NativeCommunicator.mpi_world(timeout=3)
    tx, step = make_step(short, options)
    state, _ = train(step, (params, tx.init(params)), seed, rank, 1, 1)
    if rank == 1:
        return out  # and the process exits
    try:
        train(step, state, seed, rank, 2, 3)  # fragment 1's exchange starts after step 2
        out["dead_peer"] = "no error"
    except Exception as error:  # what a user sees
        out["dead_peer"] = f"{type(error).__name__}: {error}"
    return out

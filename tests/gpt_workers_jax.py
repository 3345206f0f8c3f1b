"""Rank bodies that train the workload's GPT with bagua_jax across processes (under mpiexec, one process per rank):
the convergence gate's asynchronous model averaging, whose rounds run between steps over the native engine."""

from __future__ import annotations

import time


def gate_schedule():
    """The gate's learning rate as an optax schedule (gpt_gate.learning_rate)."""
    import optax
    from gpt_gate import FINAL_LR_FRACTION, LR, STEPS, WARMUP

    return optax.warmup_cosine_decay_schedule(0.0, LR, WARMUP, STEPS, FINAL_LR_FRACTION * LR)


def gate_adamw():
    """The gate's AdamW (betas 0.9 / B2, weight decay WEIGHT_DECAY, the gate's schedule)."""
    import optax
    from gpt_gate import B2, WEIGHT_DECAY

    return optax.adamw(gate_schedule(), b1=0.9, b2=B2, weight_decay=WEIGHT_DECAY)


def async_gate(seed: int, start: dict) -> dict:
    """Train the gate's GPT from the parameters ``start`` with AsyncModelAverage (AdamW at the gate's schedule, the
    gate's options); this rank's gate summary."""
    import jax
    import numpy as np
    import optax
    from gpt_gate import ASYNC_STEP_SECONDS, BATCH, HELDOUT_WINDOWS, MODEL, OPTIONS, PRETRAIN_STEPS, STEPS, summary

    from bagua_common.workload import gpt_config, load_corpus
    from bagua_jax.algorithms import Communicators, make_algorithm
    from bagua_jax.models.gpt import gpt_loss_fn
    from bagua_jax.native_communicator import NativeCommunicator

    world = NativeCommunicator.mpi_world(timeout=60)
    rank = int(world.rank())
    algorithm = make_algorithm("async", **OPTIONS["async"])
    tx = algorithm.transformation(gate_adamw(), Communicators(world))
    loss_fn = gpt_loss_fn(MODEL)

    @jax.jit
    def step(params, opt_state, tokens):
        grads = jax.grad(loss_fn)(params, {"tokens": tokens})
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = jax.tree.map(jax.numpy.asarray, start)
    opt_state = tx.init(params)
    averager = algorithm.averager(params, NativeCommunicator.mpi_world(timeout=60))
    corpus, length = load_corpus(), gpt_config(MODEL).context + 1
    steps_took = []
    for t in range(STEPS):
        began = time.monotonic()
        params, opt_state = step(params, opt_state, corpus.batch(seed, PRETRAIN_STEPS + t, rank, BATCH, length))
        params = averager.apply(jax.block_until_ready(params))
        steps_took.append(time.monotonic() - began)
        time.sleep(max(0.0, ASYNC_STEP_SECONDS - steps_took[-1]))  # the host's wait for an accelerator's step
    averager.abort()
    heldout_loss = jax.jit(loss_fn)(params, {"tokens": corpus.heldout_batch(HELDOUT_WINDOWS, length)})
    result = summary({k: np.asarray(v) for k, v in params.items()}, float(heldout_loss))
    return {
        "rank": rank,
        "async": {**result, "rounds": averager.rounds, "step_ms": 1000 * float(np.median(steps_took))},
    }

"""Ranks of test_weighed_out_step_jax.py (under mpiexec): PowerSGD steps in which the last rank is weighed out.

Each step the last rank acts as a joiner that has nothing yet: a fresh state given the algorithm's replicated state
from rank 0 through :func:`~bagua_jax.state_transfer.algorithm_state_bytes` (as the state's holder sends it through the
store), and rank 0's whole state as what arrives while it steps. The loss is ``sum(params * batch)``, so each rank's
gradients are its batch, and SGD with a learning rate of 1 moves the parameters by minus what every rank applied.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from types import SimpleNamespace

import numpy as np

SHAPES = {"b": (10,), "w1": (32, 24), "w2": (24, 10)}
STEPS = 4
OPEN_EPOCH = SimpleNamespace(number=1, closed=threading.Event())
"""What the step reads of the job's epoch while the state arrives: its number, and that it never closes here."""


def gradients(seed: int, step: int, rank: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s gradients at ``step`` (the test's reference uses the same)."""
    rng = np.random.default_rng([seed, step, rank])
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SHAPES.items()}


def weighed_out(seed: int, config: dict) -> dict:
    """``STEPS`` PowerSGD steps with the last rank weighed out of each; returns what each step applied, this rank's
    final parameters, ``Q`` and residuals, and the initial ``Q``."""
    import jax.numpy as jnp
    import optax

    from bagua_jax import state_rules, state_transfer
    from bagua_jax.algorithms import PowerSGD
    from bagua_jax.host_communicator import HostCommunicator
    from bagua_jax.native_communicator import NativeCommunicator
    from bagua_jax.trainer import DataParallel
    from bagua_jax.weighed_out_step import WeighedOutStep

    def loss(params, batch):
        return sum(jnp.vdot(params[name], batch[name]) for name in SHAPES)

    comm = NativeCommunicator.mpi_world(timeout=60)
    rank, size = int(comm.rank()), comm.size
    host = HostCommunicator(comm)
    trainer = DataParallel(loss, optax.sgd(1.0), PowerSGD(**config), communicator=comm)
    zeros = {name: jnp.zeros(shape, jnp.float32) for name, shape in SHAPES.items()}
    state = fresh = trainer.init(zeros)  # a collective: the joiner's fresh state each step is this one
    initial_qs = [np.asarray(q) for q in state.opt_state[0].qs]
    roles = state_rules.roles(trainer, state)
    step = WeighedOutStep(trainer)
    step.compile(state, gradients(seed, 0, rank))
    joiner = rank == size - 1
    applied = []
    for t in range(STEPS):
        algorithm = host.broadcast(np.frombuffer(state_transfer.algorithm_state_bytes(roles, state), np.uint8), 0)
        whole = state_transfer.broadcast_state(host, state, 0)
        incoming = None
        if joiner:  # a fresh state with rank 0's algorithm state; the rest arrives while it steps
            state = state_transfer.with_algorithm_state(np.asarray(algorithm).tobytes(), roles, fresh)
            incoming = Future()
            incoming.set_result(whole)
        start = state_transfer.state_from_bytes(whole, state) if joiner else state
        before = {name: np.asarray(leaf) for name, leaf in start.params.items()}
        comm.set_average_divisor(size - 1)
        state, _ = step.step(state, gradients(seed, t, rank), incoming, OPEN_EPOCH)
        comm.set_average_divisor(None)
        applied.append({name: before[name] - np.asarray(state.params[name]) for name in SHAPES})
    reduce_state = state.opt_state[0]
    return {
        "applied": applied,
        "params": {name: np.asarray(leaf) for name, leaf in state.params.items()},
        "qs": [np.asarray(q) for q in reduce_state.qs],
        "residuals": [np.asarray(e) for e in reduce_state.residuals],
        "step": int(reduce_state.step),
        "initial_qs": initial_qs,
    }

"""AsyncModelAverage against plain NumPy references.

The in-step part (gradient allreduce during warm-up, local steps after) runs on 2 and 4
simulated devices under ``shard_map`` with :class:`LaxCommunicator`. The background rounds
need real processes: one MPI job on 2 ranks and one on 4 (``async_model_average_workers_jax.py``, several
scenarios each), where a training loop calls ``averager.apply`` between jitted steps of a linear regression.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from async_model_average_reference import (
    LR,
    check_averaged_training,
    check_one_round,
    numpy_sgd,
    rank_params,
)
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from scenarios import Job, JobTable, Scenario, has_mpi

import bagua_jax
from bagua_jax import LaxCommunicator
from bagua_jax.algorithms.async_model_average import (
    AsyncModelAverage,
    AsyncModelAverager,
    AsyncModelAverageState,
    async_model_average,
    compiled_rounds,
)
from bagua_jax.algorithms.base import Communicators

NS = (2, 4)
F32_EPS = float(np.finfo(np.float32).eps)

WARMUP = Scenario("train", {"steps": 8, "warmup_steps": 8, "sync_interval_ms": 1, "sleep_s": 0.0})
TRAIN = Scenario("train", {"steps": 200, "warmup_steps": 5, "sync_interval_ms": 2, "sleep_s": 0.002})
ONE_ROUND, ABORT_RESUME = Scenario("one_round"), Scenario("abort_resume")
NEVER_WAITS = Scenario("never_waits", {"stall_s": 1.5})
JOBS = JobTable(
    "async_model_average_workers_jax:job",
    {
        "mpi-2": Job(2, "mpiexec", (WARMUP, TRAIN, ONE_ROUND, ABORT_RESUME, NEVER_WAITS)),
        "mpi-4": Job(4, "mpiexec", (WARMUP, TRAIN, ONE_ROUND, ABORT_RESUME)),
    },
    mpi=has_mpi(bagua_jax.build_info()),
)


# ---- the in-step transform on simulated devices -------------------------------------------


def run_transform(n: int, grads: np.ndarray, warmup_steps: int, state=None, params=None):
    """Apply ``async_model_average`` + SGD on n simulated ranks for ``len(grads)`` steps of
    precomputed per-rank gradients ``grads[t, r]``; return (params after each step, final state)."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("ranks",))
    tx = AsyncModelAverage(warmup_steps=warmup_steps).transformation(
        optax.sgd(LR), Communicators(LaxCommunicator("ranks", n))
    )
    if params is None:
        params = np.zeros((n, grads.shape[-1]), np.float32)
    if state is None:
        state = jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), tx.init(jnp.zeros(grads.shape[-1])))

    def body(params, state, g):
        params, state, g = jax.tree.map(lambda x: x[0], (params, state, g))
        updates, state = tx.update(g, state, params)
        return jax.tree.map(lambda x: x[None], (optax.apply_updates(params, updates), state))

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("ranks"), out_specs=P("ranks")))
    history = []
    for g in grads:
        params, state = step(params, state, g)
        history.append(np.asarray(params))
    return np.stack(history), state


@pytest.mark.parametrize("n", NS)
def test_transform_allreduces_during_warmup_then_steps_locally(n, rng):
    steps, warmup = 6, 3
    grads = rng.standard_normal((steps, n, 37)).astype(np.float32)
    got, state = run_transform(n, grads, warmup)
    theta = np.zeros((n, 37), np.float32)
    for t in range(steps):
        g = np.broadcast_to(grads[t].mean(0), grads[t].shape) if t < warmup else grads[t]
        theta = (theta - np.float32(LR) * g).astype(np.float32)
        # psum may add the n gradients in another order than NumPy: a few float32 roundings of
        # the gradients' magnitude, times the learning rate, accumulated over the steps.
        np.testing.assert_allclose(got[t], theta, rtol=0, atol=(t + 1) * n * F32_EPS * LR * np.abs(grads).max())
    for t in range(warmup):  # one allreduce result on every rank: the replicas agree bit for bit
        assert all(got[t, r].tobytes() == got[t, 0].tobytes() for r in range(n))
    assert not np.allclose(got[-1, 0], got[-1, 1])  # local steps after warm-up
    ours = state[0]  # the chain's state: (ours, sgd's)
    assert isinstance(ours, AsyncModelAverageState)
    np.testing.assert_array_equal(np.asarray(ours.step), np.full(n, steps, np.int32))


def test_transform_state_restores_from_a_numpy_checkpoint(rng):
    n, steps, warmup = 2, 6, 3
    grads = rng.standard_normal((steps, n, 11)).astype(np.float32)
    uninterrupted, _ = run_transform(n, grads, warmup)
    first, state = run_transform(n, grads[:2], warmup)
    # The checkpoint crosses warm-up's end after the restore: the step counter must survive.
    leaves, treedef = jax.tree.flatten(state)
    checkpoint = [np.array(leaf) for leaf in leaves]
    restored = jax.tree.unflatten(treedef, checkpoint)
    rest, _ = run_transform(n, grads[2:], warmup, state=restored, params=first[-1])
    np.testing.assert_array_equal(np.concatenate([first, rest]), uninterrupted)


def test_no_warmup_compiles_no_collective():
    tx = async_model_average(Communicators(LaxCommunicator("ranks", 2)), warmup_steps=0)
    g = {"w": jnp.ones(3)}
    # Outside shard_map a traced collective would fail: with no warm-up none is traced.
    updates, state = jax.jit(tx.update)(g, tx.init(g))
    np.testing.assert_array_equal(updates["w"], np.ones(3))
    assert int(state.step) == 1


def test_rounds_compiled_for_a_number_of_ranks_are_not_compiled_again(caplog):
    # A fault-tolerant job compiles the rounds' functions ahead, on zeros, for the members a change brings; the
    # averager then made for that number compiles nothing, and one for another number compiles its own.
    def compiled(params, size):
        caplog.clear()
        with jax.log_compiles(), caplog.at_level("WARNING", logger="jax._src.dispatch"):
            compiled_rounds(params, size)
        return [r.getMessage().split()[4] for r in caplog.records if r.getMessage().startswith("Finished XLA")]

    params = {"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(5, jnp.bfloat16)}
    zeros = jax.tree.map(jnp.zeros_like, params)
    assert "jit(correct)" in compiled(zeros, 7)
    assert compiled(params, 7) == []
    assert "jit(correct)" in compiled(params, 6)


# ---- configuration errors ---------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sync_interval_ms": -1}, "sync_interval_ms"),
        ({"sync_interval_ms": float("nan")}, "sync_interval_ms"),
        ({"sync_interval_ms": "500"}, "sync_interval_ms"),
        ({"sync_interval_ms": True}, "sync_interval_ms"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"warmup_steps": 2.5}, "warmup_steps"),
        ({"bucket_bytes": 0}, "bucket_bytes"),
    ],
)
def test_bad_configuration_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AsyncModelAverage(**kwargs)


def test_bad_arguments_are_rejected():
    comms = Communicators(LaxCommunicator("ranks", 2))
    with pytest.raises(TypeError, match="comms must be a communicator"):
        AsyncModelAverage().transformation(optax.sgd(0.1), "ranks")
    with pytest.raises(TypeError, match="floating-point"):
        AsyncModelAverage().transformation(optax.sgd(0.1), comms).init({"steps": jnp.zeros(3, jnp.int32)})
    with pytest.raises(TypeError, match="floating-point"):
        AsyncModelAverager({"steps": jnp.zeros(3, jnp.int32)}, None)
    with pytest.raises(TypeError, match="NativeCommunicator"):
        AsyncModelAverage().averager({"w": jnp.zeros(3)}, LaxCommunicator("ranks", 2))


# ---- background rounds on MPI ranks ---------------------------------------------------------


@pytest.mark.parametrize("name", JOBS.jobs_with(WARMUP))
def test_warmup_equals_synchronous_allreduce_sgd(name):
    seed, results = JOBS.run(name)
    n, steps = len(results), WARMUP.options["steps"]
    expected = numpy_sgd(seed, n, steps, averaged_steps=steps)
    for res in results:
        got = res[WARMUP.label]
        # float32 rounding of JAX's gradient and of MPI's sum versus NumPy's, over a few steps.
        np.testing.assert_allclose(got["history"], expected[:, res["rank"]], rtol=1e-5, atol=1e-5)
        assert got["history"].tobytes() == results[0][WARMUP.label]["history"].tobytes()  # bit-identical replicas
        # No thread during warm-up; it starts once warmup_steps steps are done, before any round.
        assert got["running"][:-1] == [False] * (steps - 1)
        assert got["rounds"] == 0 and got["joined"]


@pytest.mark.parametrize("name", JOBS.jobs_with(TRAIN))
def test_background_averaging_keeps_replicas_together_and_trains(name):
    seed, results = JOBS.run(name)
    n, warmup = len(results), TRAIN.options["warmup_steps"]
    got = np.stack([res[TRAIN.label]["history"] for res in results], axis=1)  # [step, rank, DIM + 1]
    np.testing.assert_allclose(got[:warmup], numpy_sgd(seed, n, warmup, warmup), rtol=1e-5, atol=1e-5)
    assert all(res[TRAIN.label]["joined"] for res in results)
    check_averaged_training(got, seed, warmup, [res[TRAIN.label]["rounds"] for res in results])


@pytest.mark.parametrize("name", JOBS.jobs_with(ONE_ROUND))
def test_one_round_applies_sum_over_n_minus_snapshot(name):
    seed, results = JOBS.run(name)
    n = len(results)
    for res in results:
        got_round = res[ONE_ROUND.label]
        assert got_round["started"]  # steps_done covered warm-up: the thread started at once
        assert got_round["rounds"] == 1 and got_round["joined"]
        assert got_round["unchanged"] and got_round["idle_apply_s"] < 0.5  # no round finished: input returned as is
        dtypes = {key: value.dtype for key, value in rank_params(seed, res["rank"], 0).items()}
        assert {key: got.dtype for key, got in got_round["out"].items()} == dtypes
        out = {key: got.astype(np.float32) for key, got in got_round["out"].items()}
        check_one_round(out, seed, n, res["rank"], got_round["corrected_from"])


@pytest.mark.parametrize("name", JOBS.jobs_with(ABORT_RESUME))
def test_abort_stops_every_rank_at_the_same_round_and_resume_restarts(name):
    _, results = JOBS.run(name)
    phases = [res[ABORT_RESUME.label] for res in results]
    for phase in ("a", "b", "c"):
        assert len({p[phase] for p in phases}) == 1, [p[phase] for p in phases]
        assert phases[0][phase][1] is False  # the thread was joined
    rounds_a, rounds_b, rounds_c = (phases[0][phase][0] for phase in ("a", "b", "c"))
    assert rounds_a >= 1 and rounds_b > rounds_a and rounds_c >= rounds_b
    for res, p in zip(results, phases):
        assert p["a_after_steps"] == rounds_a  # no rounds while aborted
        if res["rank"] != 0:
            assert p["stopped_by_peer"]  # rank 0's abort alone stopped this rank's thread


def test_training_never_waits_for_a_round_in_flight():
    _, results = JOBS.run("mpi-2")
    busy, stall = results[0][NEVER_WAITS.label], NEVER_WAITS.options["stall_s"]
    # Rank 1 made no progress for the whole window, so rank 0's round could not finish: at most
    # the round already past its flag when the stall began completes.
    assert busy["rounds_during"] <= 1
    # Meanwhile rank 0 kept stepping at its own pace (about 1 ms per step when the machine is
    # idle): every apply() returned without waiting. An apply costs tens of microseconds; 0.25 s
    # leaves room for a busy machine's scheduling and is still far below the 1.5 s stall, so a
    # blocked apply would show.
    assert len(busy["step_s"]) >= 50, len(busy["step_s"])
    assert busy["step_s"].max() < 0.25, busy["step_s"].max()
    assert busy["loop_s"] < 0.8 * stall + 0.3
    assert busy["rounds"] == results[1][NEVER_WAITS.label]["rounds"]

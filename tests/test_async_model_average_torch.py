"""AsyncModelAverageAlgorithm ("async") through the PyTorch wrapper, against NumPy references.

Jobs of real processes (async_model_average_workers_torch.py; several scenarios per job): gloo on 2 and
4 ranks (the rounds on a new process group), and the native MPI communicator under
``mpiexec`` on 2 ranks (the rounds on ``world.split``). The task is the linear regression
of ``async_model_average_reference.py`` where each rank has its own optimum, so that ranks training alone
drift apart. The tests check:

* warm-up: gradient allreduce, bit-identical to GradientAllReduce in the same job and
  equal to a NumPy simulation of synchronous SGD; no thread before warm-up ends;
* after warm-up: every step is a local SGD step, or one that applies a round: each rank's
  snapshot moved to the mean of all ranks' snapshots, on the rounds that ran whatever their
  timing; the loss over all ranks' data goes down;
* the update rule ``x + sum / n - s`` exactly (NumPy reference kernel) for one forced round;
* abort/resume: every rank stops at the same round (also when only rank 0 aborts), no hang;
* a step never waits for a round in flight;
* checkpoints (the step counter) and configuration errors.
"""

from __future__ import annotations

import numpy as np
import pytest
from async_model_average_reference import (
    check_averaged_training,
    check_one_round,
    numpy_sgd,
)
from scenarios import Job, JobTable, Scenario, has_mpi

import bagua_torch
from bagua_torch.algorithms import (
    AsyncModelAverageAlgorithm,
    algorithm_class,
    get_algorithm,
)

WARMUP = Scenario(
    "train", {"steps": 6, "warmup_steps": 6, "sync_interval_ms": 1, "sleep_s": 0.0, "compare_allreduce": True}
)
TRAIN = Scenario("train", {"steps": 200, "warmup_steps": 5, "sync_interval_ms": 2, "sleep_s": 0.002})
ONE_ROUND, ABORT_RESUME = Scenario("one_round"), Scenario("abort_resume")
NEVER_WAITS = Scenario("never_waits", {"stall_s": 1.5})
CHECKPOINT, ERRORS = Scenario("checkpoint"), Scenario("errors")
JOBS = JobTable(
    "async_model_average_workers_torch:job",
    {
        "gloo-2": Job(2, "python", (WARMUP, TRAIN, ONE_ROUND, ABORT_RESUME, NEVER_WAITS, CHECKPOINT, ERRORS)),
        "gloo-4": Job(4, "python", (WARMUP, TRAIN, ONE_ROUND, ABORT_RESUME)),
        "mpi-2": Job(2, "mpiexec", (WARMUP, ONE_ROUND, ABORT_RESUME)),
    },
    mpi=has_mpi(bagua_torch.build_info()),
)


# ---- NumPy references ----------------------------------------------------------------------


# ---- single process ----------------------------------------------------------------------------


def test_registry_name_and_defaults():
    assert algorithm_class("async") is AsyncModelAverageAlgorithm
    assert AsyncModelAverageAlgorithm.name == "async"
    assert get_algorithm("async") == AsyncModelAverageAlgorithm(sync_interval_ms=500, warmup_steps=0)
    assert get_algorithm("async", warmup_steps=3).warmup_steps == 3


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"sync_interval_ms": -1}, "sync_interval_ms must be a finite number"),
        ({"sync_interval_ms": float("nan")}, "sync_interval_ms must be a finite number"),
        ({"sync_interval_ms": float("inf")}, "sync_interval_ms must be a finite number"),
        ({"sync_interval_ms": True}, "sync_interval_ms must be a finite number"),
        ({"sync_interval_ms": "10"}, "sync_interval_ms must be a finite number"),
        ({"warmup_steps": -1}, "warmup_steps must be a non-negative int"),
        ({"warmup_steps": 1.5}, "warmup_steps must be a non-negative int"),
        ({"warmup_steps": True}, "warmup_steps must be a non-negative int"),
    ],
)
def test_bad_configuration_is_rejected(kwargs, message):
    with pytest.raises(ValueError, match=f"async: {message}"):
        AsyncModelAverageAlgorithm(**kwargs)


# ---- multi-process -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", JOBS.jobs_with(WARMUP))
def test_warmup_equals_synchronous_allreduce_sgd(name):
    seed, results = JOBS.run(name)
    n, steps = len(results), 6
    expected = numpy_sgd(seed, n, steps, averaged_steps=steps)
    for res in results:
        got = res[WARMUP.label]
        # The same collective on the same gradients as GradientAllReduce: bit-identical.
        assert got["history"].tobytes() == got["allreduce"].tobytes()
        # float32 rounding of torch's gradient and of the allreduce's sum versus NumPy's, over a few steps.
        np.testing.assert_allclose(got["history"], expected[:, res["rank"]], rtol=1e-5, atol=1e-6)
        assert got["history"].tobytes() == results[0][WARMUP.label]["history"].tobytes()  # identical replicas
        assert got["hooks"] == [True] * steps
        # No thread during warm-up; it starts once warmup_steps steps are done, before any round.
        assert got["running"][:-1] == [False] * (steps - 1)
        assert got["rounds"] == 0 and got["joined"] and got["steps"] == steps
        assert got["comm"] == ("NativeCommunicator" if res["native"] else "ProcessGroupCommunicator")
    if name.startswith("mpi"):
        assert all(res["native"] for res in results)


@pytest.mark.parametrize("name", JOBS.jobs_with(TRAIN))
def test_background_averaging_keeps_replicas_together_and_trains(name):
    seed, results = JOBS.run(name)
    n, warmup = len(results), 5
    got = np.stack([res[TRAIN.label]["history"] for res in results], axis=1)  # [step, rank, DIM + 1]
    steps = got.shape[0]
    np.testing.assert_allclose(got[:warmup], numpy_sgd(seed, n, warmup, warmup), rtol=1e-5, atol=1e-6)
    for res in results:
        assert res[TRAIN.label]["hooks"] == [True] * warmup + [False] * (steps - warmup)
        assert res[TRAIN.label]["joined"]
    check_averaged_training(got, seed, warmup, [res[TRAIN.label]["rounds"] for res in results])


@pytest.mark.parametrize("name", JOBS.jobs_with(ONE_ROUND))
def test_one_round_applies_sum_over_n_minus_snapshot(name):
    seed, results = JOBS.run(name)
    n = len(results)
    for res in results:
        got_round = res[ONE_ROUND.label]
        assert got_round["started"]  # warmup_steps=0: the thread runs from the wrap, no gradient hooks
        assert got_round["rounds"] == 1 and got_round["joined"]
        assert got_round["unchanged"] and got_round["idle_step_s"] < 0.5  # no round finished: weights untouched
        out = got_round["out"]
        assert {key: dtype for key, (_, dtype) in out.items()} == {"w": "torch.float32", "b": "torch.bfloat16"}
        check_one_round({key: got for key, (got, _) in out.items()}, seed, n, res["rank"], got_round["corrected_from"])


@pytest.mark.parametrize("name", JOBS.jobs_with(ABORT_RESUME))
def test_abort_stops_every_rank_at_the_same_round_and_resume_restarts(name):
    _, results = JOBS.run(name)
    phases = [res[ABORT_RESUME.label] for res in results]
    for phase in ("a", "b", "c", "closed"):
        assert len({p[phase] for p in phases}) == 1, [p[phase] for p in phases]
        assert phases[0][phase][1] is False  # the thread was joined
    rounds_a, rounds_b, rounds_c, rounds_closed = (phases[0][phase][0] for phase in ("a", "b", "c", "closed"))
    assert rounds_a >= 1 and rounds_b > rounds_a and rounds_closed >= rounds_c >= rounds_b
    for res, p in zip(results, phases):
        assert p["a_after_steps"] == rounds_a  # no rounds while aborted
        assert "RuntimeError: async: resume() restarts averaging stopped by abort()" in p["resume"]
        if res["rank"] != 0:
            assert p["stopped_by_peer"]  # rank 0's abort alone stopped this rank's thread


def test_a_step_never_waits_for_a_round_in_flight():
    _, results = JOBS.run("gloo-2")
    busy = results[0][NEVER_WAITS.label]
    # Rank 1 made no progress for the whole window, so rank 0's round could not finish: at most the
    # round already past its flag when the stall began completes.
    assert busy["rounds_during"] <= 1
    # Meanwhile rank 0 kept stepping: every opt.step() returned without waiting. One costs well under
    # a millisecond; 0.25 s leaves room for a busy machine and is still far below the 1.5 s stall.
    assert len(busy["step_s"]) >= 50, len(busy["step_s"])
    assert busy["step_s"].max() < 0.25, busy["step_s"].max()
    assert busy["loop_s"] < 0.8 * 1.5 + 0.3
    assert results[0][NEVER_WAITS.label]["rounds"] == results[1][NEVER_WAITS.label]["rounds"]


def test_checkpoint_restores_the_step_counter():
    _, results = JOBS.run("gloo-2")
    for res in results:
        got = res[CHECKPOINT.label]
        assert got["saved_state"] == {"steps": 3}
        assert got["hooks"] == [True, True, False]  # two more warm-up steps after the restore, then local
        assert got["running"] == [False, False, True]
        np.testing.assert_array_equal(got["resumed"], got["straight"])
        for message in got["bad_state"]:
            assert message.startswith("ValueError: async: the checkpoint must hold {'steps': int >= 0}"), message


def test_configuration_errors():
    _, results = JOBS.run("gloo-2")
    for res in results:
        got = res[ERRORS.label]
        assert got["no_optimizer"].startswith("ValueError: async: pass the optimizers to the wrapper"), got
        assert got["float64"] == (
            "TypeError: async: parameter b has dtype torch.float64; asynchronous averaging "
            "takes float32, float16, bfloat16 only"
        ), got
        assert got["resume_running"].startswith("RuntimeError: async: resume() restarts averaging"), got

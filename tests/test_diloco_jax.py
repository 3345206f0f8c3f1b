"""DiLoCo and Streaming DiLoCo in JAX (bagua_jax.algorithms.diloco) against NumPy simulations of all ranks.

Four simulated CPU devices, one rank each (``jax.shard_map`` through DataParallel). The model
and the reference are tests/diloco_reference.py: each rank pulls its parameters towards its own
targets with SGD, so the ranks drift apart inside a round and the outer step decides where they
meet. XLA may fuse the inner step's multiply-add, so comparisons allow a few float32 ulps.
"""

from __future__ import annotations

import zlib

import diloco_reference as ref
import diloco_workers_jax as workers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from multiprocess import run_ranks

import bagua_jax
from bagua_jax import checkpoint
from bagua_jax.algorithms import DiLoCo, GradientAllReduce, make_algorithm
from bagua_jax.trainer import DataParallel

RANKS = 4


def mesh(ranks: int = RANKS) -> Mesh:
    return Mesh(np.array(jax.devices()[:ranks]), ("ranks",))


def loss_fn(params, batch):
    return sum(0.5 * jnp.sum((params[k] - batch[k][0]) ** 2) for k in params)


def targets(seed: int, step: int, ranks: int = RANKS) -> dict[str, np.ndarray]:
    rows = [ref.target(seed, step, r) for r in range(ranks)]
    return {k: np.stack([row[k] for row in rows]) for k in ref.SHAPES}


def train(trainer: DataParallel, state, seed: int, first: int, last: int, ranks: int = RANKS):
    """Inner steps ``first..last`` (counted from 1); returns the state and each step's parameters [rank][name]."""
    history = []
    for t in range(first, last + 1):
        state, _ = trainer.step(state, targets(seed, t, ranks))
        history.append(jax.device_get(state.params))
    return state, history


def make(algorithm, ranks: int = RANKS) -> DataParallel:
    return DataParallel(loss_fn, optax.sgd(ref.INNER_LR), algorithm, mesh=mesh(ranks))


@pytest.mark.parametrize(
    "options",
    [
        {"sync_every": 3},
        {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1, "fragment_update_alpha": 0.25},
        {"sync_every": 3, "fragments": 3, "round_start_memory": "device"},
        {"sync_every": 3, "outer_learning_rate": 1.0, "outer_momentum": 0.5},
    ],
    ids=["diloco", "streaming-delay-alpha", "streaming-3", "outer-settings"],
)
def test_outer_steps_match_the_numpy_simulation(options, rng):
    seed, steps = int(rng.integers(2**20)), 9
    trainer = make(DiLoCo(**options))
    state, history = train(trainer, trainer.init(ref.initial(seed)), seed, 1, steps)
    want = ref.simulate(
        RANKS,
        steps,
        seed,
        sync_every=options["sync_every"],
        fragments=options.get("fragments", 1),
        delay=options.get("fragment_sync_delay", 0),
        alpha=options.get("fragment_update_alpha", 0.0),
        **({"outer_lr": options["outer_learning_rate"], "momentum": options["outer_momentum"]}
           if "outer_learning_rate" in options else {}),
    )  # fmt: skip
    for t in range(steps):
        for r in range(RANKS):
            for k in ref.SHAPES:
                np.testing.assert_allclose(history[t][k][r], want[t][r][k], rtol=2e-5, atol=2e-6, err_msg=f"{t} {k}")
    # The round-start copy is the same bits on every rank and lives where the options say.
    anchors = state.opt_state[1].round_start
    for k in ref.SHAPES:
        rows = np.asarray(jax.device_get(anchors[k]))
        assert all(np.array_equal(rows[0], row) for row in rows), k
        kind = "pinned_host" if options.get("round_start_memory", "host") == "host" else "device"
        assert anchors[k].sharding.memory_kind == kind


def test_h1_with_plain_sgd_outside_is_gradient_allreduce(rng):
    seed, steps = int(rng.integers(2**20)), 6
    diloco = make(DiLoCo(sync_every=1, outer_optimizer=optax.sgd(1.0)))
    allreduce = make(GradientAllReduce())
    _, got = train(diloco, diloco.init(ref.initial(seed)), seed, 1, steps)
    _, want = train(allreduce, allreduce.init(ref.initial(seed)), seed, 1, steps)
    start = [{k: v[None] for k, v in ref.initial(seed).items()}]
    for t in range(steps):
        for k in ref.SHAPES:
            atol = ref.h1_allreduce_atol([start + got, start + want], t + 1, k)
            for r in range(RANKS):
                np.testing.assert_allclose(got[t][k][r], want[t][k], rtol=0, atol=atol, err_msg=f"{t} {k}")


def test_counting_trainers_leaves_out_a_rank_that_sat_the_round_out(rng):
    # One round of one step, the outer step plain SGD (lr 1): the new round start is the mean of the parameters of
    # the ranks that trained. Rank 0 is marked as sitting the round out (trained = 0): ranks 1-3 make the mean.
    seed = int(rng.integers(2**20))
    trainer = make(DiLoCo(sync_every=1, outer_optimizer=optax.sgd(1.0)).counting_trainers())
    state = trainer.init(ref.initial(seed))
    inner, diloco = state.opt_state
    state = state._replace(opt_state=(inner, diloco._replace(trained=diloco.trained.at[0].set(0.0))))
    state, _ = trainer.step(state, targets(seed, 1))
    start, goal = ref.initial(seed), targets(seed, 1)
    for k in ref.SHAPES:
        trained = [start[k] - ref.INNER_LR * (start[k] - goal[k][r]) for r in range(1, RANKS)]
        for r in range(RANKS):
            np.testing.assert_allclose(np.asarray(state.params[k])[r], np.mean(trained, axis=0), rtol=2e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state.opt_state[1].trained), np.ones(RANKS))  # each trains the next
    assert trainer.algorithm.replace(bucket_bytes=1 << 20).counts_trainers  # as the bucket autotuner makes it


def test_resume_mid_round_is_bit_identical_and_a_new_world_size_follows_the_rule(rng, tmp_path):
    seed = int(rng.integers(2**20))
    algorithm = DiLoCo(sync_every=4, fragments=2, fragment_sync_delay=1, outer_exchange="uint8", error_feedback=True)
    trainer = make(algorithm)
    # After step 6 fragment 0 is mid-round and fragment 1's exchange waits for its outer step at step 7.
    state, _ = train(trainer, trainer.init(ref.initial(seed)), seed, 1, 6)
    assert np.any(np.asarray(state.opt_state[1].pending[1]))
    checkpoint.save(tmp_path, state, trainer)
    _, straight = train(trainer, state, seed, 7, 11)
    again = make(algorithm)
    _, resumed = train(again, checkpoint.restore(tmp_path, again, ref.initial(seed)), seed, 7, 11)
    for t in range(5):
        for k in ref.SHAPES:
            np.testing.assert_array_equal(resumed[t][k], straight[t][k], err_msg=f"step {7 + t} {k}")
    # Two ranks: parameters and the pseudo-gradients awaiting their exchange start from the four ranks' mean; the
    # round start, the outer state and the position carry; the residuals restart at zero.
    smaller = make(algorithm, ranks=2)
    shrunk = checkpoint.restore(tmp_path, smaller, ref.initial(seed))
    saved, now = jax.device_get(state.opt_state[1]), jax.device_get(shrunk.opt_state[1])

    def assert_mean_of_ranks(got, ranks):
        # float32 sums in another order: about 4 ulps of the largest term, however small the mean
        ranks = np.asarray(ranks)
        np.testing.assert_allclose(got, np.mean(ranks, axis=0), rtol=1e-6, atol=1e-6 * np.max(np.abs(ranks)))

    for k in ref.SHAPES:
        assert_mean_of_ranks(jax.device_get(shrunk.params)[k][1], state.params[k])
        np.testing.assert_array_equal(now.round_start[k][1], saved.round_start[k][0])
    for was, new in zip(jax.tree.leaves(saved.outer_states), jax.tree.leaves(now.outer_states)):
        np.testing.assert_array_equal(new[1], was[0])
    for was, new in zip(saved.pending, now.pending):
        assert_mean_of_ranks(new[1], was)
    assert int(now.step[1]) == 6 and all(not np.any(res) for res in now.residuals)
    train(smaller, shrunk, seed, 7, 9, ranks=2)


@pytest.mark.parametrize(
    "options, error",
    [
        ({"sync_every": 0}, "sync_every must be an int >= 1"),
        ({"sync_every": 4, "fragments": 5}, r"fragments \(5\) must not exceed sync_every"),
        ({"sync_every": 8, "fragments": 2, "fragment_sync_delay": 4}, r"fragment_sync_delay \(4\) must be less than"),
        ({"fragment_update_alpha": 1.5}, r"fragment_update_alpha must be a float in \[0, 1\]"),
        ({"outer_exchange": "int8"}, "outer_exchange must be one of fp32, bf16, uint8, uint4"),
        ({"error_feedback": True}, "error_feedback needs a compressed outer_exchange"),
        ({"round_start_memory": "disk"}, "round_start_memory must be 'host' or 'device'"),
        ({"outer_learning_rate": 0.0}, r"outer_learning_rate must be a float > 0"),
        ({"outer_momentum": 1.0}, r"outer_momentum must be a float in \[0, 1\)"),
        ({"outer_optimizer": optax.sgd(1.0), "outer_momentum": 0.5}, "give them to your outer_optimizer"),
    ],
)
def test_bad_options_are_clear_errors(options, error):
    with pytest.raises(ValueError, match=error):
        DiLoCo(**options)
    with pytest.raises(ValueError, match=error):
        make_algorithm("diloco", **options)


def test_more_fragments_than_parameters_is_a_clear_error():
    trainer = make(DiLoCo(sync_every=8, fragments=4))
    with pytest.raises(ValueError, match=r"fragments \(4\) must not exceed the number of parameters \(3\)"):
        trainer.init(ref.initial(0))


NATIVE_OPTIONS = [{"sync_every": 3}, {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1}]


def native_worker(seed: int, steps: int) -> list[list[dict[str, np.ndarray]]]:
    """One rank under mpiexec: each of NATIVE_OPTIONS with the native MPI communicator (the round start in host
    memory, the default, which on CPU is the device's memory)."""
    comm = bagua_jax.NativeCommunicator.mpi_world()
    rank = int(comm.rank())
    histories = []
    for options in NATIVE_OPTIONS:
        trainer = DataParallel(
            lambda p, b: loss_fn(p, {k: v[None] for k, v in b.items()}),
            optax.sgd(ref.INNER_LR),
            DiLoCo(**options),
            communicator=comm,
        )
        state, history = trainer.init(ref.initial(seed)), []
        for t in range(1, steps + 1):
            state, _ = trainer.step(state, ref.target(seed, t, rank))
            history.append(jax.device_get(state.params))
        histories.append(history)
    return histories


def mpi_ranks(seed: int, steps: int, wire: str, late_s: float) -> dict:
    """One rank of the test's one MPI job: :func:`native_worker`'s runs (``native``), then
    ``diloco_workers_jax.streaming_ranks``, which ends with rank 1 leaving (so it comes last)."""
    return {"native": native_worker(seed, steps), **workers.streaming_ranks(seed, wire, steps, late_s)}


@pytest.fixture(scope="module")
def mpi_job(seed) -> tuple[int, int, str, list]:
    """``(seed, steps, wire, ranks)`` of one 2-rank MPI job for the tests below (one start of JAX and MPI)."""
    draw = np.random.default_rng([seed, zlib.crc32(b"test_diloco_jax:mpi_job")])
    seed, steps, wire = int(draw.integers(2**20)), 9, str(draw.choice(["bf16", "uint8", "uint4"]))
    results = run_ranks("test_diloco_jax:mpi_ranks", 2, seed, steps, wire, 0.75, launcher="mpiexec", timeout=300)
    return seed, steps, wire, results


@pytest.mark.skipif(not bagua_jax.build_info()["mpi"], reason="built without the MPI engine")
def test_native_communicator_matches_the_numpy_simulation(mpi_job):
    seed, steps, _, results = mpi_job
    for index, options in enumerate(NATIVE_OPTIONS):
        want = ref.simulate(
            2,
            steps,
            seed,
            sync_every=options["sync_every"],
            fragments=options.get("fragments", 1),
            delay=options.get("fragment_sync_delay", 0),
        )
        for result in results:
            for t, params in enumerate(result.value["native"][index]):
                for k in ref.SHAPES:
                    np.testing.assert_allclose(
                        params[k], want[t][result.rank][k], rtol=2e-5, atol=2e-6, err_msg=f"{options} {t} {k}"
                    )


@pytest.mark.skipif(not bagua_jax.build_info()["mpi"], reason="built without the MPI engine")
def test_streaming_exchanges_overlap_the_next_steps_with_the_same_bits(mpi_job):
    """On the MPI engine a fragment's exchange runs on a thread of its own while the next steps compute: rank 0
    finishes the steps that start and apply it before rank 1 (late for both) has begun them, and the parameters
    are bit for bit those of the exchange run inside the step, also when resumed from a state taken mid-exchange.
    When a peer leaves, the survivor's applying step raises the communicator's timeout error."""
    _, steps, wire, results = mpi_job
    first = workers.STARTS_FRAGMENT_1 + 1
    for result in results:
        got = result.value
        for t in range(steps):
            for k in ref.SHAPES:
                np.testing.assert_array_equal(
                    got["overlapped"][t][k], got["inline"][t][k], err_msg=f"{wire} {t + 1} {k}"
                )
                if t + 1 >= first:
                    resumed = got["resumed"][t + 1 - first][k]
                    np.testing.assert_array_equal(resumed, got["overlapped"][t][k], err_msg=f"{wire} {t + 1} {k}")
    # Rank 1 is late for the step that starts the exchange and for the one that applies it: rank 0 waits for it in
    # neither, as it would in the one that ran the exchange.
    finished, began = results[0].value["times"]["finished"], results[1].value["times"]["began"]
    assert finished[0] < began[0] and finished[1] < began[1], (finished, began)
    error = results[0].value["dead_peer"]
    assert "'diloco/outer_exchange'" in error and "did not complete within 3 s" in error, error


@pytest.mark.skipif(not bagua_jax.build_info()["mpi"], reason="built without the MPI engine")
def test_streaming_behind_a_counting_communicator_still_overlaps(mpi_job):
    """A wrapper (a CountingCommunicator) over the MPI engine keeps the exchanges on the background thread, with the
    same bits, and counts the bytes the thread sends."""
    _, steps, wire, results = mpi_job
    for result in results:
        counted = result.value["counted"]
        assert counted["on_the_thread"], f"rank {result.rank}: the exchanges run inside the step"
        assert counted["bytes"] > 0
        for t in range(steps):
            for k in ref.SHAPES:
                np.testing.assert_array_equal(
                    counted["params"][t][k], result.value["overlapped"][t][k], err_msg=f"{wire} {t + 1} {k}"
                )

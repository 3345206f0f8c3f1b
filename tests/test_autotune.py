"""The in-band tuner: search on noisy objectives, exact-knob enforcement, agreement across ranks, the cache."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from bagua_common.tuning import autotune
from bagua_common.tuning.autotune import (
    RING_ALWAYS,
    RING_NEVER,
    InBandTuner,
    TuningCache,
    TuningSession,
    autotune_mode,
    cache_key,
    check_knobs,
    grid,
    setting_label,
    tuning_knobs,
)
from bagua_common.tuning.successive_halving import SuccessiveHalving, minimize

BUCKETS = [2**k for k in range(16, 29)]  # 64 KiB .. 256 MiB, as the tuner's grid


def bowl(optimum: int, noise: float, seed: int):
    """A noisy step time with its minimum at bucket ``optimum`` (log-distance, plus multiplicative noise)."""
    rng = np.random.default_rng(seed)

    def sample(candidate):
        bucket, hierarchical = candidate
        base = 1.0 + 0.05 * abs(np.log2(bucket) - np.log2(optimum)) + (0.02 if hierarchical else 0.0)
        return base * (1.0 + noise * rng.standard_exponential())

    return sample


@pytest.mark.parametrize("seed", range(10))
def test_search_finds_the_optimum_of_a_noisy_objective_within_budget(seed):
    candidates = [(b, h) for b in BUCKETS for h in (False, True)]
    optimum = BUCKETS[seed % len(BUCKETS)]
    best, spent = minimize(candidates, bowl(optimum, noise=0.02, seed=seed), samples_per_round=3)
    assert best == (optimum, False)
    assert spent == 3 * (26 + 13 + 7 + 4 + 2)  # the field halves each round, 3 samples per survivor


def test_a_failed_candidate_is_never_picked_however_fast_it_looked():
    fast_then_failing = {"calls": 0}

    def sample(candidate):
        if candidate == "flaky":
            fast_then_failing["calls"] += 1
            if fast_then_failing["calls"] > 1:
                raise RuntimeError("out of memory")
            return 0.001
        return {"a": 1.0, "b": 1.2, "c": 1.5}[candidate]

    best, _ = minimize(["a", "b", "c", "flaky"], sample, samples_per_round=2)
    assert best == "a"


def test_search_reports_when_everything_failed():
    search = SuccessiveHalving(["a", "b"], samples_per_round=1)
    search.tell("a", None)
    search.tell("b", float("nan"))
    assert search.done and search.failed == {"a", "b"}
    with pytest.raises(RuntimeError, match="every candidate failed"):
        search.best


@pytest.mark.parametrize(
    "kwargs, message",
    [({"candidates": []}, "at least one"), ({"candidates": [1, 1]}, "repeat"), ({"eta": 1}, "eta")],
)
def test_search_rejects_bad_configuration(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SuccessiveHalving(**{"candidates": [1, 2], **kwargs})


@pytest.mark.parametrize(
    "algorithm", ["bytegrad", "qadam", "onebit_adam", "low_precision_decentralized", "powersgd", "custom"]
)
def test_compressed_algorithms_refuse_bucket_tuning_without_opt_in(algorithm):
    with pytest.raises(ValueError, match="depend on its bucket layout"):
        check_knobs(algorithm, {"bucket_bytes": BUCKETS})
    check_knobs(algorithm, {"bucket_bytes": BUCKETS}, allow_numerics_change=True)
    with pytest.raises(ValueError, match="hierarchical form computes other numbers"):
        check_knobs(algorithm, {"hierarchical": [False, True]})
    check_knobs(algorithm, {"hierarchical": [False, True]}, allow_numerics_change=True)
    check_knobs(algorithm, {"mpi_ring_min_bytes": [0, 2**20]})
    with pytest.raises(ValueError, match="depend on its bucket layout"):
        tuning_knobs(algorithm, bucket_bytes=2**20, total_bytes=2**24, hierarchical=True, two_levels=True)


@pytest.mark.parametrize("algorithm", ["decentralized", "async"])
def test_full_precision_averaging_tunes_buckets_but_not_a_hierarchy_that_changes_its_mixing(algorithm):
    with pytest.raises(ValueError, match="hierarchical form"):
        check_knobs(algorithm, {"hierarchical": [False, True]})
    knobs = tuning_knobs(algorithm, bucket_bytes=2**20, total_bytes=2**24, hierarchical=True, two_levels=True)
    assert set(knobs) == {"bucket_bytes"}


def test_full_precision_algorithms_tune_buckets_and_unknown_knobs_are_refused():
    check_knobs("gradient_allreduce", {"bucket_bytes": BUCKETS, "hierarchical": [False, True]})
    with pytest.raises(ValueError, match="not a knob known"):
        check_knobs("gradient_allreduce", {"learning_rate": [0.1, 0.01]})


def test_knobs_without_effect_in_the_job_are_not_searched():
    def knobs(**job):
        return tuning_knobs("gradient_allreduce", bucket_bytes=2**22, total_bytes=2**23, **job)

    assert knobs() == {"bucket_bytes": [2**22, 2**20, 2**24]}
    # Bucket sizes that hold the whole model, as the current one does, give the same single bucket.
    whole = tuning_knobs("gradient_allreduce", bucket_bytes=10 * 2**20, total_bytes=3 * 2**20)
    assert whole == {"bucket_bytes": [10 * 2**20, 2**20]}
    # One level: hierarchical and flat run the same allreduce. No MPI ring between nodes: no threshold.
    assert set(knobs(hierarchical=False, two_levels=False)) == {"bucket_bytes"}
    assert set(knobs(two_levels=True)) == {"bucket_bytes"}  # the algorithm has no such field
    assert knobs(hierarchical=True, two_levels=True)["hierarchical"] == [True, False]
    assert knobs(mpi_ring_min_bytes=2**20)["mpi_ring_min_bytes"] == [2**20, RING_ALWAYS, RING_NEVER]
    assert knobs(mpi_ring_min_bytes=0)["mpi_ring_min_bytes"] == [0, RING_NEVER]
    both = knobs(hierarchical=False, two_levels=True, mpi_ring_min_bytes=2**20)
    settings = grid(both)
    assert len(settings) == 3 * 2 * 3
    assert settings[0] == {"bucket_bytes": 2**22, "hierarchical": False, "mpi_ring_min_bytes": 2**20}
    assert len({setting_label(s) for s in settings}) == len(settings)


def test_mode_is_validated(monkeypatch):
    monkeypatch.setenv("BAGUA_AUTOTUNE", "cached")
    assert autotune_mode() == "cached"
    monkeypatch.delenv("BAGUA_AUTOTUNE")
    assert autotune_mode() == "off"
    with pytest.raises(ValueError, match="BAGUA_AUTOTUNE must be one of off, once, cached"):
        autotune_mode("always")


KNOBS = {"bucket_bytes": [2**20, 2**22, 2**24, 2**26]}


def on_thread_ranks(n, rank_main):
    """Run ``rank_main(rank, broadcast)`` on ``n`` threads whose ``broadcast`` really is rank 0's vector."""
    barrier = threading.Barrier(n)
    slot = {}

    def broadcast_from(rank):
        def broadcast(vector):
            if rank == 0:
                slot["v"] = vector.copy()
            barrier.wait(timeout=10)
            received = slot["v"].copy()
            barrier.wait(timeout=10)
            return received

        return broadcast

    threads = [threading.Thread(target=rank_main, args=(r, broadcast_from(r))) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)


def run_ranks(n, step_time, steps, knobs=KNOBS, **tuner_options):
    """Run ``n`` tuners on thread ranks; returns each rank's switches (step, setting) and its final setting."""
    settings = grid(knobs)
    switches = [[] for _ in range(n)]

    def rank_main(rank, broadcast):
        tuner = InBandTuner(settings, rank=rank, broadcast=broadcast, **tuner_options)
        for step in range(steps):
            change = tuner.step_finished(step_time(rank, step, tuner.current))
            if change is not None:
                switches[rank].append((step, change))
        switches[rank].append(("final", tuner.current, tuner.finished))

    on_thread_ranks(n, rank_main)
    return switches


@pytest.mark.parametrize("search", ["tpe-then-halving", "halving"])
def test_every_rank_switches_every_knob_at_the_same_step_despite_timing_skew(search, monkeypatch):
    # The grid (24 settings) is larger than LARGER_GRID: with optuna, TPE narrows it before halving decides.
    if search == "halving":
        monkeypatch.setattr(autotune, "larger_grid_search", lambda settings, **options: None)
    else:
        pytest.importorskip("optuna")
    rng = np.random.default_rng(0)
    steps = 1200
    skew = rng.uniform(0.5, 2.0, size=(4, steps))  # each rank sees its own, very different, timings
    knobs = {**KNOBS, "hierarchical": [False, True], "mpi_ring_min_bytes": [2**20, RING_ALWAYS, RING_NEVER]}

    def step_time(rank, step, setting):
        base = 1.0 + 0.5 * abs(np.log2(setting["bucket_bytes"]) - 24)
        base += 1.0 * (not setting["hierarchical"]) + 0.7 * (setting["mpi_ring_min_bytes"] != RING_ALWAYS)
        return base * skew[rank, step]

    switches = run_ranks(4, step_time, steps, knobs, warmup_steps=3, steps_per_sample=5, samples_per_round=2)
    assert all(s == switches[0] for s in switches), switches
    best = {"bucket_bytes": 2**24, "hierarchical": True, "mpi_ring_min_bytes": RING_ALWAYS}
    assert switches[0][-1] == ("final", best, True)
    path = [grid(knobs)[0]] + [setting for _, setting in switches[0][:-1]]
    changed = {name for before, after in zip(path, path[1:]) for name in knobs if before[name] != after[name]}
    assert changed == set(knobs)  # it really switched each knob, at least once


def test_a_setting_that_timed_out_once_is_dropped_even_if_otherwise_fastest():
    seen = [0, 0]

    def step_time(rank, step, setting):
        bucket = setting["bucket_bytes"]
        if bucket != 2**20:
            return 1.0 + abs(np.log2(bucket) - 22) * 0.1
        seen[rank] += 1
        return 50.0 if 3 < seen[rank] <= 6 else 0.5  # its second sample hangs, the others are the fastest

    switches = run_ranks(2, step_time, steps=200, warmup_steps=0, steps_per_sample=3, samples_per_round=3)
    assert switches[0] == switches[1]
    assert switches[0][-1] == ("final", {"bucket_bytes": 2**22}, True)


def test_cache_round_trip_is_keyed_and_atomic(tmp_path):
    cache = TuningCache(tmp_path / "sub" / "autotune.json")
    key = cache_key("digest", [4, 2], "mpi", "gradient_allreduce")
    assert cache.get(key) is None
    cache.put(key, {"bucket_bytes": 2**24}, {"0": 1.2})
    other = cache_key("digest", [4, 2], "mpi", "bytegrad")
    assert other != key and cache.get(other) is None
    cache.put(other, {"bucket_bytes": 2**20})
    assert TuningCache(cache.path).get(key) == {"bucket_bytes": 2**24}
    assert [p.name for p in cache.path.parent.iterdir()] == ["autotune.json"]
    cache.path.write_text("[1, 2")
    with pytest.raises(ValueError, match="unreadable"):
        cache.get(key)


def test_a_cached_run_follows_rank_0s_cache_on_every_rank(tmp_path):
    """Ranks on other nodes have other cache files (here: one empty, one with another choice); all start from
    rank 0's stored setting. A stored setting outside today's grid is not used: every rank tunes."""
    knobs = {**KNOBS, "hierarchical": [False, True]}
    key = cache_key("digest", [3], "mpi", "gradient_allreduce")
    caches = [TuningCache(tmp_path / f"rank{r}.json") for r in range(3)]
    caches[0].put(key, {"bucket_bytes": 2**24, "hierarchical": True})
    caches[2].put(key, {"bucket_bytes": 2**20, "hierarchical": False})
    outcome = [None] * 3

    def rank_main(rank, broadcast):
        session = TuningSession(knobs, key=key, mode="cached", rank=rank, broadcast=broadcast, cache=caches[rank])
        outcome[rank] = (session.finished, session.current, session.step_finished(1.0))

    on_thread_ranks(3, rank_main)
    assert outcome == [(True, {"bucket_bytes": 2**24, "hierarchical": True}, None)] * 3
    caches[0].put(key, {"bucket_bytes": 2**30, "hierarchical": True})
    on_thread_ranks(3, rank_main)
    assert outcome == [(False, grid(knobs)[0], None)] * 3

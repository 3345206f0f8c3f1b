"""The larger-grid search: optuna's TPE narrows a grid of settings, successive halving decides."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from bagua_common.tuning import tpe_search
from bagua_common.tuning.autotune import RING_ALWAYS, RING_NEVER, grid
from bagua_common.tuning.successive_halving import minimize
from bagua_common.tuning.tpe_search import LARGER_GRID, TpeThenHalving, larger_grid_search

pytest.importorskip("optuna")

KNOBS = {
    "bucket_bytes": [2**20, 2**22, 2**24, 2**26, 2**28],
    "hierarchical": [False, True],
    "mpi_ring_min_bytes": [2**20, RING_ALWAYS, RING_NEVER],
}
SETTINGS = grid(KNOBS)  # 30 settings


def step_time(optimum: dict, noise: float, seed: int):
    """A noisy step time, smallest at ``optimum``: 10% per factor of 4 in bucket size, 30% for the wrong
    hierarchy, 20% for the wrong ring threshold, times lognormal noise."""
    rng = np.random.default_rng(seed)

    def sample(index: int) -> float:
        setting = SETTINGS[index]
        base = 1.0 + 0.05 * abs(np.log2(setting["bucket_bytes"]) - np.log2(optimum["bucket_bytes"]))
        base += 0.3 * (setting["hierarchical"] != optimum["hierarchical"])
        base += 0.2 * (setting["mpi_ring_min_bytes"] != optimum["mpi_ring_min_bytes"])
        return base * rng.lognormal(0.0, noise)

    return sample


def run(search: TpeThenHalving, sample) -> tuple[int, int]:
    spent = 0
    while not search.done:
        index = search.ask()
        spent += 1
        search.tell(index, sample(index))
    return search.best, spent


@pytest.mark.parametrize("seed", range(10))
def test_finds_the_optimum_of_a_noisy_objective_in_fewer_samples_than_halving_the_whole_grid(seed):
    optimum = SETTINGS[(7 * seed + 3) % len(SETTINGS)]
    best, spent = run(TpeThenHalving(SETTINGS, seed=seed), step_time(optimum, noise=0.02, seed=seed))
    assert SETTINGS[best] == optimum
    _, halving_spent = minimize(list(range(len(SETTINGS))), step_time(optimum, noise=0.02, seed=seed))
    assert spent < halving_spent / 2, (spent, halving_spent)


def test_a_setting_that_failed_is_never_picked_however_fast_it_looked():
    optimum = {"bucket_bytes": 2**24, "hierarchical": True, "mpi_ring_min_bytes": RING_ALWAYS}
    flaky = SETTINGS.index(optimum)
    honest = step_time(optimum, noise=0.0, seed=0)
    calls = {"flaky": 0}

    def sample(index):
        if index == flaky:
            calls["flaky"] += 1
            return 0.5 if calls["flaky"] == 1 else None  # the fastest of all, then it fails
        return honest(index)

    search = TpeThenHalving(SETTINGS, seed=0)
    best, _ = run(search, sample)
    assert calls["flaky"] >= 2 and flaky in search.failed and flaky not in search.medians()
    others = [i for i in range(len(SETTINGS)) if i != flaky]
    runners_up = {i for i in others if honest(i) == min(honest(j) for j in others)}
    assert best in runners_up


def test_the_starting_setting_may_be_told_without_being_asked():
    search = TpeThenHalving(SETTINGS, seed=0)
    search.tell(0, 1.0)  # the run's first sample is of the setting it started with
    assert search.medians() == {0: 1.0}
    with pytest.raises(ValueError, match="unknown setting"):
        search.tell(len(SETTINGS), 1.0)


def test_everything_failing_is_an_error_not_a_hang():
    search = TpeThenHalving(SETTINGS[:4], seed=0)
    with pytest.raises(RuntimeError, match="every sampled setting failed"):
        while not search.done:
            search.tell(search.ask(), None)


def test_larger_grids_only_and_only_with_optuna(monkeypatch):
    assert larger_grid_search(SETTINGS[:LARGER_GRID], samples_per_round=3, eta=2) is None
    assert isinstance(larger_grid_search(SETTINGS, samples_per_round=3, eta=2), TpeThenHalving)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        tpe_search.importlib.util, "find_spec", lambda name: None if name == "optuna" else real_find_spec(name)
    )
    assert larger_grid_search(SETTINGS, samples_per_round=3, eta=2) is None

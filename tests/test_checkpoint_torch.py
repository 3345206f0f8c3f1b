"""bagua_torch.checkpoint: restore into another world size per algorithm, against a NumPy reference of the rules.

Three gloo jobs: 4 ranks train and save every algorithm; 2 ranks restore those (4 -> 2), train
and save; 4 ranks restore those (2 -> 4). What each rank got is compared with the rules
computed in NumPy from what the old ranks saved: synchronous parameters and Adam state carry
over from rank 0; decentralized parameters and their optimizer state start from the mean over
the old ranks; error-feedback residuals restart at zero; low-precision decentralized's weight
copies equal the restarted parameters; step counters carry.
"""

from __future__ import annotations

import numpy as np
import pytest
from checkpoint_workers_torch import ALGORITHMS
from multiprocess import run_ranks

pytest.importorskip("torch")

MEAN_ALGORITHMS = ("decentralized", "low_precision_decentralized", "async")


def mean(rows):
    return (np.stack(rows).astype(np.float64).sum(0) / len(rows)).astype(rows[0].dtype)


def expected_params(name, saved):
    old = [s["params"] for s in saved]
    return {k: mean([o[k] for o in old]) if name in MEAN_ALGORITHMS else old[0][k] for k in old[0]}


def expected_optimizer(name, saved):
    old = [s["optimizer"] for s in saved]
    if name not in MEAN_ALGORITHMS:
        return old[0]
    return {i: {k: mean([o[i][k] for o in old]) for k in old[0][i]} for i in old[0]}


def check_restored(name, restored, saved):
    params = expected_params(name, saved)
    for key, want in params.items():
        np.testing.assert_array_equal(restored["params"][key], want, err_msg=f"{name} {key}")
    for i, entries in expected_optimizer(name, saved).items():
        for key, want in entries.items():
            np.testing.assert_array_equal(restored["optimizer"][i][key], want, err_msg=f"{name} optimizer {i} {key}")
    state, old_state = restored["algorithm"], saved[0]["algorithm"]
    for key in ("residuals", "worker_residuals", "server_residuals"):
        if key in old_state:
            assert any(np.any(r) for s in saved for r in s["algorithm"][key]), f"{name}: nothing to reset in {key}"
            assert state[key] and not any(np.any(r) for r in state[key]), f"{name}: {key} not reset"
    for key in ("step", "step_id"):
        if key in old_state:
            assert state[key] == old_state[key], (name, key)
    if name == "powersgd":  # Q is the same on every rank: it carries over as saved
        for q, want in zip(state["qs"], old_state["qs"], strict=True):
            np.testing.assert_array_equal(q, want, err_msg="powersgd qs")
    if name == "low_precision_decentralized":
        values = np.sort(np.concatenate([v.ravel() for v in params.values()]))
        for key in ("weights", "left", "right"):
            np.testing.assert_array_equal(np.sort(np.concatenate(state[key])), values, err_msg=key)


def test_restore_into_another_world_size_follows_each_algorithms_rule(tmp_path, seed):
    four = run_ranks("checkpoint_workers_torch:restore_then_save", 4, seed, None, str(tmp_path / "a"), timeout=300)
    two = run_ranks(
        "checkpoint_workers_torch:restore_then_save", 2, seed, str(tmp_path / "a"), str(tmp_path / "b"), timeout=300
    )
    again = run_ranks(
        "checkpoint_workers_torch:restore_then_save", 4, seed, str(tmp_path / "b"), str(tmp_path / "c"), timeout=300
    )
    for name in ALGORITHMS:
        for old, new in ((four, two), (two, again)):
            saved = [r.value[name]["saved"] for r in old]
            for rank in new:
                check_restored(name, rank.value[name]["restored"], saved)
    errors = two[0].value["refusals"]
    assert "another model" in errors["model"] and "0.weight" in errors["model"], errors
    assert "DecentralizedAlgorithm" in errors["algorithm"], errors
    assert "no committed checkpoint" in errors["none"], errors

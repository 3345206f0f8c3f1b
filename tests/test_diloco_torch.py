"""DiLoCo and Streaming DiLoCo in PyTorch (bagua_torch.algorithms.diloco) against NumPy simulations of all ranks.

One gloo job of two ranks (diloco_workers_torch.py) runs every scenario; the test process
compares with tests/diloco_reference.py. torch's SGD may fuse its multiply-add, so the
comparisons with NumPy allow a few float32 ulps; a resumed run must match bit for bit.
"""

from __future__ import annotations

import diloco_reference as ref
import numpy as np
import pytest
from diloco_workers_torch import SCENARIOS
from scenarios import Job, JobTable

JOBS = JobTable("diloco_workers_torch:job", {"gloo-2ranks": Job(2, "python", tuple(SCENARIOS))}, mpi=False)
RANKS = 2


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s.name == "simulate"], ids=str)
def test_outer_steps_match_the_numpy_simulation(scenario):
    seed, results = JOBS.run("gloo-2ranks")
    options = scenario.options
    want = ref.simulate(
        RANKS,
        options["steps"],
        seed,
        sync_every=options["sync_every"],
        fragments=options.get("fragments", 1),
        delay=options.get("fragment_sync_delay", 0),
        alpha=options.get("fragment_update_alpha", 0.0),
    )
    for r, result in enumerate(results):
        for t, params in enumerate(result[scenario.label]):
            for k in ref.SHAPES:
                np.testing.assert_allclose(params[k], want[t][r][k], rtol=2e-5, atol=2e-6, err_msg=f"{t} {k}")
    # After a sync without mixing every rank holds the round start: the same bits.
    if not options.get("fragment_update_alpha"):
        synced = [results[r][scenario.label][options["sync_every"] - 1] for r in range(RANKS)]
        for k in ref.SHAPES:
            np.testing.assert_array_equal(synced[0][k], synced[1][k])


def test_h1_with_plain_sgd_outside_is_gradient_allreduce():
    seed, results = JOBS.run("gloo-2ranks")
    for result in results:
        diloco, allreduce = result["h1_and_allreduce"]
        runs = [[ref.initial(seed), *diloco], [ref.initial(seed), *allreduce]]
        for t, (got, want) in enumerate(zip(diloco, allreduce)):
            for k in ref.SHAPES:
                atol = ref.h1_allreduce_atol(runs, t + 1, k)
                np.testing.assert_allclose(got[k], want[k], rtol=0, atol=atol, err_msg=f"{t} {k}")


def test_resume_mid_round_is_bit_identical():
    _, results = JOBS.run("gloo-2ranks")
    for result in results:
        straight, resumed = result["resume"]
        for t, (want, got) in enumerate(zip(straight, resumed)):
            for k in ref.SHAPES:
                np.testing.assert_array_equal(got[k], want[k], err_msg=f"step {7 + t} {k}")


def test_bad_options_are_clear_errors():
    _, results = JOBS.run("gloo-2ranks")
    errors = results[0]["errors"]
    assert errors["sync_every"] == "ValueError: diloco: sync_every must be an int >= 1, got 0"
    assert "fragment_sync_delay (2) must be less than sync_every // fragments (4 // 2 = 2)" in errors["delay"]
    assert "fragments (4) must not exceed the number of parameters (3)" in errors["fragments"]
    assert "pass the optimizer(s) to the wrapper" in errors["no_optimizer"]


def test_restore_into_another_world_size_follows_the_rule():
    """Parameters: the ranks' mean; round start, averages awaiting their outer step, outer momentum and step: carried
    (the same on both ranks); residuals: zero, sized for one rank."""
    _, results = JOBS.run("gloo-2ranks")
    saved = [r["reshard"]["saved"] for r in results]
    restored = results[0]["reshard"]["restored"]
    assert results[0]["reshard"]["restored_step"] == 6 and restored["step"] == 6
    for k in ref.SHAPES:
        mean = ((saved[0]["params"][k].astype(np.float64) + saved[1]["params"][k]) / 2).astype(np.float32)
        np.testing.assert_array_equal(restored["params"][k], mean, err_msg=k)
    for key in ("round_start", "pending", "momentum"):
        for mine, theirs, now in zip(saved[0][key], saved[1][key], restored[key]):
            np.testing.assert_array_equal(mine, theirs, err_msg=key)
            np.testing.assert_array_equal(now, mine, err_msg=key)
    assert saved[0]["pending"][1].size and any(np.any(r) for r in saved[0]["residuals"])
    # The fragments ({a}, {b, c}) hold 15 and 10 elements: padded to a multiple of 2 ranks when saved, of 1 now.
    assert [r.size for r in saved[0]["residuals"]] == [16, 10]
    assert [r.size for r in restored["residuals"]] == [15, 10] and not any(np.any(r) for r in restored["residuals"])
    assert all(np.all(np.isfinite(v)) for v in results[0]["reshard"]["trained_on"].values())


@pytest.mark.parametrize(
    "options, want", [({}, (0.7, 0.9, True)), ({"outer_learning_rate": 1.0, "outer_momentum": 0.0}, (1.0, 0.0, False))]
)
def test_outer_learning_rate_and_momentum_make_the_default_outer_optimizer(options, want):
    import torch

    from bagua_common.algorithms.diloco import DiLoCoConfig
    from bagua_torch.algorithms.diloco import default_outer_optimizer

    group = default_outer_optimizer(DiLoCoConfig(sync_every=4, **options))([torch.zeros(2)]).param_groups[0]
    assert (group["lr"], group["momentum"], group["nesterov"]) == want

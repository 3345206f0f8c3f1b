"""The balanced planner's invariants, checked against plain NumPy bookkeeping."""

import numpy as np
import pytest

from bagua_common.data.balanced_plan import BalancedPlan


def skewed_costs(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).lognormal(4.0, 0.8, n).round()


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
@pytest.mark.parametrize("mode", [{"batch_size": 3}, {"token_budget": 2000.0}])
def test_each_sample_once_and_equal_steps(world_size, mode):
    costs = skewed_costs(96)
    plan = BalancedPlan(costs, world_size=world_size, seed=5, **mode).epoch(2)
    seen = np.sort(np.concatenate([plan.rank_indices(r) for r in range(world_size)]))
    np.testing.assert_array_equal(seen, np.arange(96))
    lengths = {len(plan.rank_indices(r)) for r in range(world_size)}
    assert len(lengths) == 1
    for step in range(plan.num_steps):
        sizes = {len(plan.batch(r, step)) for r in range(world_size)}
        assert len(sizes) == 1


def test_token_budget_is_respected_and_steps_are_full():
    costs = skewed_costs(500)
    budget = 3 * costs.max()
    plan = BalancedPlan(costs, world_size=4, token_budget=budget, megabatch=32).epoch(0)
    for step in plan.steps:
        padded = len(step) * costs[step].max()
        assert padded <= budget
    assert plan.num_steps < 500 / 4


def test_identical_plans_on_every_rank_and_resume():
    costs = skewed_costs(101)
    make = lambda: BalancedPlan(costs, world_size=4, batch_size=2, seed=9, jitter=0.1)
    a, b = make().epoch(3), make().epoch(3)
    assert a.num_steps == b.num_steps
    for sa, sb in zip(a.steps, b.steps):
        np.testing.assert_array_equal(sa, sb)
    assert not all(np.array_equal(x, y) for x, y in zip(a.steps, make().epoch(4).steps))


def test_lazy_cost_fn_matches_array_and_is_called_once_per_index():
    costs = skewed_costs(40)
    calls = []

    def cost_fn(i):
        calls.append(i)
        return costs[i]

    lazy = BalancedPlan(world_size=2, cost_fn=cost_fn, num_samples=40, batch_size=4)
    assert calls == []
    eager = BalancedPlan(costs, world_size=2, batch_size=4)
    for sa, sb in zip(lazy.epoch(1).steps, eager.epoch(1).steps):
        np.testing.assert_array_equal(sa, sb)
    lazy.epoch(2)
    assert sorted(calls) == list(range(40))


def test_rank_sets_change_between_epochs():
    world_size = 4
    plan = BalancedPlan(skewed_costs(2000), world_size=world_size, batch_size=8)
    first, second = plan.epoch(0), plan.epoch(1)
    overlaps = [
        len(np.intersect1d(first.rank_indices(r), second.rank_indices(r))) / len(first.rank_indices(r))
        for r in range(world_size)
    ]
    # A fresh random assignment keeps about 1/world_size of a rank's samples.
    assert all(abs(o - 1 / world_size) < 0.05 for o in overlaps), overlaps


def test_steps_are_balanced_within_group_spread():
    costs = skewed_costs(1000)
    plan = BalancedPlan(costs, world_size=4, batch_size=4).epoch(0)
    per_rank = plan.step_costs()
    for step, groups in enumerate(plan.steps):
        group_spread = (costs[groups].max(axis=1) - costs[groups].min(axis=1)).sum()
        assert per_rank[step].max() - per_rank[step].min() <= group_spread + 1e-9


def test_drop_last_drops_a_representative_remainder():
    costs = np.arange(103, dtype=float)  # 103 = 4 * 25 + 3: three dropped per epoch
    plan = BalancedPlan(costs, world_size=4, batch_size=1, drop_last=True)
    dropped = np.concatenate([plan.epoch(e).dropped for e in range(400)])
    assert all(len(plan.epoch(e).dropped) == 3 for e in range(3))
    sigma = costs.std() / np.sqrt(len(dropped))
    assert abs(dropped.mean() - costs.mean()) < 3 * sigma
    kept = plan.epoch(0)
    seen = np.concatenate([kept.rank_indices(r) for r in range(4)])
    np.testing.assert_array_equal(np.sort(np.concatenate([seen, kept.dropped])), np.arange(103))


def test_no_drop_pads_with_repeats_and_drop_last_cuts_short_step():
    costs = skewed_costs(14)  # 14 = 3 groups of 4 + 2
    padded = BalancedPlan(costs, world_size=4, batch_size=2).epoch(0)
    seen = np.concatenate([padded.rank_indices(r) for r in range(4)])
    assert len(seen) == 16 and set(seen) == set(range(14))
    dropped = BalancedPlan(costs, world_size=4, batch_size=2, drop_last=True).epoch(0)
    assert dropped.num_steps == 1 and len(dropped.dropped) == 6


def test_megabatch_reduces_padding():
    costs = skewed_costs(4000)

    def padded_cost(**kw):
        plan = BalancedPlan(costs, world_size=4, batch_size=8, **kw).epoch(0)
        return sum(len(s) * costs[s].max() for s in plan.steps)

    assert padded_cost(megabatch=512) < 0.5 * padded_cost()


def test_verify_detects_different_costs():
    costs = skewed_costs(50)
    plans = [BalancedPlan(costs, world_size=2, batch_size=2) for _ in range(2)]
    plans[0].verify(lambda mine: [p.fingerprint() for p in plans])
    other = costs.copy()
    other[7] += 1
    plans[1] = BalancedPlan(other, world_size=2, batch_size=2)
    with pytest.raises(ValueError, match=r"ranks \[1\]"):
        plans[0].verify(lambda mine: [p.fingerprint() for p in plans])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"costs": [1.0, float("nan")]}, "sample 1"),
        ({"costs": [1.0, -2.0]}, "-2.0"),
        ({"costs": [1.0, float("inf")]}, "inf"),
        ({"costs": []}, "non-empty"),
        ({"costs": [1.0, 2.0], "world_size": 3}, "world_size=3"),
        ({"world_size": 0}, "world_size"),
        ({"batch_size": 0}, "batch_size must"),
        ({"batch_size": 2, "token_budget": 5.0}, "exactly one of batch_size"),
        ({"batch_size": None}, "exactly one of batch_size"),
        ({"batch_size": None, "token_budget": 2.0}, "sample 3 costs 4.0"),
        ({"batch_size": None, "token_budget": -1.0}, "token_budget"),
        ({"megabatch": 0}, "megabatch"),
        ({"jitter": -0.5}, "jitter"),
        ({"seed": -1}, "seed"),
        ({"num_samples": 7}, "num_samples=7"),
    ],
)
def test_bad_input_raises_value_error_naming_it(kwargs, message):
    args = {"costs": [1.0, 2.0, 3.0, 4.0], "world_size": 2, "batch_size": 1} | kwargs
    with pytest.raises(ValueError, match=message):
        BalancedPlan(**args).epoch(0)


def test_bad_epoch_rank_and_step_raise():
    plan = BalancedPlan([1.0, 2.0, 3.0, 4.0], world_size=2, batch_size=1)
    with pytest.raises(ValueError, match="epoch"):
        plan.epoch(-1)
    epoch = plan.epoch(0)
    with pytest.raises(ValueError, match="rank"):
        epoch.batch(2, 0)
    with pytest.raises(ValueError, match="step"):
        epoch.batch(0, 5)
    with pytest.raises(ValueError, match="exactly one of costs"):
        BalancedPlan(world_size=2, batch_size=1)

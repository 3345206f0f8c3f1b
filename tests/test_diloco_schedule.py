"""Streaming DiLoCo's fragments and schedule (bagua_common.algorithms.diloco), against their definitions."""

from __future__ import annotations

import numpy as np
import pytest

from bagua_common.algorithms.diloco import DiLoCoConfig, fragment_plan


def test_fragments_are_contiguous_nonempty_and_balanced(rng):
    for _ in range(50):
        sizes = [int(s) for s in rng.integers(1, 1000, size=int(rng.integers(1, 30)))]
        parts = int(rng.integers(1, len(sizes) + 1))
        plan = fragment_plan(sizes, parts)
        assert len(plan) == parts and all(len(part) for part in plan)
        assert [i for part in plan for i in part] == list(range(len(sizes)))
        # Fragment p ends at the first parameter where the running total reaches (p+1)/P of the whole (earlier where
        # the later fragments need the parameters; never empty): before its last parameter the total was short.
        totals = [sum(sizes[i] for i in part) for part in plan]
        for p, part in enumerate(plan[:-1]):
            assert len(part) == 1 or sum(totals[: p + 1]) - sizes[part[-1]] < sum(sizes) * (p + 1) / parts


def test_too_many_fragments_is_an_error():
    with pytest.raises(ValueError, match=r"fragments \(4\) must not exceed the number of parameters \(3\)"):
        fragment_plan([5, 5, 5], 4)


@pytest.mark.parametrize("sync_every, fragments, delay", [(1, 1, 0), (6, 1, 5), (8, 4, 1), (10, 3, 2), (7, 7, 0)])
def test_each_fragment_is_exchanged_once_a_round_and_applied_tau_steps_later(sync_every, fragments, delay):
    config = DiLoCoConfig(sync_every=sync_every, fragments=fragments, fragment_sync_delay=delay)
    steps = 5 * sync_every
    exchanged = {p: [t for t in range(1, steps + 1) if p in config.exchanges_after(t)] for p in range(fragments)}
    applied = {p: [t for t in range(1, steps + 1) if p in config.applies_after(t)] for p in range(fragments)}
    for p in range(fragments):
        offset = p * sync_every // fragments
        assert exchanged[p] == [t for t in range(1, steps + 1) if (t - offset) % sync_every == 0]
        assert applied[p] == [t + delay for t in exchanged[p] if t + delay <= steps]
    # At most one exchange is on the wire at a time: each is applied before the next one starts.
    events = sorted([(t, 1) for ts in exchanged.values() for t in ts] + [(t, 0) for ts in applied.values() for t in ts])
    in_flight = np.cumsum([1 if start else -1 for _, start in events])
    assert in_flight.max() <= 1


@pytest.mark.parametrize("sync_every, fragments", [(1, 1), (4, 1), (8, 4), (10, 3)])
def test_steps_to_exchange_reach_the_next_exchange_and_no_earlier_one(sync_every, fragments):
    config = DiLoCoConfig(sync_every=sync_every, fragments=fragments)
    every = sync_every // fragments if sync_every % fragments == 0 else None
    for step in range(0, 3 * sync_every):
        steps = config.steps_to_exchange(step)
        assert config.exchanges_after(step + steps), (step, steps)
        assert not any(config.exchanges_after(step + k) for k in range(1, steps)), (step, steps)
        if every is not None and step >= 1:  # fragments evenly spaced: an exchange every sync_every/fragments steps
            assert steps == every - step % every, (step, steps)

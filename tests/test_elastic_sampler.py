"""The step-indexed elastic sampler: each epoch's samples exactly once across the live ranks, also across a resize."""

from __future__ import annotations

import numpy as np
import pytest

from bagua_common.data.elastic_sampler import ElasticSampler


def epoch_of(sampler: ElasticSampler, world_by_step) -> np.ndarray:
    """Every index the live ranks train on in epoch 0, each step split across that step's world size."""
    seen = []
    for step in range(sampler.steps_per_epoch):
        world = world_by_step(step)
        seen += [sampler.indices(step, rank, world) for rank in range(world)]
    return np.concatenate(seen)


@pytest.mark.parametrize("num_samples", [96, 100])
def test_every_sample_once_per_epoch_across_a_resize(num_samples):
    sampler = ElasticSampler(num_samples, 12, seed=3)
    # 4 ranks, then 2 after a scale-down at step 3, then 6 after a scale-up at step 5.
    seen = epoch_of(sampler, lambda step: 4 if step < 3 else 2 if step < 5 else 6)
    used = sampler.steps_per_epoch * 12
    assert len(seen) == used and len(np.unique(seen)) == used
    permutation = np.random.default_rng([3, 0]).permutation(num_samples)
    np.testing.assert_array_equal(np.sort(seen), np.sort(permutation[:used]))


def test_a_step_sees_the_same_samples_whatever_the_world_size():
    sampler = ElasticSampler(64, 8, seed=1)
    for step in (0, 7, 8, 19):  # step 8 starts epoch 1: another permutation
        whole = sampler.global_indices(step)
        for world in (1, 2, 4, 8):
            np.testing.assert_array_equal(
                np.concatenate([sampler.indices(step, r, world) for r in range(world)]), whole
            )
    assert not np.array_equal(np.sort(sampler.global_indices(0)), np.sort(sampler.global_indices(8)))


def test_world_sizes_that_do_not_split_the_batch_are_refused():
    sampler = ElasticSampler(64, 8)
    with pytest.raises(ValueError, match="does not split evenly across 3 ranks"):
        sampler.indices(0, 0, 3)
    with pytest.raises(ValueError, match="rank 4"):
        sampler.indices(0, 4, 4)
    with pytest.raises(ValueError, match="global_batch"):
        ElasticSampler(4, 8)

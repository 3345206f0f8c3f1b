"""The torch samplers: sharding, equal step counts, per-epoch reshuffles and resume."""

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from bagua_torch.data import BalancedBatchSampler, LoadBalancingDistributedSampler


def lengths(n: int) -> np.ndarray:
    return np.random.default_rng(1).integers(1, 200, n)


@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_shards_the_dataset_and_reshuffles(drop_last):
    costs = lengths(103)
    dataset = list(range(103))
    samplers = [
        LoadBalancingDistributedSampler(dataset, lambda i: costs[i], num_replicas=4, rank=r, drop_last=drop_last)
        for r in range(4)
    ]
    first = [list(s) for s in samplers]
    assert {len(f) for f in first} == {len(samplers[0])}
    assert len(samplers[0]) == (25 if drop_last else 26)
    union = set().union(*map(set, first))
    assert len(union) == (100 if drop_last else 103)
    for sampler in samplers:
        sampler.set_epoch(1)
    second = [list(s) for s in samplers]
    assert all(set(a) != set(b) for a, b in zip(first, second))
    # Each step's samples across ranks come from one cost group: their spread is small.
    spread = np.mean([np.ptp(costs[list(step)]) for step in zip(*first)])
    assert spread < 0.2 * np.ptp(costs)


def test_sampler_resumes_from_state_dict():
    dataset = list(range(50))
    sampler = LoadBalancingDistributedSampler(dataset, num_replicas=2, rank=1, costs=lengths(50))
    sampler.set_epoch(3)
    full = list(sampler)
    sampler.set_epoch(3)
    it = iter(sampler)
    head = [next(it) for _ in range(7)]
    state = sampler.state_dict()
    resumed = LoadBalancingDistributedSampler(dataset, num_replicas=2, rank=1, costs=lengths(50))
    resumed.load_state_dict(state)
    assert head + list(resumed) == full
    assert list(resumed) == full  # a finished epoch starts over


@pytest.mark.parametrize("mode", [{"batch_size": 4, "drop_last": True}, {"token_budget": 600}])
def test_batch_sampler_gives_every_rank_the_same_step_count(mode):
    costs = lengths(97)
    dataset = TensorDataset(torch.arange(97))
    counts, seen = [], []
    for rank in range(4):
        sampler = BalancedBatchSampler(costs, num_replicas=4, rank=rank, megabatch=16, **mode)
        batches = [b[0].tolist() for b in DataLoader(dataset, batch_sampler=sampler)]
        counts.append(len(batches))
        assert len(batches) == len(sampler)
        seen += [i for b in batches for i in b]
        if "token_budget" in mode:
            assert all(len(b) * costs[b].max() <= 600 for b in batches)
    assert len(set(counts)) == 1
    if mode.get("drop_last"):
        assert len(seen) == len(set(seen)) and len(seen) >= 97 - 3 - 4 * 3
    else:  # 97 = 4 * 24 + 1: three random samples repeat to fill the last group
        assert len(seen) == 100 and set(seen) == set(range(97))


def test_bad_rank_and_sizes_raise():
    with pytest.raises(ValueError, match="rank must be"):
        LoadBalancingDistributedSampler(range(4), num_replicas=2, rank=2, costs=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="num_replicas and rank"):
        LoadBalancingDistributedSampler(range(4), costs=[1, 2, 3, 4])
    with pytest.raises(ValueError, match="3 costs"):
        LoadBalancingDistributedSampler(range(4), num_replicas=1, rank=0, costs=[1, 2, 3])
    sampler = BalancedBatchSampler([1, 2], batch_size=1, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="epoch"):
        sampler.set_epoch(-2)

"""The balanced sampler and the cache under grain's own DataLoader, against the plan itself."""

import grain.python as grain
import numpy as np
import pytest
from cache_datasets import CountingDataset, reads

from bagua_common.data.balanced_plan import BalancedPlan
from bagua_common.data.cache_stores import ENV_CACHE_DIR, ENV_CACHE_URL
from bagua_jax.grain_data import BalancedSampler, CachedDataSource


def sample(index: int) -> np.ndarray:
    return np.random.default_rng(index).standard_normal(64).astype(np.float32)


@pytest.fixture(autouse=True)
def absl_flags():
    """grain's worker processes read absl flags, which a program run by absl.app would have parsed."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def rank_batches(source, plan: BalancedPlan, rank: int, epochs: int, workers: int) -> list[np.ndarray]:
    loader = grain.DataLoader(
        data_source=source,
        sampler=BalancedSampler(plan, num_epochs=epochs, worker_count=workers),
        operations=[grain.Batch(plan.batch_size)],
        shard_options=grain.ShardOptions(shard_index=rank, shard_count=plan.world_size),
        worker_count=workers,
    )
    return list(loader)


def random_plan(rng) -> BalancedPlan:
    world, batch = 2, int(rng.integers(2, 5))
    # An even number of steps, so two workers end on whole batches; drop_last drops the rest.
    n = world * batch * 2 * int(rng.integers(3, 6)) + int(rng.integers(world * batch))
    seed = int(rng.integers(1 << 16))
    return BalancedPlan(rng.lognormal(3, 1, n), world_size=world, batch_size=batch, seed=seed, drop_last=True)


def expected_batches(plan: BalancedPlan, rank: int, epochs: range) -> list[np.ndarray]:
    return [
        np.stack([sample(int(i)) for i in plan.epoch(e).batch(rank, s)])
        for e in epochs
        for s in range(plan.epoch(e).num_steps)
    ]


def test_each_shard_reads_its_rank_of_the_plan_through_the_node_cache(rng, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_CACHE_URL, raising=False)
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path / "node"))
    plan, log = random_plan(rng), str(tmp_path / "reads")
    source = CachedDataSource(CountingDataset(plan.num_samples, log), name="grain")
    epoch_reads = []
    for epoch in range(2):
        before = reads(log)
        for rank in range(plan.world_size):
            got = rank_batches(source, plan, rank, epochs=epoch + 1, workers=0)
            want = expected_batches(plan, rank, range(epoch + 1))
            assert len(got) == len(want)
            for have, expected in zip(got, want):
                np.testing.assert_array_equal(have, expected)
        epoch_reads.append(reads(log) - before)
    first, second = (set(np.concatenate(plan.epoch(e).steps).ravel().tolist()) for e in range(2))
    # Each sample read once; epoch 2 reads only the samples epoch 1 dropped, whichever shard read them.
    assert epoch_reads == [len(first), len(second - first)]


def test_grain_worker_processes_batch_the_plan_steps_in_order(rng, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_CACHE_URL, raising=False)
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path / "node"))
    plan, log = random_plan(rng), str(tmp_path / "reads")
    source = CachedDataSource(CountingDataset(plan.num_samples, log), name="grain")
    got = rank_batches(source, plan, 1, epochs=2, workers=2)
    want = expected_batches(plan, 1, range(2))
    assert len(got) == len(want)
    for have, expected in zip(got, want):
        np.testing.assert_array_equal(have, expected)


def test_sampler_lays_out_epochs_rank_by_rank_and_refuses_token_budgets(rng):
    plan = BalancedPlan(rng.lognormal(3, 1, 33), world_size=3, batch_size=2, drop_last=True)
    sampler = BalancedSampler(plan, num_epochs=2)
    assert len(sampler) == 2 * 30  # 11 groups of 3, cut into steps of 2 groups: the short last step dropped
    for epoch in range(2):
        for rank in range(3):
            keys = [sampler[epoch * 30 + k * 3 + rank].record_key for k in range(10)]
            assert keys == plan.epoch(epoch).rank_indices(rank).tolist()
    with pytest.raises(IndexError):
        sampler[60]
    # Two workers: a shard's records alternate between them, and each worker's pairs are whole steps.
    two = BalancedSampler(plan, num_epochs=2, worker_count=2)
    rank0 = [two[k * 3].record_key for k in range(20)]
    worker_batches = [rank0[w::2][b * 2 : b * 2 + 2] for b in range(5) for w in range(2)]
    assert worker_batches == [plan.epoch(e).batch(0, s).tolist() for e in range(2) for s in range(5)]
    same = BalancedPlan(plan.costs, world_size=3, batch_size=2, drop_last=True)
    assert repr(sampler) == repr(BalancedSampler(same, 2)) != repr(BalancedSampler(same, 3))
    with pytest.raises(ValueError, match="batch_size"):
        BalancedSampler(BalancedPlan(plan.costs, world_size=3, token_budget=1e9))
    with pytest.raises(ValueError, match="drop_last=True"):
        BalancedSampler(BalancedPlan(plan.costs, world_size=3, batch_size=4))
    with pytest.raises(ValueError, match="share out evenly over 2 workers"):
        BalancedSampler(plan, num_epochs=1, worker_count=2)  # 5 steps


def test_cached_data_source_describes_itself_without_an_address(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(ENV_CACHE_URL, raising=False)
    first, second = (CachedDataSource(list(range(3)), name="corpus", version="v1") for _ in range(2))
    assert repr(first) == repr(second) and "corpus" in repr(first) and "0x" not in repr(first)

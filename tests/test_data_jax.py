"""The JAX batch iterator: fixed shapes, masks, rank-major global batches, bounded compiles."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bagua_common.data.balanced_plan import BalancedPlan
from bagua_jax.data import balanced_batches

PAD_TO = (16, 32, 64, 128)


def make_samples(n: int = 120):
    sizes = np.random.default_rng(2).integers(1, 128, n)
    samples = [np.full((int(s), 3), i, dtype=np.float32) for i, s in enumerate(sizes)]
    return sizes, samples


@pytest.mark.parametrize("mode", [{"batch_size": 4}, {"token_budget": 512}])
def test_native_batches_match_the_plan_and_global_batch_is_rank_major(mode):
    sizes, samples = make_samples()
    plan = BalancedPlan(sizes, world_size=2, seed=4, **mode)
    epoch = plan.epoch(1)
    per_rank = [list(balanced_batches(plan, 1, samples.__getitem__, rank=r, pad_to=PAD_TO)) for r in range(2)]
    global_batches = list(balanced_batches(plan, 1, samples.__getitem__, pad_to=PAD_TO))
    assert len(per_rank[0]) == len(per_rank[1]) == len(global_batches) == epoch.num_steps
    for step, (batch, mask) in enumerate(global_batches):
        np.testing.assert_array_equal(batch, np.concatenate([p[step][0] for p in per_rank]))
        np.testing.assert_array_equal(mask, np.concatenate([p[step][1] for p in per_rank]))
        assert batch.shape[1] in PAD_TO and batch.shape[1] >= sizes[epoch.steps[step]].max()
        for rank in range(2):
            rank_batch, rank_mask = per_rank[rank][step]
            indices = epoch.batch(rank, step)
            np.testing.assert_array_equal(rank_mask.sum(axis=1)[: len(indices)], sizes[indices])
            assert not rank_mask[len(indices) :].any()
            np.testing.assert_array_equal(rank_batch[: len(indices), 0, 0], indices)
            assert rank_batch[~rank_mask].sum() == 0


def test_jitted_step_compiles_at_most_once_per_length():
    sizes, samples = make_samples()
    plan = BalancedPlan(sizes, world_size=2, batch_size=4)

    @jax.jit
    def masked_mean(batch, mask):
        return jnp.sum(batch[..., 0] * mask) / jnp.maximum(mask.sum(), 1)

    for epoch in range(3):
        for batch, mask in balanced_batches(plan, epoch, samples.__getitem__, pad_to=PAD_TO):
            expected = batch[..., 0][mask].mean()
            np.testing.assert_allclose(masked_mean(batch, mask), expected, rtol=1e-6)
    assert masked_mean._cache_size() <= len(PAD_TO)


def test_bad_input_raises():
    sizes, samples = make_samples()
    plan = BalancedPlan(sizes, world_size=2, batch_size=4)
    with pytest.raises(ValueError, match="over pad_to"):
        next(balanced_batches(plan, 0, samples.__getitem__, pad_to=(16, 32)))
    with pytest.raises(ValueError, match="rank must be"):
        next(balanced_batches(plan, 0, samples.__getitem__, rank=2, pad_to=PAD_TO))
    with pytest.raises(ValueError, match="lengths must hold"):
        next(balanced_batches(plan, 0, samples.__getitem__, lengths=[1, 2], pad_to=PAD_TO))
    short = np.ones_like(sizes)
    with pytest.raises(ValueError, match="over its 16"):
        next(balanced_batches(plan, 0, samples.__getitem__, lengths=short, pad_to=PAD_TO))


def test_cached_dataset_feeds_the_iterator(tmp_path):
    from bagua_common.data.cache_stores import LmdbStore
    from bagua_common.data.cached_dataset import CachedDataset

    sizes, samples = make_samples(40)
    cached = CachedDataset(samples, LmdbStore(str(tmp_path / "c"), capacity_bytes=1 << 24), name="j")
    plan = BalancedPlan(sizes, world_size=2, batch_size=4)
    for epoch in range(2):
        direct = list(balanced_batches(plan, epoch, samples.__getitem__, pad_to=PAD_TO))
        through_cache = list(balanced_batches(plan, epoch, cached.__getitem__, pad_to=PAD_TO))
        for (a, ma), (b, mb) in zip(direct, through_cache):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(ma, mb)
    assert cached.stats()["misses"] == 40 and cached.stats()["hits"] == 40


def test_start_step_resumes_mid_epoch():
    sizes, samples = make_samples()
    plan = BalancedPlan(sizes, world_size=2, token_budget=512)
    full = list(balanced_batches(plan, 5, samples.__getitem__, rank=1, pad_to=PAD_TO))
    resumed = list(balanced_batches(plan, 5, samples.__getitem__, rank=1, pad_to=PAD_TO, start_step=3))
    assert len(resumed) == len(full) - 3
    for (a, ma), (b, mb) in zip(full[3:], resumed):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ma, mb)

"""bagua_jax.bucketing against a NumPy reference: grouping, padding, and the round trip."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from bagua_jax.bucketing import plan_buckets

BF16 = np.dtype(ml_dtypes.bfloat16)


def tree_of(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b": rng.standard_normal(7).astype(np.float32),
        "c": rng.standard_normal((2, 2)).astype(BF16),
        "d": rng.standard_normal((4, 3, 2)).astype(np.float32),
        "e": np.float32(rng.standard_normal()),
    }


@pytest.mark.parametrize("bucket_bytes, pad_to", [(1 << 20, 1), (1 << 20, 4), (80, 3), (1, 1)])
def test_flatten_matches_numpy_and_round_trips(rng, bucket_bytes, pad_to):
    tree = tree_of(rng)
    plan = plan_buckets(tree, bucket_bytes, pad_to)
    leaves = jax.tree.leaves(tree)
    flat = jax.jit(plan.flatten)(tree)
    assert len(flat) == len(plan.buckets)
    for bucket, got in zip(plan.buckets, flat):
        parts = [np.ravel(leaves[i]) for i in bucket.leaves]
        used = sum(p.size for p in parts)
        expected = np.concatenate([*parts, np.zeros(bucket.size - used, bucket.dtype)])
        assert bucket.size % pad_to == 0 and bucket.size - used < pad_to
        assert got.dtype == bucket.dtype and np.asarray(got).tobytes() == expected.astype(bucket.dtype).tobytes()
    back = jax.jit(plan.unflatten)(flat)
    for name in tree:
        assert back[name].dtype == tree[name].dtype and back[name].shape == np.shape(tree[name])
        np.testing.assert_array_equal(np.asarray(back[name]), tree[name])


def test_buckets_close_on_size_and_dtype(rng):
    plan = plan_buckets(tree_of(rng), bucket_bytes=100)
    # a (60 B) + b (28 B) fit in 100 bytes; c is bfloat16; d (96 B) then e (4 B) fill the next one.
    assert [b.leaves for b in plan.buckets] == [(0, 1), (2,), (3, 4)]
    assert [np.dtype(b.dtype) for b in plan.buckets] == [np.float32, BF16, np.float32]


def test_flatten_writes_slices_rather_than_concatenating(rng):
    """XLA's CPU backend copies a concatenate element by element (several times slower than the
    slice updates for a multi-megabyte bucket), so a bucket of several leaves must not be one."""
    tree = {k: v for k, v in tree_of(rng).items() if k != "c"}
    plan = plan_buckets(tree, pad_to=4)
    hlo = jax.jit(plan.flatten).lower(tree).compile().as_text()
    assert "concatenate" not in hlo


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="bucket_bytes must be a positive int"):
        plan_buckets({"a": jnp.zeros(3)}, bucket_bytes=0)
    with pytest.raises(ValueError, match="pad_to must be an int >= 1"):
        plan_buckets({"a": jnp.zeros(3)}, pad_to=0)


@pytest.mark.parametrize("bucket_bytes", [1 << 20, 80])
def test_flatten_makes_room_at_the_end_of_the_buckets_named(rng, bucket_bytes):
    tree = tree_of(rng)
    plan = plan_buckets(tree, bucket_bytes, pad_to=4)
    plain = jax.jit(plan.flatten)(tree)
    room = {i: i + 2 for i in range(0, len(plan.buckets), 2)}
    roomy = jax.jit(lambda t: plan.flatten(t, room=room))(tree)
    for i, (bucket, without, got) in enumerate(zip(plan.buckets, plain, roomy)):
        expected = np.concatenate([np.asarray(without), np.zeros(room.get(i, 0), bucket.dtype)])
        assert got.dtype == bucket.dtype and np.asarray(got).tobytes() == expected.tobytes()

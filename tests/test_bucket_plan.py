"""bagua_common.comm.bucket_plan without frameworks, and both front ends making the same buckets with it."""

from __future__ import annotations

import numpy as np
import pytest

from bagua_common.comm.bucket_plan import PlannedBucket, TensorSlot, padded_size, plan_buckets

F32, F16 = np.dtype(np.float32), np.dtype(np.float16)


def reference_plan(numels, itemsizes, kinds, bucket_bytes, pad_to):
    """Bucket boundaries recomputed from the rule as written: close before a tensor that would
    overflow ``bucket_bytes`` or has another kind; pad every bucket up to ``pad_to``."""
    boundaries = [0]
    for i in range(1, len(numels)):
        start = boundaries[-1]
        used = sum(n * s for n, s in zip(numels[start:i], itemsizes[start:i]))
        if kinds[i] != kinds[start] or used + numels[i] * itemsizes[i] > bucket_bytes:
            boundaries.append(i)
    boundaries.append(len(numels))
    plan = []
    for start, stop in zip(boundaries, boundaries[1:]):
        members = list(range(start, stop))
        offsets = list(np.cumsum([0] + [numels[i] for i in members])[:-1])
        numel = sum(numels[i] for i in members)
        plan.append((members, offsets, numel, int(np.ceil(numel / pad_to)) * pad_to))
    return plan


def test_plan_closes_on_size_and_kind_and_pads():
    slots = [TensorSlot(15, 4, F32), TensorSlot(7, 4, F32), TensorSlot(4, 2, F16), TensorSlot(24, 4, F32)]
    slots.append(TensorSlot(1, 4, F32))
    # 60 + 28 bytes fit in 100; the float16 tensor closes; 96 + 4 bytes fill the last bucket exactly.
    assert plan_buckets(slots, bucket_bytes=100, pad_to=4) == [
        PlannedBucket((0, 1), (0, 15), 22, 24),
        PlannedBucket((2,), (0,), 4, 4),
        PlannedBucket((3, 4), (0, 24), 25, 28),
    ]
    # A tensor larger than bucket_bytes gets a bucket of its own.
    assert [b.members for b in plan_buckets(slots, bucket_bytes=8)] == [(0,), (1,), (2,), (3,), (4,)]
    assert [b.members for b in plan_buckets(slots)] == [(0, 1), (2,), (3, 4)]


@pytest.mark.parametrize("seed", range(20))
def test_plan_matches_the_rule_on_random_tensors(seed):
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 40))
    numels = [int(n) for n in rng.integers(1, 300, count)]
    kinds = [str(k) for k in rng.choice(["f32", "f16", "f64"], count, p=[0.7, 0.2, 0.1])]
    itemsizes = [{"f32": 4, "f16": 2, "f64": 8}[k] for k in kinds]
    bucket_bytes = int(rng.integers(1, 3000))
    pad_to = int(rng.integers(1, 9))
    plan = plan_buckets([TensorSlot(*t) for t in zip(numels, itemsizes, kinds)], bucket_bytes, pad_to)
    expected = reference_plan(numels, itemsizes, kinds, bucket_bytes, pad_to)
    assert [(list(b.members), list(b.offsets), b.numel, b.size) for b in plan] == expected
    assert all(b.size % pad_to == 0 and b.size - b.numel < pad_to for b in plan)


def test_padded_size_and_bad_arguments():
    assert [padded_size(n, 4) for n in (0, 1, 4, 5)] == [0, 4, 4, 8]
    for bucket_bytes, pad_to in ((0, 1), (10, 0), (True, 1), (10.0, 1), (10, None)):
        with pytest.raises(ValueError, match="bucket_bytes must be a positive int|pad_to must be an int >= 1"):
            plan_buckets([TensorSlot(1, 4, F32)], bucket_bytes, pad_to)
    assert plan_buckets([], 10) == []


def test_torch_and_jax_make_the_same_buckets():
    """Torch takes parameters in reverse registration order and JAX leaves in tree order, so a
    model registered a, b, c, ... and the list [..., c, b, a] must be bucketed identically."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("jax")
    from bagua_jax.bucketing import plan_buckets as plan_jax
    from bagua_torch.bucketing import make_buckets

    shapes = [(3, 5), (7,), (2, 2), (4, 3, 2), (), (40,), (9, 9), (1,)]
    dtypes = [np.float32, np.float32, np.float16, np.float32, np.float32, np.float64, np.float32, np.float16]
    named = [
        (f"p{i}", torch.nn.Parameter(torch.zeros(shape, dtype=getattr(torch, np.dtype(dtype).name))))
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes))
    ]
    leaves = [np.zeros(shape, dtype) for shape, dtype in reversed(list(zip(shapes, dtypes)))]
    last = len(shapes) - 1
    for bucket_bytes, pad_to in ((100, 1), (100, 3), (1, 2), (1 << 20, 4)):
        torch_buckets = [
            ([int(name[1:]) for name in b.names], b.size) for b in make_buckets(named, bucket_bytes, pad_to)
        ]
        jax_buckets = [([last - i for i in b.leaves], b.size) for b in plan_jax(leaves, bucket_bytes, pad_to).buckets]
        assert torch_buckets == jax_buckets
        assert len(torch_buckets) > (1 if bucket_bytes < 1 << 20 else 0)

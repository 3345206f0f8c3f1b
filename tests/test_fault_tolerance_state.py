"""The fault-tolerance core's data position (exact re-partition) and replica check (named mismatches)."""

from __future__ import annotations

import numpy as np
import pytest

from bagua_common.fault_tolerance import DataPosition, ReplicaDigest, ReplicaMismatch, check_digests


def test_every_sample_is_trained_once_per_epoch_across_changes_of_members():
    data = DataPosition(50, batch_per_rank=3, seed=7)
    seen, worlds = [], [4, 4, 3, 3, 3, 5, 2, 2, 2, 2, 2, 2, 2, 2]
    epoch_order = data.order()
    for world in worlds:
        if data.epoch:
            break
        parts = [data.indices(r, world) for r in range(world)]
        assert max(map(len, parts)) - min(map(len, parts)) <= 1
        seen += [int(i) for part in parts for i in part]
        data.advance(world)
    # in the order of the epoch's permutation, each sample once, none skipped
    assert seen == epoch_order.tolist()
    assert data.epoch == 1 and data.offset == 0
    assert not np.array_equal(data.order(), epoch_order)  # the next epoch is another permutation


def test_an_abandoned_step_leaves_the_position_for_the_survivors():
    data = DataPosition(40, batch_per_rank=4, seed=1)
    data.advance(4)
    before = data.step_samples(4)  # the step 4 ranks were training when one died
    after = np.concatenate([data.indices(r, 3) for r in range(3)])
    np.testing.assert_array_equal(after, data.order()[16:28])  # the survivors take it from the same place
    np.testing.assert_array_equal(before[:12], after)
    restored = DataPosition(40, batch_per_rank=4, seed=1)
    restored.load_state(data.state())
    np.testing.assert_array_equal(restored.indices(1, 3), data.indices(1, 3))
    with pytest.raises(ValueError, match="no sample"):
        restored.load_state([0, 40])


def test_a_restart_takes_up_the_recorded_position_with_another_batch_and_refuses_other_data():
    data = DataPosition(40, batch_per_rank=4, seed=1)
    for world_size in (3, 3, 2):
        data.advance(world_size)
    restarted = DataPosition(40, batch_per_rank=5, seed=1)  # the position counts samples, not steps
    restarted.resume(data.record())
    assert restarted.state() == data.state() == [0, 32]
    seen = set(data.order()[:32])
    assert not seen & set(restarted.step_samples(2)) and len(seen | set(restarted.step_samples(2))) == 40
    for other in (DataPosition(41, batch_per_rank=4, seed=1), DataPosition(40, batch_per_rank=4, seed=2)):
        with pytest.raises(ValueError, match="restart with the data the checkpoint was trained on"):
            other.resume(data.record())


def test_replica_check_names_the_part_and_the_ranks_that_differ():
    parts = ("parameters", "optimizer")
    rows = []
    for rank in range(4):
        digest = ReplicaDigest(parts)
        weights = np.arange(6, dtype=np.float32)
        if rank == 2:
            weights[3] = np.nextafter(weights[3], np.float32(9))  # one bit off
        digest.add("parameters", weights)
        digest.add("optimizer", np.zeros(3, np.float32))
        rows.append(digest.digest())
    check_digests(parts, np.stack([rows[0], rows[1], rows[3]]))
    with pytest.raises(ReplicaMismatch, match=r"parameters differs on rank 2(?!,)") as caught:
        check_digests(parts, np.stack(rows), "after the change to epoch 3")
    assert "optimizer" not in str(caught.value) and "epoch 3" in str(caught.value)


def test_the_digest_sees_shape_and_dtype_not_only_bytes():
    one, two = ReplicaDigest(["p"]), ReplicaDigest(["p"])
    one.add("p", np.zeros((2, 3), np.float32))
    two.add("p", np.zeros((3, 2), np.float32))
    assert not np.array_equal(one.digest(), two.digest())

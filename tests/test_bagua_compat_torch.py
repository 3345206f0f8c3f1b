"""Bagua's API points (``bagua_torch.torch_api``), each against plain torch.distributed or torch on the same data.

One 2-rank job runs every check (tests/bagua_compat_workers_torch.py); each test here reads its
part. A single process checks the import-time patch and QAdam's weight decay against torch's Adam.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from multiprocess import run_ranks

NPROCS = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, seed):
    directory = str(tmp_path_factory.mktemp("bagua-checkpoints"))
    results = run_ranks("bagua_compat_workers_torch:every_api_point", NPROCS, seed, directory, timeout=300)
    return sorted((r.value for r in results), key=lambda v: v["rank"])


def _pairs(ranks, prefix):
    found = [(rank["rank"], key, rank[key]) for rank in ranks for key in rank if key.startswith(prefix)]
    assert found, f"no results named {prefix!r}"
    return found


def _assert_pairs(ranks, prefix, exact=True):
    for rank, key, (got, expected) in _pairs(ranks, prefix):
        if isinstance(expected, np.ndarray):
            assert got.shape == expected.shape, (rank, key)
            if exact:
                np.testing.assert_array_equal(got, expected, err_msg=f"rank {rank}: {key}")
            else:
                np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7, err_msg=f"rank {rank}: {key}")
        else:
            assert got == expected, (rank, key, got, expected)


def test_env_getters_match_torch_distributed(ranks):
    _assert_pairs(ranks, "env")


@pytest.mark.parametrize("op", ["SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"])
def test_allreduce_every_reduce_op_into_recv_and_in_place(ranks, op):
    _assert_pairs(ranks, f"allreduce {op}", exact=op not in ("SUM", "PRODUCT", "AVG"))
    if op != "AVG":
        _assert_pairs(ranks, f"allreduce_inplace {op}", exact=op not in ("SUM", "PRODUCT"))
    # Bagua's integer value of each reduction is the reduction (``_pairs`` would find the name's result alone).
    assert len(_pairs(ranks, f"allreduce {op} by Bagua's value")) == len(ranks)


def test_an_unknown_reduction_value_is_refused(ranks):
    _assert_pairs(ranks, "unknown reduction refused")


@pytest.mark.parametrize(
    "primitive",
    [
        "broadcast",
        "reduce to",
        "reduce_inplace to",
        "allgather",
        "allgather_inplace",
        "gather",
        "gather_inplace",
        "scatter",
        "scatter_inplace",
        "reduce_scatter",
        "reduce_scatter_inplace",
        "alltoall",
        "alltoall_inplace",
        "alltoall_v",
        "alltoall_v_inplace",
        "send/recv",
    ],
)
def test_collective_matches_torch_distributed(ranks, primitive):
    _assert_pairs(ranks, primitive, exact=not primitive.startswith("reduce_scatter"))


def test_collectives_refuse_a_tensor_that_does_not_split_into_one_part_per_rank(ranks):
    _assert_pairs(ranks, "uneven parts refused")


def test_groups_from_ranks_and_from_torch_groups(ranks):
    _assert_pairs(ranks, "new_group")
    _assert_pairs(ranks, "from_torch_group")
    _assert_pairs(ranks, "group ranks")


@pytest.mark.parametrize("spelling", ["bagua", "own", "ddp"])
@pytest.mark.parametrize("optimizer", ["SGD", "Adam", "Rprop"])
def test_wrapping_broadcasts_parameters_and_optimizer_state_from_rank_0(ranks, optimizer, spelling):
    """Bagua's ``model.with_bagua``, and the project's ``with_bagua`` and ``DistributedDataParallel`` alike."""
    key = f"{optimizer} {spelling}"
    rank0_before = ranks[0][f"optimizer state {key}"][1]
    for rank in ranks:
        after, before = rank[f"optimizer state {key}"]
        np.testing.assert_array_equal(after, rank0_before, err_msg=f"rank {rank['rank']}")
        np.testing.assert_array_equal(rank[f"model state {key}"], ranks[0][f"model state {key}"])
    # The ranks trained apart before wrapping: the broadcast had something to do.
    assert not np.array_equal(ranks[1][f"optimizer state {key}"][1], rank0_before)


def test_switching_algorithms_leaves_only_the_last_one_acting(ranks):
    _assert_pairs(ranks, "switch:", exact=True)


@pytest.mark.parametrize("compression", ["None", "MinMaxUInt8"])
def test_custom_algorithm_written_as_in_baguas_tutorial(ranks, compression):
    for rank, key, (got, expected) in _pairs(ranks, f"custom algorithm {compression}"):
        if key.endswith("step hook"):
            assert got == expected
        elif compression == "None":
            np.testing.assert_array_equal(got, expected)
        else:  # 8-bit codes: within two quantization steps of the gradients' range
            bound = 2 * (expected.max() - expected.min()) / 255
            assert np.abs(got - expected).max() <= bound, (rank, np.abs(got - expected).max(), bound)
            assert not np.array_equal(got, expected)


def test_custom_algorithm_in_the_projects_interface_as_class_and_instance(ranks):
    _assert_pairs(ranks, "own-interface algorithm")


@pytest.mark.parametrize("interval", [1, 2])
def test_low_precision_decentralized_with_baguas_codec_matches_baguas_reference(ranks, interval):
    """Bagua's test_compare, with its tolerance: the weights after 10 steps, every rank."""
    for rank, key, (got, expected) in _pairs(ranks, f"low precision decentralized, Bagua's codec, interval {interval}"):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=f"rank {rank}")


def test_fused_optimizer_keeps_a_weight_algorithm_running(ranks):
    _assert_pairs(ranks, "fused optimizer")


def test_data_parallel_and_checkpoints(ranks):
    _assert_pairs(ranks, "data_parallel")
    _assert_pairs(ranks, "checkpoint")
    _assert_pairs(ranks, "model face")


def test_only_importing_the_compat_layer_patches_torch():
    probe = (
        "import torch, bagua_torch, bagua_torch.algorithms, bagua_torch.bagua_module\n"
        "assert not hasattr(torch.nn.Module, 'with_bagua'), 'bagua_torch patched torch'\n"
        "import bagua_torch.torch_api\n"
        "assert torch.nn.Module.with_bagua is bagua_torch.torch_api.distributed.with_bagua\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr


def test_baguas_utils_flatten_and_helpers(rng):
    from bagua_torch.torch_api import utils

    tensors = [torch.from_numpy(rng.standard_normal(shape).astype(np.float32)) for shape in [(3, 4), (5,), (2, 1, 2)]]
    flat = utils.flatten(tensors)
    np.testing.assert_array_equal(flat.numpy(), np.concatenate([t.numpy().ravel() for t in tensors]))
    views = utils.unflatten(flat, tensors)
    assert [v.shape for v in views] == [t.shape for t in tensors]
    assert all(torch.equal(v, t) for v, t in zip(views, tensors)) and utils.check_contiguous(views)
    assert not utils.check_contiguous([tensors[1], tensors[0]])
    expected = [t * 3 for t in tensors]
    utils.apply_flattened_call(tensors, lambda x, k: x.mul_(k), [3.0])
    assert all(torch.equal(t, e) for t, e in zip(tensors, expected))
    assert utils.get_flattened_tensor([]) is None and torch.equal(utils.get_flattened_tensor(tensors), flat * 3)
    assert utils.to_bagua_datatype(torch.float16) == "f16"
    with pytest.raises(ValueError, match="unsupported data type"):
        utils.to_bagua_datatype(torch.float64)


def test_baguas_average_by_removing_extreme_values(rng):
    from bagua_torch.torch_api.utils import average_by_removing_extreme_values

    scores = np.concatenate([rng.uniform(50, 60, 10), rng.uniform(9, 11, 30), [100.0, -80.0]])
    mean, std, kept = average_by_removing_extreme_values(scores.tolist())
    rest = scores[len(scores) // 3 :]
    reference = rest[np.abs(rest - rest.mean()) < rest.std()]  # one pass suffices: its std is below its mean
    assert reference.std() < reference.mean()
    assert (
        kept == reference.tolist() and mean == pytest.approx(reference.mean()) and std == pytest.approx(reference.std())
    )


def test_baguas_statistical_average_matches_baguas_own_test():
    """The values of Bagua's test_statistical_average: records over 1, 2, 4 s and a tail, then 6.0 a second later."""
    import time

    from bagua_torch.torch_api.utils import StatisticalAverage

    tail = (2.0166309999999985, 2.499061185570463)
    m = StatisticalAverage(
        last_update_time=time.time() - 1.0, records=[5.0, 4.5005175, 3.5034241850204078], record_tail=tail
    )
    m.record(6.0)
    for seconds, expected in [
        (1.0, 6.0),
        (2.0, (6.0 + 5.0) / 2.0),
        (3.0, (6.0 + 4.5005175 * 2.0) / 3.0),
        (5.0, (6.0 + 3.5034241850204078 * 4.0) / 5.0),
        (7.0, (6.0 + 2.499061185570463 * (4.0 + tail[0])) / 7.0),
    ]:
        assert m.get_records_mean(seconds) == pytest.approx(expected, abs=0.1), seconds
    assert m.total_recording_time() == pytest.approx(4.0 + tail[0] + 1, abs=0.1)


def test_qadam_algorithm_takes_the_tutorials_hierarchical_reduce():
    from bagua_torch.torch_api.algorithms.q_adam import QAdamAlgorithm, QAdamOptimizer

    optimizer = QAdamOptimizer(torch.nn.Linear(2, 2).parameters())
    assert QAdamAlgorithm(optimizer, hierarchical_reduce=False).config.hierarchical is False
    assert QAdamAlgorithm(optimizer).config.hierarchical is True
    with pytest.raises(ValueError, match="disagree"):
        QAdamAlgorithm(optimizer, False, hierarchical_reduce=True)

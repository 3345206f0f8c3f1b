"""Bagua's API points (``bagua_torch.torch_api``), each against plain torch.distributed or torch on the same data.

One 2-rank job runs every check (tests/bagua_compat_workers_torch.py); each test here reads its
part. A single process checks the import-time patch and QAdam's weight decay against torch's Adam.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from multiprocess import run_ranks

NPROCS = 2


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("bagua-checkpoints"))
    results = run_ranks("bagua_compat_workers_torch:every_api_point", NPROCS, directory, timeout=150)
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


@pytest.mark.parametrize("optimizer", ["SGD", "Adam", "Rprop"])
def test_wrapping_broadcasts_parameters_and_optimizer_state_from_rank_0(ranks, optimizer):
    rank0_before = ranks[0][f"optimizer state {optimizer}"][1]
    for rank in ranks:
        after, before = rank[f"optimizer state {optimizer}"]
        np.testing.assert_array_equal(after, rank0_before, err_msg=f"rank {rank['rank']}")
        np.testing.assert_array_equal(rank[f"model state {optimizer}"], ranks[0][f"model state {optimizer}"])
    # The ranks trained apart before wrapping: the broadcast had something to do.
    assert not np.array_equal(ranks[1][f"optimizer state {optimizer}"][1], rank0_before)


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
        "import torch, bagua_torch, bagua_torch.algorithms, bagua_torch.distributed\n"
        "assert not hasattr(torch.nn.Module, 'with_bagua'), 'bagua_torch patched torch'\n"
        "import bagua_torch.torch_api\n"
        "assert torch.nn.Module.with_bagua is bagua_torch.torch_api.distributed.with_bagua\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr

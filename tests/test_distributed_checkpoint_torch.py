"""bagua_torch.distributed_checkpoint: the wrapped model's state through torch.distributed.checkpoint.

One 2-rank gloo job per test run: for ByteGrad with error feedback, decentralized, DiLoCo (saved mid-round)
and gradient allreduce with plain SGD (no optimizer or algorithm state at all), a run resumed from a DCP
checkpoint continues bit for bit; DCP's own API (``dcp.load`` into plain tensors, no project code, one
process) reads every rank's parameters back as saved; damaged copies (a truncated, emptied or foreign shard,
truncated DCP metadata, no manifest) are refused naming the file and the damage; one rank restoring the
2-rank checkpoints, and two ranks restoring a one-rank checkpoint, follow each algorithm's reshard rule.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from algorithms_reference import assert_tree_equal
from distributed_checkpoint_workers_torch import ALGORITHMS
from multiprocess import run_ranks


@pytest.fixture(scope="module")
def job(tmp_path_factory, seed):
    root = tmp_path_factory.mktemp("dcp")
    return root, run_ranks("distributed_checkpoint_workers_torch:save_resume_damage", 2, seed, str(root), timeout=300)


@pytest.mark.parametrize("name", ALGORITHMS)
def test_resume_is_bit_for_bit(job, name):
    _, ranks = job
    for rank in ranks:
        result = rank.value[name]
        assert result["step"] == 4
        assert_tree_equal(result["resumed"], result["want"], f"{name} rank {rank.rank}")
    if name in ("decentralized", "diloco"):  # the ranks' parameters drift apart inside a round
        a, b = (r.value[name]["saved"]["params"] for r in ranks)
        assert any(not np.array_equal(a[k], b[k]) for k in a), name


@pytest.mark.parametrize("name", ALGORITHMS)
def test_dcp_reads_every_ranks_parameters(job, name):
    root, ranks = job
    for rank in ranks:
        saved = rank.value[name]["saved"]["params"]
        model = {f"module.{k}": torch.empty(v.shape) for k, v in saved.items()}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"bagua": {f"rank_{rank.rank}": {"model": model}}}, checkpoint_id=root / name / "step_000000004")
        for key, want in saved.items():
            np.testing.assert_array_equal(model[f"module.{key}"].numpy(), want, err_msg=key)


def test_damaged_checkpoints_are_refused_naming_the_file(job):
    _, ranks = job
    for rank in ranks:
        for what, (path, message) in rank.value["errors"].items():
            damage = {"metadata truncated": "truncated"}.get(what, what)
            assert path in message and damage in message, (what, message)


@pytest.fixture(scope="module")
def alone(job, seed):
    """One rank's job: the 2-rank checkpoints restored, then a step trained and saved (for the 2-rank restore)."""
    root, _ = job
    (result,) = run_ranks("distributed_checkpoint_workers_torch:restore_alone", 1, seed, str(root), timeout=300)
    return result


def test_restore_into_one_rank_follows_the_rule(job, alone):
    root, ranks = job
    for name in ALGORITHMS:
        saved = [r.value[name]["saved"] for r in ranks]
        got = alone.value[name]
        assert got["step"] == 4
        for key in saved[0]["params"]:
            rows = [s["params"][key] for s in saved]
            # ByteGrad's replicas are identical (rank 0's carries); the others drift and start from the mean.
            want = rows[0] if name == "bytegrad" else (np.stack(rows).astype(np.float64).sum(0) / 2).astype(np.float32)
            np.testing.assert_array_equal(got["params"][key], want, err_msg=f"{name} {key}")
        if name == "bytegrad":
            assert any(np.any(r) for s in saved for r in s["algorithm"]["residuals"]), "nothing to reset"
            assert not any(np.any(r) for r in got["algorithm"]["residuals"]), "residuals not reset"


def test_restore_into_two_ranks_follows_the_rule(job, alone, seed):
    """1 -> 2: every rule gives each new rank the one old row (carried, or its mean, itself), the step kept, and
    error-feedback residuals restart at zero."""
    root, _ = job
    ranks = run_ranks("distributed_checkpoint_workers_torch:restore_two", 2, seed, str(root), timeout=300)
    for name in ALGORITHMS:
        saved = alone.value[name]["saved"]
        for rank in ranks:
            got = rank.value[name]
            assert got["step"] == 5
            assert_tree_equal(got["params"], saved["params"], f"{name} rank {rank.rank} params")
            assert_tree_equal(got["optimizer"], saved["optimizer"], f"{name} rank {rank.rank} optimizer")
            if name == "bytegrad":
                assert any(np.any(r) for r in saved["algorithm"]["residuals"]), "nothing to reset"
                assert not any(np.any(r) for r in got["algorithm"]["residuals"]), "residuals not reset"

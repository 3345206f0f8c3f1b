"""Bagua's DDP communication hooks (bagua_torch.ddp_hooks) on torch's DistributedDataParallel and HF Accelerate.

One job of 2 ranks (ddp_hooks_workers_torch.py; over gloo, and under mpiexec where the hooks communicate
through the native MPI engine) trains the same MLP, on the same data, with each
gradient algorithm through DDP's hook and through the project's wrapper ``with_bagua``. Both lay the
model out as one bucket (DDP's default 25 MiB cap and the wrapper's default bucket size hold the whole
MLP; the hook reorders DDP's bucket into the wrapper's reverse registration order and pads it alike),
so every algorithm, ByteGrad's 8-bit codes and PowerSGD's factors included, must give the same bits.
A checkpoint of the hook's state resumes identically, and resuming without it does not (where there is
state). Accelerate's prepared model with the hook matches the wrapper.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from algorithms_reference import max_diff
from ddp_hooks_workers_torch import ALGORITHMS
from multiprocess import run_ranks
from scenarios import has_mpi

import bagua_torch
import bagua_torch.ddp_hooks as ddp_hooks

STATEFUL = ("bytegrad/error_feedback", "powersgd")


@pytest.fixture(scope="module", params=["python", "mpiexec"])
def job(request, seed) -> list[dict]:
    """The job over gloo, and under mpiexec with the native MPI engine as the hooks' communicator."""
    if request.param == "mpiexec" and not has_mpi(bagua_torch.ops.build_info()):
        pytest.skip("no MPI engine or mpiexec here")
    seed = int(np.random.default_rng([seed, zlib.crc32(request.param.encode())]).integers(2**31))
    target = "ddp_hooks_workers_torch:hooks_match_the_wrapper"
    values = [r.value for r in run_ranks(target, 2, seed, launcher=request.param, timeout=300)]
    for out in values:
        assert out["communicator"] == (
            "NativeCommunicator" if request.param == "mpiexec" else "ProcessGroupCommunicator"
        )
    return values


def _assert_equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=f"{what}: {key}")


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_hook_trains_the_same_bits_as_the_wrapper(job, name):
    for out in job:
        assert out[f"{name}/buckets"] == 1
        _assert_equal(out[f"{name}/hook"], out[f"{name}/wrapper"], f"{name}: DDP hook vs with_bagua")
        assert max_diff(out[f"{name}/hook"], out["initial"]) > 0  # it trained
    _assert_equal(job[0][f"{name}/hook"], job[1][f"{name}/hook"], f"{name}: rank 0 vs rank 1")


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_hook_state_checkpoint_resumes_identically(job, name):
    for out in job:
        _assert_equal(out[f"{name}/resumed"], out[f"{name}/continued"], f"{name}: resumed from the checkpoint")
        if name in STATEFUL:
            assert max_diff(out[f"{name}/resumed_without_state"], out[f"{name}/continued"]) > 0


def test_accelerate_prepared_model_with_the_hook_matches_the_wrapper(job):
    for out in job:
        _assert_equal(out["accelerate"], out["bytegrad/error_feedback/wrapper"], "accelerate + bytegrad_hook")


def test_hook_state_errors():
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="does not transform gradients"):
        ddp_hooks.CommHookState("decentralized", model, process_group=object())
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ddp_hooks.CommHookState("bytegrad", "model")

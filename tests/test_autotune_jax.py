"""Bucket-size autotuning in the JAX trainer: exact for full precision, refused for compressed algorithms."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from tuning_clock import cost_tuning_steps

from bagua_common.tuning.autotune import setting_label
from bagua_jax.algorithms import ByteGrad, GradientAllReduce
from bagua_jax.trainer import DataParallel

ROOT = Path(__file__).resolve().parent.parent
MESH = Mesh(np.array(jax.devices()[:4]), ("ranks",))


def loss_fn(params, batch):
    hidden = np.float32(0.1) * (batch["x"] @ params["w1"] + params["b1"])
    return ((hidden @ params["w2"] - batch["y"]) ** 2).mean()


def model(rng):
    return {
        "w1": rng.standard_normal((16, 300)).astype(np.float32),
        "b1": rng.standard_normal(300).astype(np.float32),
        "w2": rng.standard_normal((300, 3)).astype(np.float32),
    }


def batches(rng, steps):
    return [
        {"x": rng.standard_normal((32, 16)).astype(np.float32), "y": rng.standard_normal((32, 3)).astype(np.float32)}
        for _ in range(steps)
    ]


def trainer(bucket_bytes, **kwargs):
    return DataParallel(loss_fn, optax.adam(1e-2), GradientAllReduce(bucket_bytes=bucket_bytes), mesh=MESH, **kwargs)


def test_switching_bucket_size_mid_run_gives_bit_identical_parameters(rng):
    params, data = model(rng), batches(rng, 8)
    small, large = trainer(1024), trainer(2**24)  # 20 buckets against one
    reference = small.init(params)
    for batch in data:
        reference, _ = small.step(reference, batch)
    switched = small.init(params)
    for i, batch in enumerate(data):
        switched, _ = (small if i < 4 else large).step(switched, batch)
    for a, b in zip(jax.tree.leaves(reference.params), jax.tree.leaves(switched.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tuning_picks_a_candidate_stores_it_and_a_cached_run_reuses_it(rng, tmp_path, monkeypatch):
    monkeypatch.setenv("BAGUA_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    params = model(rng)
    tuned = trainer(2**20, autotune="once")
    state = tuned.init(params)
    tuned.step(state, batches(rng, 1)[0])
    tuning = tuned.bucket_tuning
    assert tuning is not None and not tuning.from_cache
    assert setting_label(tuning.setting) in tuning.medians_s and tuning.compile_s > 0
    assert all("hierarchical" not in label and "mpi_ring" not in label for label in tuning.medians_s)  # no effect here
    cached = trainer(2**20, autotune="cached")
    cached.init(params)
    assert cached.bucket_tuning.from_cache and cached.bucket_tuning.bucket_bytes == tuning.bucket_bytes


def test_a_two_level_mesh_searches_hierarchical_and_trains_with_the_choice(rng, tmp_path, monkeypatch):
    """Each candidate's step costs a fixed time on a fake clock (tuning_clock.py), hierarchical half of flat: both
    values are timed whatever the machine's load, and the faster, not the default, wins and trains."""
    monkeypatch.setenv("BAGUA_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    cost = {False: 2.0**-9, True: 2.0**-10}
    cost_tuning_steps(lambda candidate: cost[candidate.hierarchical], monkeypatch.setattr)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("inter", "intra"))
    tuned = DataParallel(loss_fn, optax.adam(1e-2), GradientAllReduce(bucket_bytes=2**20), mesh=mesh, autotune="once")
    assert not tuned.algorithm.hierarchical  # the default: the search must move away from it
    tuned.init(model(rng))
    tuning = tuned.bucket_tuning
    medians = {label.split("hierarchical=")[1]: s for label, s in tuning.medians_s.items()}
    assert medians == {"False": cost[False], "True": cost[True]}, tuning.medians_s
    assert not any("mpi_ring" in label for label in tuning.medians_s)
    assert tuning.setting["hierarchical"] is True and tuned.algorithm.hierarchical
    assert tuned.algorithm.bucket_bytes == tuning.bucket_bytes


def test_autotune_is_off_by_default_and_refused_for_compressed_algorithms(rng, monkeypatch):
    monkeypatch.delenv("BAGUA_AUTOTUNE", raising=False)
    plain = trainer(2**20)
    plain.init(model(rng))
    assert plain.bucket_tuning is None
    compressed = DataParallel(loss_fn, optax.sgd(0.1), ByteGrad(), mesh=MESH, autotune="once")
    with pytest.raises(ValueError, match="bytegrad's numbers depend on its bucket layout"):
        compressed.init(model(rng))


def test_every_rank_of_a_native_job_between_nodes_chooses_the_same_setting(tmp_path, seed):
    """MPICH's MPIR_CVAR_NOLOCAL=1 makes each process its own node, so the ring threshold has an effect and is
    searched; the winner is left set on the communicator, the same on every rank. Each setting's step costs a fixed
    time on a fake clock (tuning_clock.py), the always-ring threshold's the least, so the search does not depend on
    the machine's load."""
    run = subprocess.run(
        [sys.executable, "-m", "bagua_launch", "--nproc-per-node", "2", "--mpi", "tests/autotune_workers_jax.py"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={
            **os.environ,
            "BAGUA_TEST_SEED": str(seed),
            "BAGUA_AUTOTUNE_CACHE": str(tmp_path / "autotune.json"),
            "MPIR_CVAR_NOLOCAL": "1",
        },
    )
    assert run.returncode == 0, run.stdout + run.stderr
    chosen = re.findall(r"\[rank (\d)\] chosen (\{.*\}) ring (\d+)", run.stdout)
    assert sorted(r for r, _, _ in chosen) == ["0", "1"] and chosen[0][1:] == chosen[1][1:], run.stdout
    setting = json.loads(chosen[0][1])
    assert setting["mpi_ring_min_bytes"] == int(chosen[0][2]) == 0  # the cheapest (autotune_workers_jax.py)
    searched = json.loads(re.search(r"\[rank 0\] searched (.*)", run.stdout).group(1))
    rings = {label.split("mpi_ring_min_bytes=")[1] for label in searched}
    assert rings == {str(2**20), "0", str(2**62)}, searched  # as is, always the ring, never
    # The tuning probe bypasses the same-batch guard (its batch is no user's data); the user's first step is checked.
    assert re.findall(r"\[rank \d\] guarded in init (\d+)", run.stdout) == ["0", "0"], run.stdout
    assert re.findall(r"\[rank \d\] guarded in the first step (\d+)", run.stdout) == ["1", "1"], run.stdout

"""Bucket-size autotuning in the JAX trainer: exact for full precision, refused for compressed algorithms."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

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
    assert tuning.bucket_bytes in tuning.medians_s and tuning.compile_s > 0
    cached = trainer(2**20, autotune="cached")
    cached.init(params)
    assert cached.bucket_tuning.from_cache and cached.bucket_tuning.bucket_bytes == tuning.bucket_bytes


def test_autotune_is_off_by_default_and_refused_for_compressed_algorithms(rng, monkeypatch):
    monkeypatch.delenv("BAGUA_AUTOTUNE", raising=False)
    plain = trainer(2**20)
    plain.init(model(rng))
    assert plain.bucket_tuning is None
    compressed = DataParallel(loss_fn, optax.sgd(0.1), ByteGrad(), mesh=MESH, autotune="once")
    with pytest.raises(ValueError, match="bytegrad's numbers depend on its bucket layout"):
        compressed.init(model(rng))


def test_every_rank_of_a_native_job_chooses_the_same_bucket_size(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "bagua_launch", "--nproc-per-node", "2", "--mpi", "tests/autotune_workers_jax.py"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env={**__import__("os").environ, "BAGUA_AUTOTUNE_CACHE": str(tmp_path / "autotune.json")},
    )
    assert run.returncode == 0, run.stdout + run.stderr
    chosen = re.findall(r"\[rank (\d)\] chosen (\d+)", run.stdout)
    assert sorted(r for r, _ in chosen) == ["0", "1"] and chosen[0][1] == chosen[1][1], run.stdout

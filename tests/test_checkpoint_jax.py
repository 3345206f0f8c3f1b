"""bagua_jax.checkpoint: atomic save, exact restore, and restore into another world size per algorithm.

One process, four simulated CPU devices; a mesh of the first 2 or all 4 stands for a job of that
many ranks. Each algorithm trains a few steps (the ranks see different data, so decentralized
parameters drift apart), is saved, and is restored with the other world size; the result is
checked leaf by leaf against a NumPy reference of the issue's rules computed from the saved
state: identical state carries over, drifted parameters start from their mean, error-feedback
residuals restart at zero, low-precision decentralized's weight copies equal the restarted
parameters, the step is kept.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from multiprocess import has_mpiexec, run_ranks

from bagua_common.job.checkpoint import MANIFEST, latest, read_manifest
from bagua_jax import DataParallel
from bagua_jax.algorithms import (
    AsyncModelAverage,
    ByteGrad,
    Decentralized,
    GradientAllReduce,
    LowPrecisionDecentralized,
    OneBitAdam,
    PowerSGD,
    QAdam,
)
from bagua_jax.checkpoint import restore, save
from bagua_jax.checkpoint import restore as restore_npz
from bagua_jax.checkpoint import save as save_npz

LR = 0.05


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)


def trainer(algorithm, optimizer, ranks: int) -> DataParallel:
    mesh = Mesh(np.array(jax.devices()[:ranks]), ("ranks",))
    return DataParallel(loss_fn, optimizer, algorithm, mesh=mesh)


def initial_params(rng):
    return {"w": rng.standard_normal((5, 3)).astype(np.float32), "b": np.zeros(3, np.float32)}


def batch(rng, size=8):
    return {
        "x": rng.standard_normal((size, 5)).astype(np.float32),
        "y": rng.standard_normal((size, 3)).astype(np.float32),
    }


def host(tree):
    return jax.tree.map(np.asarray, tree)


CASES = {
    "gradient_allreduce": (GradientAllReduce, optax.sgd(LR)),
    "bytegrad_error_feedback": (lambda: ByteGrad(error_feedback=True, hierarchical=False), optax.adam(LR)),
    "qadam": (lambda: QAdam(LR, warmup_steps=2, hierarchical=False), None),
    "onebit_adam": (lambda: OneBitAdam(LR, warmup_steps=2, hierarchical=False), None),
    "powersgd": (lambda: PowerSGD(rank=1, start_iter=1, min_compression_rate=1.0), optax.sgd(LR)),
    "decentralized": (lambda: Decentralized(hierarchical=False), optax.adam(LR)),
    "low_precision_decentralized": (lambda: LowPrecisionDecentralized(hierarchical=False), optax.sgd(LR)),
    "async": (lambda: AsyncModelAverage(warmup_steps=1), optax.adam(LR)),
}


def rows(leaf, ranks):
    """One row per rank: a per-rank leaf as it is, a shared one repeated."""
    leaf = np.asarray(leaf)
    return leaf if leaf.ndim and leaf.shape[0] == ranks else np.broadcast_to(leaf, (ranks, *leaf.shape))


def residuals(opt_state) -> dict[str, np.ndarray]:
    """The error-feedback residuals of an optimizer state, by path."""
    leaves = jax.tree_util.tree_leaves_with_path(opt_state)
    return {jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves if "residual" in jax.tree_util.keystr(p)}


@pytest.mark.parametrize("old, new", [(4, 2), (2, 4)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_restore_into_another_world_size_follows_the_rule(name, old, new, tmp_path, rng):
    make, optimizer = CASES[name]
    before = trainer(make(), optimizer, old)
    state = before.init(initial_params(rng))
    steps = 0
    # At least 3 steps, and until every residual holds something to reset: right after 1-bit Adam's warm-up the
    # ranks' momenta share their signs almost everywhere, and a server chunk of equal magnitudes compresses exactly.
    while steps < 3 or not all(np.any(leaf) for leaf in residuals(state.opt_state).values()):
        assert steps < 20, f"after {steps} steps a residual is still zero: {residuals(state.opt_state)}"
        state, _ = before.step(state, batch(rng))
        steps += 1
    save(tmp_path, state, before)
    saved = host(state)
    per_rank_params = np.asarray(saved.params["w"]).ndim == 3

    after = trainer(make(), optimizer, new)
    restored_state = restore(tmp_path, after, initial_params(rng))
    restored = host(restored_state)

    # The NumPy reference of the rules.
    if per_rank_params:
        start = {k: v.astype(np.float64).mean(0).astype(v.dtype) for k, v in saved.params.items()}
        want_params = {k: np.broadcast_to(v, (new, *v.shape)) for k, v in start.items()}
    else:
        start = want_params = saved.params
    fresh = host(after.init(start))  # a fresh start from the restarted parameters: zero residuals, weight copies
    for key in ("w", "b"):
        np.testing.assert_array_equal(restored.params[key], want_params[key], err_msg=key)
    assert int(np.asarray(restored.step).reshape(-1)[0]) == steps
    saved_leaves = dict(jax.tree_util.tree_leaves_with_path(saved.opt_state))
    fresh_leaves = dict(jax.tree_util.tree_leaves_with_path(fresh.opt_state))
    for path, got in jax.tree_util.tree_leaves_with_path(restored.opt_state):
        key = jax.tree_util.keystr(path)
        if any(word in key for word in ("residual", "weights", "left", "right")):
            want = fresh_leaves[path]  # restarted: zeros, or copies of the restarted parameters
            if "residual" in key:
                assert not np.any(want), key
        elif np.issubdtype(got.dtype, np.floating) and per_rank_params:
            old_rows = rows(saved_leaves[path], old).astype(np.float64)
            want = np.broadcast_to(old_rows.mean(0).astype(got.dtype), got.shape)
        else:
            want = np.broadcast_to(rows(saved_leaves[path], old)[0], got.shape)
        np.testing.assert_array_equal(got, want, err_msg=key)
    # The restored state trains on.
    after.step(restored_state, batch(rng))


@pytest.mark.parametrize("name", ["decentralized", "gradient_allreduce", "powersgd"])
def test_same_world_size_restores_every_rank_exactly(name, tmp_path, rng):
    # PowerSGD compresses from its second step: the restored Q and residuals must be the saved ones.
    make, optimizer = CASES[name]
    dp = trainer(make(), optimizer, 4)
    state = dp.init(initial_params(rng))
    for _ in range(3):
        state, _ = dp.step(state, batch(rng))
    save(tmp_path, state, dp)
    data = batch(rng)
    want, _ = dp.step(state, data)
    got, _ = dp.step(restore(tmp_path, dp, initial_params(rng)), data)
    for a, b in zip(jax.tree.leaves(host(want)), jax.tree.leaves(host(got))):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("new", [4, 2])
def test_a_flax_train_state_comes_back_as_one_in_any_world_size(new, tmp_path, rng):
    # Into another world size the state is rebuilt from the restarted parameters: the user's class went with it once.
    from flax.training import train_state

    dp = trainer(GradientAllReduce(), optax.sgd(LR), 4)
    user = train_state.TrainState.create(apply_fn=loss_fn, params=initial_params(rng), tx=optax.sgd(LR))
    state = dp.init(user)
    for _ in range(2):
        state, _ = dp.step(state, batch(rng))
    save(tmp_path, state, dp)
    restored = restore(tmp_path, trainer(GradientAllReduce(), optax.sgd(LR), new), user)
    assert type(restored) is train_state.TrainState and restored.apply_fn is loss_fn
    assert int(restored.step) == 2
    for a, b in zip(jax.tree.leaves(host(state.params)), jax.tree.leaves(host(restored.params)), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_manifest_records_the_metadata_saved_with_it(tmp_path, rng):
    dp = trainer(GradientAllReduce(), optax.sgd(LR), 2)
    state = dp.init(initial_params(rng))
    plain = save(tmp_path / "plain", state, dp)
    noted = save(tmp_path / "noted", state, dp, metadata={"epoch": 3, "note": ["a", 1.5]})
    assert read_manifest(plain).metadata == {}
    assert read_manifest(noted).metadata == {"epoch": 3, "note": ["a", 1.5]}


def test_half_written_checkpoint_is_never_loaded(tmp_path, rng):
    dp = trainer(GradientAllReduce(), optax.sgd(LR), 2)
    state = dp.init(initial_params(rng))
    state, _ = dp.step(state, batch(rng))
    first = save(tmp_path, state, dp)
    state, _ = dp.step(state, batch(rng))
    second = save(tmp_path, state, dp)
    assert latest(tmp_path) == second and read_manifest(second).step == 2
    (second / MANIFEST).unlink()  # as if the job died before rank 0 committed step 2
    assert latest(tmp_path) == first
    restored = restore(tmp_path, dp, initial_params(rng))
    assert int(np.asarray(restored.step)) == 1


def test_restores_that_cannot_work_fail_clearly(tmp_path, rng):
    dp = trainer(GradientAllReduce(), optax.sgd(LR), 2)
    state = dp.init(initial_params(rng))
    save(tmp_path, state, dp)
    other_model = {"w": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.float32)}
    with pytest.raises(ValueError, match=r"another model: \['w'\]"):
        restore(tmp_path, dp, other_model)
    with pytest.raises(ValueError, match="algorithm"):
        restore(tmp_path, trainer(Decentralized(), optax.sgd(LR), 2), initial_params(rng))
    with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
        restore(tmp_path / "empty", dp, initial_params(rng))


def test_hierarchical_levels_are_planned_anew(tmp_path, rng):
    """2 nodes x 2 devices -> 1 node x 2: the residuals of the two-level exchange restart at zero, the rest carries."""
    devices = np.array(jax.devices()[:4])
    two_nodes = Mesh(devices.reshape(2, 2), ("inter", "intra"))
    one_node = Mesh(devices[:2].reshape(1, 2), ("inter", "intra"))

    def make(mesh):
        return DataParallel(loss_fn, optax.adam(LR), ByteGrad(error_feedback=True, hierarchical=True), mesh=mesh)

    before = make(two_nodes)
    state = before.init(initial_params(rng))
    for _ in range(3):
        state, _ = before.step(state, batch(rng))
    save(tmp_path, state, before)
    saved = host(state)
    after = make(one_node)
    restored = host(restore(tmp_path, after, initial_params(rng)))
    for key in ("w", "b"):
        np.testing.assert_array_equal(restored.params[key], saved.params[key])
    for path, got in jax.tree_util.tree_leaves_with_path(restored.opt_state):
        key = jax.tree_util.keystr(path)
        if "residual" in key:
            assert got.shape[0] == 2 and not np.any(got), key
        else:
            want = dict(jax.tree_util.tree_leaves_with_path(saved.opt_state))[path]
            np.testing.assert_array_equal(got, np.broadcast_to(np.asarray(want)[0], got.shape), err_msg=key)


@pytest.mark.skipif(not has_mpiexec(), reason="no mpiexec")
def test_native_mode_restores_each_ranks_own_state(tmp_path, seed):
    results = run_ranks(
        "checkpoint_workers_jax:train_save_restore", 2, str(tmp_path), seed, launcher="mpiexec", timeout=300
    )
    saved = [r.value["saved"] for r in results]
    assert any(not np.array_equal(a, b) for a, b in zip(*saved)), "the ranks' states should differ"
    for result in results:
        for got, want in zip(result.value["restored"], result.value["saved"]):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("fmt", ["npz", "orbax"])
def test_a_diloco_checkpoint_older_than_its_trained_weight_restores_with_every_rank_trained(tmp_path, rng, fmt):
    """A DiLoCo checkpoint written before ``DiLoCoState.trained`` existed (the same state without that leaf)
    restores, in either format: ``trained`` is 1 on every rank, every other leaf is the saved one. A checkpoint
    missing any other leaf still names it."""
    from collections import namedtuple

    from bagua_jax.algorithms import DiLoCo
    from bagua_jax.algorithms.diloco import DiLoCoState
    from bagua_jax.orbax_checkpoint import OrbaxCheckpoints

    def save(folder, state, trainer):
        if fmt == "npz":
            return save_npz(folder, state, trainer)
        with contextlib.closing(OrbaxCheckpoints(folder, trainer)) as checkpoints:
            checkpoints.save(state)

    def restore(folder, trainer, params):
        if fmt == "npz":
            return restore_npz(folder, trainer, params)
        with contextlib.closing(OrbaxCheckpoints(folder, trainer)) as checkpoints:
            return checkpoints.restore(params)

    def as_old(state, fields):
        """``state`` with its DiLoCo state laid out with ``fields`` only."""
        layout = namedtuple("DiLoCoState", fields)  # noqa: PYI024 - a layout of a release before

        def older(node):
            return layout(*(getattr(node, f) for f in fields)) if isinstance(node, DiLoCoState) else node

        is_diloco = lambda node: isinstance(node, DiLoCoState)  # noqa: E731
        return state._replace(opt_state=jax.tree.map(older, state.opt_state, is_leaf=is_diloco))

    old_fields = [f for f in DiLoCoState._fields if f != "trained"]
    before = trainer(DiLoCo(sync_every=2), optax.sgd(LR), 2)
    params = initial_params(rng)
    state = before.init(params)
    for _ in range(3):
        state, _ = before.step(state, batch(rng))
    save(tmp_path / "old", as_old(state, old_fields), before)
    restored = restore(tmp_path / "old", trainer(DiLoCo(sync_every=2), optax.sgd(LR), 2), params)
    np.testing.assert_array_equal(np.asarray(restored.opt_state[1].trained), np.ones(2, np.float32))
    for field in old_fields:
        saved, got = (host(getattr(s.opt_state[1], field)) for s in (state, restored))
        jax.tree.map(np.testing.assert_array_equal, got, saved)
    jax.tree.map(np.testing.assert_array_equal, host(restored.params), host(state.params))
    save(tmp_path / "damaged", as_old(state, [f for f in old_fields if f != "round_start"]), before)
    with pytest.raises(ValueError, match=r"has no \.opt_state\[1\]\.round_start"):
        restore(tmp_path / "damaged", trainer(DiLoCo(sync_every=2), optax.sgd(LR), 2), params)

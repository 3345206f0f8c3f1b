"""The JAX cells of the composition matrix that this file asserts, parametrized from tests/composition_matrix.py.

Four simulated devices and a small MLP. Algorithms without a hierarchical variant train on a 2x2
mesh as on the flat one. With bf16 parameters, a few steps of every algorithm whose
mixed-precision cell cites this file: the parameters stay bf16, finite, and move; where the
algorithm promises identical replicas the trainer returns one copy, and DiLoCo's per-rank copies
meet after each outer step, within two bf16 roundings.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from composition_matrix import MATRIX
from jax.sharding import Mesh
from tuning_clock import cost_tuning_steps

from bagua_common.algorithms.registry import algorithm_facts
from bagua_jax import DataParallel
from bagua_jax.algorithms import AsyncModelAverage, DiLoCo, OneBitAdam, PowerSGD, QAdam, make_algorithm

THIS = "tests/test_composition_matrix_jax.py"
STEPS, LR, RANKS, SYNC_EVERY = 4, 1e-2, 4, 2


def citing(function: str, feature: str) -> list[str]:
    """The algorithms whose JAX cell under ``feature`` is asserted by ``function`` of this file."""
    cited = [a for a, row in MATRIX.items() if getattr(row[feature]["jax"], "test", None) == f"{THIS}::{function}"]
    assert cited, f"no jax cell under {feature} cites {function}"
    return cited


def algorithm_and_optimizer(name: str):
    """Algorithm ``name`` with options that make it communicate within :data:`STEPS`, and its optax optimizer
    (None for QAdam and 1-bit Adam, which are the optimizer)."""
    if name in ("qadam", "onebit_adam"):
        return (QAdam if name == "qadam" else OneBitAdam)(LR, warmup_steps=2), None
    algorithm = {
        "async": lambda: AsyncModelAverage(warmup_steps=1),
        "powersgd": lambda: PowerSGD(rank=1, start_iter=1, min_compression_rate=1.0),
        "diloco": lambda: DiLoCo(sync_every=SYNC_EVERY),
    }.get(name, lambda: make_algorithm(name))()
    return algorithm, optax.sgd(LR, momentum=0.9)


def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)


@pytest.mark.parametrize("algorithm", citing("test_bf16_parameters_train_as_bf16", "mixed_precision"))
def test_bf16_parameters_train_as_bf16(algorithm, rng):
    bf16 = jnp.bfloat16
    initial = {
        "w1": rng.standard_normal((8, 16)).astype(bf16),
        "b1": (rng.standard_normal(16) * 0.1).astype(bf16),
        "w2": (rng.standard_normal((16, 2)) * 0.3).astype(bf16),
    }
    alg, optimizer = algorithm_and_optimizer(algorithm)
    trainer = DataParallel(loss_fn, optimizer, alg, mesh=Mesh(np.array(jax.devices()[:RANKS]), ("ranks",)))
    state = trainer.init(initial)
    for _ in range(STEPS):
        batch = {k: rng.standard_normal((4 * RANKS, n)).astype(bf16) for k, n in (("x", 8), ("y", 2))}
        state, _ = trainer.step(state, batch)
    params = jax.tree.map(np.asarray, state.params)
    for name, value in params.items():
        assert value.dtype == bf16, (algorithm, name, value.dtype)
        assert np.isfinite(value.astype(np.float32)).all(), (algorithm, name)
    if getattr(alg, "replicas_identical", False):
        assert all(params[n].shape == initial[n].shape for n in params), f"{algorithm}: not one copy"
        replicas = [params]
    else:
        replicas = [{n: v[r] for n, v in params.items()} for r in range(RANKS)]
    for replica in replicas:
        assert any(not np.array_equal(replica[n], initial[n]) for n in initial), f"{algorithm}: nothing moved"
    if algorithm == "diloco":
        # STEPS is a whole number of rounds, so the last step was an outer one: every rank holds the same outer
        # result x' as params + (x' - params), which is x' up to two bf16 roundings (of the difference and the sum):
        # 2 units in the last place of the larger of x' and params, which differ by the round's few steps.
        for replica in replicas[1:]:
            for name, value in replica.items():
                want, got = replicas[0][name].astype(np.float32), value.astype(np.float32)
                bound = np.maximum(np.abs(want), np.abs(got)) * 2.0**-6 + 2.0**-12
                assert (np.abs(got - want) <= bound).all(), name


@pytest.mark.parametrize("algorithm", citing("test_a_two_level_mesh_trains_as_the_flat_one", "hierarchical"))
def test_a_two_level_mesh_trains_as_the_flat_one(algorithm, rng):
    """An algorithm without a hierarchical variant on 2 nodes of 2 (a 2x2 ``("inter", "intra")`` mesh) averages
    over the whole world: the parameters equal the flat mesh's, to float rounding of the sums' order."""
    initial = {
        "w1": rng.standard_normal((8, 16)).astype(np.float32),
        "b1": (rng.standard_normal(16) * 0.1).astype(np.float32),
        "w2": (rng.standard_normal((16, 2)) * 0.3).astype(np.float32),
    }
    batches = [
        {k: rng.standard_normal((4 * RANKS, n)).astype(np.float32) for k, n in (("x", 8), ("y", 2))}
        for _ in range(STEPS)
    ]
    devices = np.array(jax.devices()[:RANKS])
    finals = []
    for mesh in (Mesh(devices, ("ranks",)), Mesh(devices.reshape(2, 2), ("inter", "intra"))):
        alg, optimizer = algorithm_and_optimizer(algorithm)
        trainer = DataParallel(loss_fn, optimizer, alg, mesh=mesh)
        state = trainer.init(initial)
        for batch in batches:
            state, _ = trainer.step(state, batch)
        finals.append(jax.tree.map(np.asarray, state.params))
    flat, two_level = finals
    for name in initial:
        assert not np.array_equal(flat[name], np.broadcast_to(initial[name], flat[name].shape)), name
        np.testing.assert_allclose(two_level[name], flat[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("algorithm", citing("test_a_group_at_rate_zero_and_an_unused_leaf_never_move", "param_groups"))
def test_a_group_at_rate_zero_and_an_unused_leaf_never_move(algorithm, rng):
    """Parameter groups as ``optax.multi_transform``: ``w1`` at rate 0 (frozen), ``b1`` and ``w2`` at two other
    rates, and a leaf the loss never uses: ``w1`` and the unused leaf stay bit for bit on every rank, the others
    move."""
    initial = {
        "w1": rng.standard_normal((8, 16)).astype(np.float32),
        "b1": (rng.standard_normal(16) * 0.1).astype(np.float32),
        "w2": (rng.standard_normal((16, 2)) * 0.3).astype(np.float32),
        "unused": rng.standard_normal(5).astype(np.float32),
    }
    alg, _ = algorithm_and_optimizer(algorithm)
    groups = {"frozen": optax.set_to_zero(), "slow": optax.sgd(LR / 10), "fast": optax.sgd(LR, momentum=0.9)}
    labels = {"w1": "frozen", "b1": "slow", "w2": "fast", "unused": "fast"}
    trainer = DataParallel(
        loss_fn, optax.multi_transform(groups, labels), alg, mesh=Mesh(np.array(jax.devices()[:RANKS]), ("ranks",))
    )
    state = trainer.init(initial)
    for _ in range(STEPS):
        batch = {k: rng.standard_normal((4 * RANKS, n)).astype(np.float32) for k, n in (("x", 8), ("y", 2))}
        state, _ = trainer.step(state, batch)
    params = jax.tree.map(np.asarray, state.params)
    for name, value in params.items():
        replicas = value.reshape(-1, *initial[name].shape)  # one copy, or one per rank
        moved = [not np.array_equal(replica, initial[name]) for replica in replicas]
        assert all(moved) if labels[name] != "frozen" and name != "unused" else not any(moved), (name, moved)


@pytest.mark.parametrize("algorithm", citing("test_autotune_keeps_an_exact_algorithms_numbers", "autotune"))
def test_autotune_keeps_an_exact_algorithms_numbers(algorithm, rng, tmp_path, monkeypatch):
    """Autotuning (``once``) an algorithm whose numbers do not depend on its buckets moves it from 1-kB buckets to
    the one that holds the model (the fake clock makes that one the fastest) and trains bit for bit as the untuned
    run; one whose numbers do depend on them is refused, naming why."""
    monkeypatch.setenv("BAGUA_AUTOTUNE_CACHE", str(tmp_path / "autotune.json"))
    cost_tuning_steps(lambda candidate: 2.0**-9 if candidate.bucket_bytes > 1024 else 2.0**-8, monkeypatch.setattr)
    initial = {
        "w1": rng.standard_normal((8, 160)).astype(np.float32),
        "b1": (rng.standard_normal(160) * 0.1).astype(np.float32),
        "w2": (rng.standard_normal((160, 2)) * 0.3).astype(np.float32),
    }
    batches = [
        {k: rng.standard_normal((4 * RANKS, n)).astype(np.float32) for k, n in (("x", 8), ("y", 2))}
        for _ in range(STEPS)
    ]
    mesh = Mesh(np.array(jax.devices()[:RANKS]), ("ranks",))

    def trainer_for(autotune: str) -> DataParallel:
        alg, optimizer = algorithm_and_optimizer(algorithm)
        return DataParallel(loss_fn, optimizer, alg.replace(bucket_bytes=1024), mesh=mesh, autotune=autotune)

    if not algorithm_facts(algorithm).bucket_exact:
        with pytest.raises(ValueError, match=f"{algorithm}'s numbers depend on its bucket layout"):
            trainer_for("once").init(initial)
        return
    finals = []
    for autotune in ("off", "once"):
        trainer = trainer_for(autotune)
        state = trainer.init(initial)
        for batch in batches:
            state, _ = trainer.step(state, batch)
        finals.append(jax.tree.map(np.asarray, state.params))
    assert trainer.algorithm.bucket_bytes > 1024, trainer.bucket_tuning
    untuned, tuned = finals
    for name in initial:
        assert not np.array_equal(untuned[name], np.broadcast_to(initial[name], untuned[name].shape)), name
        np.testing.assert_array_equal(tuned[name], untuned[name], err_msg=name)

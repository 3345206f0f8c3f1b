"""Every JAX entry point takes an algorithm's name and its options the same way, the Adam-type algorithms included.

``DataParallel`` (four simulated devices), ``data_parallel_optimizer`` (under ``shard_map`` over a
:class:`LaxCommunicator`) and ``DataParallelOptimizer`` are given a name with options and, again, the algorithm object
built with the same options: the numbers must be the same bit for bit. QAdam and 1-bit Adam, which replace the
user's optimizer, take the learning rate by name and say that they replace it; an unknown option's error names the
algorithm and its options.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from bagua_jax import DataParallel, LaxCommunicator, data_parallel_optimizer
from bagua_jax.algorithms import DiLoCo, OneBitAdam, QAdam, make_algorithm
from bagua_jax.nnx_data_parallel import DataParallelOptimizer

RANKS, LR, STEPS = 4, 0.1, 12
REPLACED = "is an optimizer itself (Adam with averaged momentum, learning rate 0.01): it replaces the optimizer"


def loss_fn(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def data(rng) -> tuple[dict, dict]:
    """Initial weights and a batch of 8 rows per rank fitting one shared linear map."""
    x = rng.standard_normal((RANKS * 8, 5)).astype(np.float32)
    target = rng.standard_normal((5, 2)).astype(np.float32)
    return {"w": np.zeros((5, 2), np.float32)}, {"x": x, "y": x @ target}


def train(algorithm, rng, **options) -> tuple[list[np.ndarray], list[float]]:
    params, batch = data(rng)
    dp = DataParallel(loss_fn, optax.sgd(LR), algorithm, mesh=jax.make_mesh((RANKS,), ("ranks",)), **options)
    state, history, losses = dp.init(params), [], []
    for _ in range(STEPS):
        state, loss = dp.step(state, batch)
        history.append(np.asarray(state.params["w"]))
        losses.append(float(loss))
    return history, losses


def test_data_parallel_trains_diloco_by_name_with_its_options(seed):
    by_name, losses = train("diloco", np.random.default_rng(seed), sync_every=5)
    by_object, _ = train(DiLoCo(sync_every=5), np.random.default_rng(seed))
    for step, (a, b) in enumerate(zip(by_name, by_object)):
        np.testing.assert_array_equal(a, b, err_msg=f"step {step}")
    # The ranks' rows agree after each synchronization only (to rounding: each applies its own x' - x).
    agree = [t + 1 for t, rows in enumerate(by_name) if all(np.allclose(rows[0], row, atol=1e-6) for row in rows[1:])]
    assert agree == [5, 10], agree
    assert losses[-1] < 0.5 * losses[0], losses


def test_an_unknown_option_names_the_algorithm_and_its_options():
    mesh = jax.make_mesh((RANKS,), ("ranks",))
    unknown = r"algorithm 'diloco' has no option 'sync_evry'; its options: bucket_bytes, sync_every, "
    with pytest.raises(TypeError, match=unknown):
        DataParallel(loss_fn, optax.sgd(LR), "diloco", mesh=mesh, sync_evry=5)
    with pytest.raises(TypeError, match=unknown):
        data_parallel_optimizer(optax.sgd(LR), "diloco", LaxCommunicator("ranks", RANKS), sync_evry=5)
    with pytest.raises(TypeError, match=r"options \['sync_every'\] can only be given with an algorithm's name"):
        DataParallel(loss_fn, optax.sgd(LR), DiLoCo(), mesh=mesh, sync_every=5)
    with pytest.raises(ValueError, match=r"qadam is an optimizer itself and needs learning_rate .* learning_rate=1e-3"):
        data_parallel_optimizer(optax.sgd(LR), "qadam", LaxCommunicator("ranks", RANKS))


def optimizer_steps(tx: optax.GradientTransformation, rng) -> np.ndarray:
    """Each rank's parameters after 4 steps of ``tx`` under ``shard_map`` on its own gradients: ``[RANKS, 4, 6]``."""
    params = rng.standard_normal(6).astype(np.float32)
    grads = rng.standard_normal((RANKS, 4, 6)).astype(np.float32)

    def per_rank(g):
        p, state, out = params, tx.init(params), []
        for t in range(4):
            updates, state = tx.update(g[0, t], state, p)
            p = optax.apply_updates(p, updates)
            out.append(p)
        return jnp.stack(out)[None]

    mesh = Mesh(np.array(jax.devices()[:RANKS]), ("ranks",))
    return np.asarray(jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ranks"), out_specs=P("ranks")))(grads))


@pytest.mark.parametrize("name, cls", [("qadam", QAdam), ("onebit_adam", OneBitAdam)])
def test_the_adam_algorithms_by_name_replace_the_optimizer_and_say_so(name, cls, seed, caplog):
    comm = LaxCommunicator("ranks", RANKS)
    with caplog.at_level(logging.WARNING):
        by_name = data_parallel_optimizer(optax.sgd(LR), name, comm, learning_rate=0.01, warmup_steps=2)
    assert caplog.text.count(REPLACED) == 1 and name in caplog.text
    by_object = data_parallel_optimizer(None, cls(learning_rate=0.01, warmup_steps=2), comm)
    np.testing.assert_array_equal(
        optimizer_steps(by_name, np.random.default_rng(seed)), optimizer_steps(by_object, np.random.default_rng(seed))
    )


def test_the_configurations_learning_rate_goes_to_the_adam_algorithms_only(seed, caplog):
    """A script passes its configuration's rate whatever the name (flax's examples do): the others ignore it."""
    comm = LaxCommunicator("ranks", RANKS)
    with caplog.at_level(logging.WARNING):
        gradient_allreduce = data_parallel_optimizer(optax.sgd(LR), "gradient_allreduce", comm, learning_rate=0.01)
    plain = data_parallel_optimizer(optax.sgd(LR), "gradient_allreduce", comm)
    assert REPLACED not in caplog.text
    np.testing.assert_array_equal(
        optimizer_steps(gradient_allreduce, np.random.default_rng(seed)),
        optimizer_steps(plain, np.random.default_rng(seed)),
    )


def test_data_parallel_optimizer_for_nnx_takes_a_name_and_options(caplog):
    comm = LaxCommunicator("ranks", 1)
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    with caplog.at_level(logging.WARNING):
        optimizer = DataParallelOptimizer(
            model, optax.sgd(LR), "qadam", communicator=comm, learning_rate=0.01, warmup_steps=2
        )
    assert caplog.text.count(REPLACED) == 1
    # Its state is QAdam's (the Adam moments, the step), not SGD's.
    expected = (
        make_algorithm("qadam", 0.01, warmup_steps=2).transformation(None, comm).init(nnx.state(model, nnx.Param))
    )
    got, want = jax.tree.leaves(optimizer.opt_state), jax.tree.leaves(expected)
    assert [(x.shape, x.dtype) for x in got] == [(x.shape, x.dtype) for x in want]
    assert len(want) > len(jax.tree.leaves(optax.sgd(LR).init(nnx.state(model, nnx.Param))))
    with pytest.raises(TypeError, match=r"algorithm 'qadam' has no option 'warmup'; its options: "):
        DataParallelOptimizer(model, None, "qadam", communicator=comm, learning_rate=0.01, warmup=2)

"""Every JAX algorithm trains an MLP on digits about as well as one device does.

Four simulated devices, 300 steps of a 128-example global batch (32 per rank); the
single-device baseline trains on the same global batches. The margin (5 accuracy
points) is what communication relaxation may cost on this task: in practice the
algorithms land within about 2 points of the baseline. AsyncModelAverage averages on
a background thread over the native engine, so it is trained across processes in
test_examples.py instead.
"""

import digits
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from bagua_jax.algorithms.bytegrad import ByteGrad
from bagua_jax.algorithms.decentralized import Decentralized
from bagua_jax.algorithms.gradient_allreduce import GradientAllReduce
from bagua_jax.algorithms.low_precision_decentralized import LowPrecisionDecentralized
from bagua_jax.algorithms.onebit_adam import OneBitAdam
from bagua_jax.algorithms.qadam import QAdam
from bagua_jax.trainer import DataParallel

STEPS, BATCH, LR, MARGIN = 300, 128, 3e-3, 0.05


def loss_fn(params, batch):
    hidden = jax.nn.relu(batch["x"] @ params["w1"] + params["b1"])
    logits = hidden @ params["w2"] + params["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def accuracy(params, x, y) -> float:
    hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
    return float(jnp.mean(jnp.argmax(hidden @ params["w2"] + params["b2"], -1) == y))


@pytest.fixture(scope="module")
def data():
    return digits.load()


@pytest.fixture(scope="module")
def baseline(data):
    x, y, x_test, y_test = data
    params = jax.tree.map(jnp.asarray, digits.init_mlp())
    optimizer = optax.adam(LR)
    state = optimizer.init(params)

    @jax.jit
    def step(params, state, batch):
        grads = jax.grad(loss_fn)(params, batch)
        updates, state = optimizer.update(grads, state)
        return optax.apply_updates(params, updates), state

    for batch in digits.batches(x, y, BATCH, STEPS):
        params, state = step(params, state, batch)
    return accuracy(params, x_test, y_test)


ALGORITHMS = {
    "gradient_allreduce": (GradientAllReduce(), optax.adam(LR)),
    "bytegrad": (ByteGrad(), optax.adam(LR)),
    "bytegrad_error_feedback": (ByteGrad(error_feedback=True), optax.adam(LR)),
    "decentralized_all": (Decentralized(), optax.adam(LR)),
    "decentralized_shift_one": (Decentralized(peer_selection_mode="shift_one"), optax.adam(LR)),
    "low_precision_decentralized": (LowPrecisionDecentralized(), optax.adam(LR)),
    "qadam": (QAdam(LR, warmup_steps=50), None),
    "onebit_adam": (OneBitAdam(LR, warmup_steps=50), None),
}


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["flat", "hierarchical"])
@pytest.mark.parametrize("name", ALGORITHMS)
def test_algorithm_converges_like_one_device(data, baseline, name, mesh_shape):
    x, y, x_test, y_test = data
    algorithm, optimizer = ALGORITHMS[name]
    axes = ("ranks",) if len(mesh_shape) == 1 else ("inter", "intra")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(mesh_shape), axes)
    trainer = DataParallel(loss_fn, optimizer, algorithm, mesh=mesh)
    state = trainer.init(digits.init_mlp())
    losses = []
    for batch in digits.batches(x, y, BATCH, STEPS):
        state, loss = trainer.step(state, batch)
        losses.append(float(loss))
    if getattr(algorithm, "replicas_identical", False):
        # One copy without a device axis; every device's buffer of it must hold the same bits.
        shapes = jax.tree.map(np.shape, digits.init_mlp())
        assert jax.tree.map(np.shape, state.params) == shapes
        for leaf in jax.tree.leaves(state.params):
            copies = [np.asarray(shard.data) for shard in leaf.addressable_shards]
            assert len(copies) == 4 and all(np.array_equal(c, copies[0]) for c in copies)
        per_rank = [accuracy(state.params, x_test, y_test)]
    else:
        # Every rank's own model is evaluated: decentralized replicas may differ slightly.
        per_rank = [accuracy(jax.tree.map(lambda p: p[r], state.params), x_test, y_test) for r in range(4)]
    assert min(per_rank) >= baseline - MARGIN, (per_rank, baseline)
    assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:20])

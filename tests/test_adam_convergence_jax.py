"""QAdam and 1-bit Adam train a CNN and an embedding + attention model about as well as Adam (JAX).

The tasks (tests/adam_tasks.py) leave many coordinates with an exactly zero second moment
when the warm-up ends: dead filters, and embedding rows first seen after it. Four simulated
devices on a flat mesh train ``STEPS`` steps with a ``WARMUP_STEPS``-step warm-up; the
reference is ``optax.adam`` on the same global batches (the average of the ranks'
gradients). Asserted on rank 0's model: ``adam_tasks.assert_trains_like_adam`` (held-out loss within
0.1 of Adam's, every parameter finite and at most twice Adam's largest magnitude).
"""

import adam_tasks
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from adam_tasks import LR, WARMUP_STEPS
from jax.sharding import Mesh

from bagua_jax.algorithms.onebit_adam import OneBitAdam
from bagua_jax.algorithms.qadam import QAdam
from bagua_jax.trainer import DataParallel


def cnn_logits(params, x):
    def conv(h, w, b, stride):
        dims = ("NHWC", "HWIO", "NHWC")
        return jax.lax.conv_general_dilated(h, w, (stride, stride), "SAME", dimension_numbers=dims) + b

    h = jax.nn.relu(conv(x, params["conv1"], params["conv1_b"], 1))
    h = jax.nn.relu(conv(h, params["conv2"], params["conv2_b"], 2))
    return h.reshape(h.shape[0], -1) @ params["dense"] + params["dense_b"]


def transformer_logits(params, tokens):
    h = params["embed"][tokens] + params["pos"]
    q, k, v = h @ params["q"], h @ params["k"], h @ params["v"]
    attention = jax.nn.softmax(q @ k.swapaxes(1, 2) / np.sqrt(q.shape[-1]), axis=-1)
    h = h + (attention @ v) @ params["o"]
    h = h + jax.nn.relu(h @ params["w1"] + params["b1"]) @ params["w2"]
    return h.mean(1) @ params["head"] + params["head_b"]


TASKS = {
    "cnn": (cnn_logits, adam_tasks.cnn_params, adam_tasks.cnn_batches, adam_tasks.cnn_eval),
    "transformer": (
        transformer_logits,
        adam_tasks.transformer_params,
        adam_tasks.transformer_batches,
        adam_tasks.transformer_eval,
    ),
}
ALGORITHMS = {"qadam": QAdam, "onebit_adam": OneBitAdam}


def task_loss(task: str):
    logits_fn = TASKS[task][0]

    def loss(params, batch):
        logits = logits_fn(params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    return loss


_adam: dict[str, dict] = {}


def adam_reference(task: str, seed: int) -> dict:
    """Plain optax.adam on the global batches: its final parameters and held-out loss (once per task)."""
    if task not in _adam:
        _, init, batches, evaluation = TASKS[task]
        loss = task_loss(task)
        optimizer = optax.adam(LR)
        params = jax.tree.map(jnp.asarray, init(seed))
        state = optimizer.init(params)

        @jax.jit
        def step(params, state, batch):
            updates, state = optimizer.update(jax.grad(loss)(params, batch), state)
            return optax.apply_updates(params, updates), state

        for batch in batches(seed):
            params, state = step(params, state, batch)
        _adam[task] = {"params": params, "loss": float(loss(params, evaluation(seed)))}
    return _adam[task]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("task", TASKS)
def test_trains_like_adam(task, algorithm, seed):
    _, init, batches, evaluation = TASKS[task]
    loss = task_loss(task)
    mesh = Mesh(np.array(jax.devices()[:4]), ("ranks",))
    trainer = DataParallel(loss, None, ALGORITHMS[algorithm](LR, warmup_steps=WARMUP_STEPS), mesh=mesh)
    state = trainer.init(init(seed))
    for batch in batches(seed):
        state, _ = trainer.step(state, batch)
    params = jax.tree.map(np.asarray, state.params)  # one copy: QAdam and 1-bit Adam keep replicas identical
    reference = adam_reference(task, seed)
    final = float(loss(params, evaluation(seed)))
    adam_tasks.assert_trains_like_adam(f"{task} {algorithm}", params, final, reference["params"], reference["loss"])

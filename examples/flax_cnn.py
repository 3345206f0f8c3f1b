"""A flax CNN (BatchNorm, dropout) trained on scikit-learn's 8x8 digits on one device.

``flax_cnn_data_parallel.py`` makes it data-parallel with Bagua: it imports the loss and ``main`` from
here and hands ``main`` Bagua's train step and state preparation instead of the two defaults below.

    python examples/flax_cnn.py --steps 200
"""

import argparse
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from sklearn.datasets import load_digits


class CNN(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Conv(16, (3, 3))(x)))
        x = nn.relu(nn.Conv(32, (3, 3), strides=2)(x)).reshape((x.shape[0], -1))
        return nn.Dense(10)(nn.Dropout(0.2, deterministic=not train)(x))


class TrainState(train_state.TrainState):
    batch_stats: dict


model = CNN()


def loss_fn(params, batch, model_state, rng):
    variables = {"params": params, "batch_stats": model_state}
    logits, updates = model.apply(variables, batch["x"], True, mutable=["batch_stats"], rngs={"dropout": rng})
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()
    return loss, (updates["batch_stats"], jnp.mean(jnp.argmax(logits, -1) == batch["y"]))


@jax.jit
def train_step(state, batch, rng):
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, (batch_stats, accuracy)), grads = grad_fn(state.params, batch, state.batch_stats, rng)
    return state.apply_gradients(grads=grads, batch_stats=batch_stats), (loss, accuracy)


def main(train_step: Callable = train_step, prepare_state: Callable[[TrainState], TrainState] = lambda s: s) -> None:
    """Train from a fresh state made ready by ``prepare_state``, stepping with ``train_step``; print the test
    accuracy."""
    parser = argparse.ArgumentParser(description="Train a flax CNN on scikit-learn's digits.")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    digits = load_digits()
    x, y = (digits.images[..., None] / 16.0).astype(np.float32), digits.target.astype(np.int32)
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    rng = jax.random.key(0)
    variables = model.init({"params": rng, "dropout": rng}, x_train[:1], False)
    state = TrainState.create(
        apply_fn=model.apply, params=variables["params"], batch_stats=variables["batch_stats"], tx=optax.adam(3e-3)
    )
    state = prepare_state(state)
    order = np.random.default_rng(0).permutation
    for step in range(1, args.steps + 1):
        index = order(len(x_train))[: args.batch]
        rng, step_rng = jax.random.split(rng)
        state, (loss, accuracy) = train_step(state, {"x": x_train[index], "y": y_train[index]}, step_rng)
        if step % 50 == 0:
            print(f"step {step:4d}  loss {float(loss):.4f}  batch accuracy {float(accuracy):.3f}")
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    test_accuracy = jnp.mean(jnp.argmax(model.apply(variables, x_test, False), -1) == y_test)
    print(f"test accuracy {float(test_accuracy):.4f}")


if __name__ == "__main__":
    main()

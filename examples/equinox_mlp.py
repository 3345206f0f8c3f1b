"""An equinox MLP trained on scikit-learn's digits on one device.

``equinox_mlp_data_parallel.py`` makes it data-parallel with Bagua: it imports ``main`` from here and
hands it the algorithm's per-rank optimizer and this process's rank and world size.

    python examples/equinox_mlp.py --steps 300
"""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits


def loss_fn(model, batch):
    logits = jax.vmap(model)(batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


def main(tx: optax.GradientTransformation = optax.adam(3e-3), rank: int = 0, size: int = 1) -> None:
    """Train with the optimizer ``tx`` on slice ``rank::size`` of every batch; print the test accuracy."""

    @eqx.filter_jit
    def train_step(model, opt_state, batch):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, batch)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    parser = argparse.ArgumentParser(description="Train an equinox MLP on scikit-learn's digits.")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    digits = load_digits()
    x = ((digits.data - digits.data.mean(0)) / (digits.data.std(0) + 1e-6)).astype(np.float32)
    y = digits.target.astype(np.int32)
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:], y[1400:]
    model = eqx.nn.MLP(64, 10, 64, 2, key=jax.random.key(0))
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    order = np.random.default_rng(0).permutation
    for step in range(1, args.steps + 1):
        index = order(len(x_train))[: args.batch][rank::size]
        model, opt_state, loss = train_step(model, opt_state, {"x": x_train[index], "y": y_train[index]})
        if step % 100 == 0:
            print(f"step {step:4d}  loss {float(loss):.4f}")
    test_accuracy = jnp.mean(jnp.argmax(jax.vmap(model)(x_test), -1) == y_test)
    print(f"test accuracy {float(test_accuracy):.4f}")


if __name__ == "__main__":
    main()

"""JAX needs no fused optimizer: under jit, ``optax.flatten(tx)`` and ``tx`` give the same updates.

``optax.flatten`` steps one flat vector instead of one array per leaf; under ``jax.jit`` the
whole update is one XLA program either way, so there is no per-tensor dispatch to save. This
pins that both forms agree, so users can pick either.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

TRANSFORMS = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_flatten_gives_the_same_updates(name):
    rng = np.random.default_rng(0)
    params = {f"w{i}": jnp.asarray(rng.standard_normal((i + 1, 7)), jnp.float32) for i in range(6)}
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.standard_normal(p.shape), p.dtype), params) for _ in range(5)]

    def run(tx):
        @jax.jit
        def step(params, state, grad):
            updates, state = tx.update(grad, state, params)
            return optax.apply_updates(params, updates), state

        p, state = params, tx.init(params)
        for g in grads:
            p, state = step(p, state, g)
        return p

    plain, flat = run(TRANSFORMS[name]()), run(optax.flatten(TRANSFORMS[name]()))
    for key in params:
        # XLA compiles the elementwise chain of a flat vector differently (its vectorized sqrt
        # and division), so the last bits of Adam's update may differ: a few float32 ulps.
        np.testing.assert_allclose(np.asarray(flat[key]), np.asarray(plain[key]), rtol=2e-6, atol=1e-7)
        assert not np.array_equal(np.asarray(plain[key]), np.asarray(params[key]))

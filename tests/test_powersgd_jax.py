"""PowerSGD in JAX against the float64 NumPy reference, on 4 simulated devices.

Tolerance: the JAX step runs in float32 (matrix products of at most 32 terms, Gram-Schmidt on
two columns, four-rank sums), the reference in float64; over six steps the float32 rounding
stays below 1e-4 of the gradients' scale, while a wrong step (a missing residual, an
unorthogonalized P, a sum instead of a mean) is off by order one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from powersgd_reference import PowerSGDReference

from bagua_common.algorithms.configs import PowerSGDConfig
from bagua_jax import LaxCommunicator
from bagua_jax.algorithms.powersgd import powersgd

RANKS = 4
SHAPES = {"b": (10,), "conv": (8, 3, 3, 3), "thin": (2, 40), "w1": (32, 24), "w2": (24, 10)}


def run_steps(config: PowerSGDConfig, grads_per_step):
    """Every rank's averaged gradients per step, and the final states, from the JAX transform."""
    mesh = Mesh(np.array(jax.devices()[:RANKS]), ("ranks",))
    tx = powersgd(LaxCommunicator("ranks", RANKS), config)
    params = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    state = jax.tree.map(lambda a: jnp.stack([a] * RANKS), tx.init(params))

    def per_rank(state, grads):
        state, grads = jax.tree.map(lambda a: a[0], (state, grads))
        updates, state = tx.update(grads, state)
        return jax.tree.map(lambda a: a[None], (updates, state))

    step = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ranks"), out_specs=P("ranks")))
    outputs = []
    for grads in grads_per_step:
        updates, state = step(state, grads)
        outputs.append(updates)
    return outputs, state, tx.init(params)


def random_grads(rng, steps: int):
    return [{k: rng.standard_normal((RANKS, *s)).astype(np.float32) for k, s in SHAPES.items()} for _ in range(steps)]


@pytest.mark.parametrize("error_feedback", [True, False], ids=["error_feedback", "plain"])
def test_matches_the_numpy_reference_and_replicas_agree(rng, error_feedback):
    config = PowerSGDConfig(rank=2, start_iter=2, error_feedback=error_feedback)
    grads_per_step = random_grads(rng, 6)
    outputs, state, initial = run_steps(config, grads_per_step)
    keys = sorted(SHAPES)
    reference = PowerSGDReference([SHAPES[k] for k in keys], RANKS, config, [np.asarray(q) for q in initial.qs])
    for step, (grads, updates) in enumerate(zip(grads_per_step, outputs)):
        expected = reference.step([[grads[k][r] for k in keys] for r in range(RANKS)])
        for k, want in zip(keys, expected):
            got = np.asarray(updates[k])
            assert all(np.array_equal(got[0], got[r]) for r in range(RANKS)), f"step {step}: ranks differ on {k}"
            np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max(), err_msg=f"{k}@{step}")
    assert int(state.step[0]) == 6
    # Only the compressed matrices carry Q and residuals: conv (8 x 27), w1 and w2; b and thin go plain.
    assert [q.shape[1:] for q in state.qs] == [(27, 2), (24, 2), (10, 2)]


def test_bad_configurations_raise():
    # The options' values are checked for both front ends in test_algorithm_configs.py.
    tx = powersgd(LaxCommunicator("ranks", RANKS), PowerSGDConfig(rank=50))
    with pytest.raises(ValueError, match="rank 50 is larger than any gradient matrix"):
        tx.init({k: np.zeros(s, np.float32) for k, s in SHAPES.items()})

"""Frozen parameters stay exactly unchanged under every JAX algorithm.

Four simulated devices (flat and 2x2 hierarchical meshes), a small MLP on random data, a few
steps. An optax-driven algorithm freezes ``w1`` with ``optax.set_to_zero`` through
``optax.multi_transform`` (its gradient is non-zero); QAdam and OneBitAdam, which are the
optimizer, get a parameter the loss does not use (its gradient is exactly zero), with the
warm-up short enough that the compressed phase runs (1-bit Adam holds such a coordinate's
momentum at zero, since its sign codes cannot send one, and that of a leaf whose gradient is 1e-13 of the
others'). The frozen leaf must equal its initial value bit for bit on every rank, while the trained leaves move.
"""

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

STEPS, LR = 6, 1e-2


def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    # "negligible" has a gradient of at most about 1e-15: never zero, and a negligible second moment that
    # 1-bit Adam must hold as an unused one. The warm-up's Adam moves it by at most lr x |g| / eps, about
    # 1e-9, which rounds away: its values are at least 1 in magnitude (half an ulp there is 6e-8).
    return jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2) + 1e-15 * jnp.mean(
        batch["x"][:, :5] * params["negligible"]
    )


def init_params(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {
        "w1": rng.standard_normal((8, 16)).astype(np.float32),
        "b1": rng.standard_normal(16).astype(np.float32) * 0.1,
        "w2": rng.standard_normal((16, 2)).astype(np.float32) * 0.3,
        "unused": rng.standard_normal(5).astype(np.float32),
        "negligible": (rng.uniform(1.0, 2.0, 5) * rng.choice([-1.0, 1.0], 5)).astype(np.float32),
    }


def frozen_w1(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    labels = {"w1": "frozen", "b1": "train", "w2": "train", "unused": "train", "negligible": "train"}
    return optax.multi_transform({"train": optimizer, "frozen": optax.set_to_zero()}, labels)


# name -> (algorithm, optimizer, the leaf that must not move)
ALGORITHMS = {
    "gradient_allreduce": (GradientAllReduce(), frozen_w1(optax.adam(LR)), "w1"),
    "bytegrad": (ByteGrad(), frozen_w1(optax.adam(LR)), "w1"),
    "bytegrad_error_feedback": (
        ByteGrad(error_feedback=True),
        frozen_w1(optax.adam(LR)),
        "w1",
    ),
    "decentralized": (Decentralized(), frozen_w1(optax.adam(LR)), "w1"),
    "decentralized_shift_one": (
        Decentralized(peer_selection_mode="shift_one"),
        frozen_w1(optax.adam(LR)),
        "w1",
    ),
    "low_precision_decentralized": (
        LowPrecisionDecentralized(),
        frozen_w1(optax.adam(LR)),
        "w1",
    ),
    "qadam": (QAdam(LR, warmup_steps=2), None, "unused"),
    "onebit_adam": (OneBitAdam(LR, warmup_steps=2), None, "unused"),
}


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["flat", "hierarchical"])
@pytest.mark.parametrize("name", ALGORITHMS)
def test_frozen_parameter_never_moves(rng, name, mesh_shape):
    algorithm, optimizer, frozen = ALGORITHMS[name]
    axes = ("ranks",) if len(mesh_shape) == 1 else ("inter", "intra")
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(mesh_shape), axes)
    trainer = DataParallel(loss_fn, optimizer, algorithm, mesh=mesh)
    initial = init_params(rng)
    state = trainer.init(initial)
    for _ in range(STEPS):
        batch = {
            "x": rng.standard_normal((16, 8)).astype(np.float32),
            "y": rng.standard_normal((16, 2)).astype(np.float32),
        }
        state, _ = trainer.step(state, batch)
    params = jax.tree.map(np.asarray, state.params)
    # Identical replicas come back as one copy; the others with one row per rank.
    if getattr(algorithm, "replicas_identical", False):
        replicas = [params]
    else:
        replicas = [jax.tree.map(lambda p, r=r: p[r], params) for r in range(4)]
    for rank, replica in enumerate(replicas):
        moved = np.max(np.abs(replica[frozen] - initial[frozen]))
        assert moved == 0, f"rank {rank}: frozen {frozen} moved by {moved:.3g}"
        if name == "onebit_adam":
            assert np.array_equal(replica["negligible"], initial["negligible"]), "a negligible second moment is held"
        assert not np.array_equal(replica["w2"], initial["w2"]), "the trained leaves must move"

"""DataParallel in native mode: an NNX module with its nnx.Optimizer, the loss it reports, and its batch check.

One MPI job of two processes (``worker``) trains

* a tiny NNX model (Linear, BatchNorm, Dropout) with gradient allreduce through ``DataParallel.init(model)``, and
  again with the user's own ``nnx.jit`` train step, its optimizer a ``DataParallelOptimizer`` and its keys
  ``rank_rngs``; the parameters and BatchNorm statistics must equal a plain-NNX simulation of the two ranks in
  this process (SGD on the mean gradient, the statistics averaged), the loss the mean of the ranks', and the
  dropout masks must differ between the ranks;
* a linear model through the pure ``DataParallel``, whose loss each step must equal the mesh mode's on the same
  global batches (the mean over ranks in both) and the NumPy mean of the two halves' losses;

and hands both trainers every rank the same (whole) batch, which must be refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh
from multiprocess import ONE_CPU_DEVICE, run_ranks

import bagua_jax
from bagua_jax import DataParallel, rank_slice
from bagua_jax.nnx_data_parallel import DataParallelOptimizer, rank_rngs

# 8 rows a rank: BatchNorm divides by the rank's batch variance, and with 4 rows one seed in 40 drew a variance of
# 0.006 that amplified the two summation orders' float32 rounding past rtol 1e-5 (BAGUA_TEST_SEED=1010).
LR, STEPS, ROWS = 0.1, 3, 16
DROPPED = 64  # dropout positions per step: identical masks on both ranks are a 2**-64 chance


class Tiny(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        # No bias before BatchNorm: its gradient is zero up to rounding, so its values would be rounding noise
        # (1e-6) that two summation orders need not share (BAGUA_TEST_SEED=427795064).
        self.linear = nnx.Linear(4, 3, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(3, momentum=0.5, rngs=rngs)
        self.drop = nnx.Dropout(0.5)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.norm(self.linear(x)).sum(-1)


def nnx_loss(model: Tiny, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def nnx_loss_and_mask(model: Tiny, batch: dict, rngs: nnx.Rngs):
    """The loss, and a dropout mask (of ones, dropped) as aux: its mean over the ranks shows whether they differ."""
    return nnx_loss(model, batch), model.drop(jnp.ones(DROPPED), rngs=rngs)


def linear_loss(params: dict, batch: dict) -> jax.Array:
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def batches(seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.standard_normal((ROWS, 4)).astype(np.float32), "y": rng.standard_normal(ROWS).astype(np.float32)}
        for _ in range(STEPS)
    ]


def nnx_variables(model: Tiny) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The model's parameters and BatchNorm statistics as NumPy arrays."""
    return tuple(
        [np.asarray(leaf) for leaf in jax.tree.leaves(nnx.state(model, kind))] for kind in (nnx.Param, nnx.BatchStat)
    )


@nnx.jit
def own_train_step(model: Tiny, optimizer: nnx.Optimizer, batch: dict, rngs: nnx.Rngs):
    """A train step as flax's examples write one."""
    (loss, mask), grads = nnx.value_and_grad(nnx_loss_and_mask, has_aux=True)(model, batch, rngs)
    optimizer.update(model, grads)
    return loss, mask


def refused(dp: DataParallel, state, batch, *rngs) -> str:
    try:
        dp.step(state, batch, *rngs)
    except ValueError as e:
        return str(e)
    return ""


def worker(seed: int) -> dict:
    comm = bagua_jax.NativeCommunicator.mpi_world(timeout=60)
    data, result = batches(seed), {}

    dp = DataParallel(nnx_loss_and_mask, optax.sgd(LR), "gradient_allreduce", communicator=comm, has_aux=True)
    result["nnx_refused"] = refused(dp, dp.init(Tiny(nnx.Rngs(0))), data[0], nnx.Rngs(1))
    state, rngs, losses, masks = dp.init(Tiny(nnx.Rngs(0))), nnx.Rngs(1), [], []
    for batch in data:
        state, (loss, mask) = dp.step(state, rank_slice(batch, comm), rngs)
        losses.append(float(loss))
        masks.append(np.asarray(mask))
    result["nnx"] = (*nnx_variables(state.model), losses, masks)

    model = Tiny(nnx.Rngs(0))
    optimizer, rngs, masks = (
        DataParallelOptimizer(model, optax.sgd(LR), communicator=comm),
        rank_rngs(nnx.Rngs(1), comm),
        [],
    )
    for batch in data:
        _, mask = own_train_step(model, optimizer, rank_slice(batch, comm), rngs)
        masks.append(comm.allreduce(mask, "avg"))
    result["own_step"] = (*nnx_variables(model), masks)

    pure = DataParallel(linear_loss, optax.sgd(LR), "gradient_allreduce", communicator=comm)
    result["pure_refused"] = refused(pure, pure.init({"w": np.zeros(4, np.float32)}), data[0])
    state, losses = pure.init({"w": np.zeros(4, np.float32)}), []
    for batch in data:
        state, loss = pure.step(state, rank_slice(batch, comm))
        losses.append(float(loss))
    result["pure_losses"] = losses
    return result


def assign(model: Tiny, kind: type, values: dict) -> None:
    """Set ``model``'s variables of ``kind`` to ``values`` (a pure dict, as ``nnx.to_pure_dict`` gives)."""
    state = nnx.state(model, kind)
    nnx.replace_by_pure_dict(state, values)
    nnx.update(model, state)


def nnx_reference(data: list[dict]) -> tuple[list[np.ndarray], list[np.ndarray], list[float]]:
    """Two ranks simulated with plain NNX and optax: each computes its half's gradient (and BatchNorm statistics),
    SGD steps with the mean gradient, the statistics become the ranks' mean."""
    model, losses = Tiny(nnx.Rngs(0)), []
    for batch in data:
        grads, stats, rank_losses = [], [], []
        for half in (slice(0, ROWS // 2), slice(ROWS // 2, ROWS)):
            rank_model = nnx.clone(model)
            loss, grad = nnx.value_and_grad(nnx_loss)(rank_model, {k: v[half] for k, v in batch.items()})
            grads.append(nnx.to_pure_dict(grad))
            stats.append(nnx.to_pure_dict(nnx.state(rank_model, nnx.BatchStat)))
            rank_losses.append(float(loss))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        mean_grad = jax.tree.map(lambda a, b: (a + b) / 2, *grads)
        assign(model, nnx.Param, jax.tree.map(lambda p, g: p - LR * g, params, mean_grad))
        assign(model, nnx.BatchStat, jax.tree.map(lambda a, b: (a + b) / 2, *stats))
        losses.append(np.mean(rank_losses))
    return (*nnx_variables(model), losses)


def mesh_losses(data: list[dict]) -> list[float]:
    dp = DataParallel(
        linear_loss, optax.sgd(LR), "gradient_allreduce", mesh=Mesh(np.array(jax.devices()[:2]), ("ranks",))
    )
    state, losses = dp.init({"w": np.zeros(4, np.float32)}), []
    for batch in data:
        state, loss = dp.step(state, batch)
        losses.append(float(loss))
    return losses


@pytest.mark.skipif(not bagua_jax.build_info()["mpi"], reason="built without the MPI engine")
def test_nnx_model_batchnorm_dropout_loss_and_batch_check(rng):
    seed = int(rng.integers(2**31))
    results = run_ranks("test_nnx_data_parallel_jax:worker", 2, seed, launcher="mpiexec", env=ONE_CPU_DEVICE)
    data = batches(seed)
    params, stats, losses = nnx_reference(data)
    on_mesh = mesh_losses(data)
    for result in results:
        got = result.value
        for name in ("nnx_refused", "pure_refused"):
            assert "passed the same batch" in got[name], f"rank {result.rank}: {name}: {got[name]!r}"
        got_params, got_stats, got_losses, masks = got["nnx"]
        own_params, own_stats, own_masks = got["own_step"]
        for route, got_leaves in (("DataParallel", got_params + got_stats), ("own step", own_params + own_stats)):
            for got_leaf, want in zip(got_leaves, params + stats, strict=True):
                np.testing.assert_allclose(got_leaf, want, rtol=1e-5, atol=1e-6, err_msg=f"{route}, rank {result.rank}")
        np.testing.assert_allclose(got_losses, losses, rtol=1e-5, err_msg=f"rank {result.rank}")
        for step, (mask, own_mask) in enumerate(
            zip(masks, own_masks)
        ):  # means of two masks of 0 or 2: 1 where one kept
            assert np.any(mask == 1.0), f"rank {result.rank}, step {step}: both ranks drew the same dropout mask"
            assert np.any(own_mask == 1.0), f"rank {result.rank}, step {step}: the same mask in the own step"
        np.testing.assert_allclose(got["pure_losses"], on_mesh, rtol=1e-6, err_msg=f"rank {result.rank}")
    halves = [np.mean(data[0]["y"][: ROWS // 2] ** 2), np.mean(data[0]["y"][ROWS // 2 :] ** 2)]
    np.testing.assert_allclose(on_mesh[0], np.mean(halves), rtol=1e-6)  # at w = 0 each half's loss is mean(y**2)

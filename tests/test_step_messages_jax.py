"""Messages per native-mode step: the ranks' mean loss, aux and model state cost no extra collective.

One MPI job of two processes counts, with a :class:`~bagua_jax.counting.CountingCommunicator` around the
world, the collectives one ``DataParallel.step`` traces (after ``init``, so the count is the first step's
batch check, one allgather, and the step itself):

* gradient allreduce (one bucket: a tiny model) with aux and a model state: the loss, aux and model state
  ride in the gradients' one allreduce;
* ByteGrad (8-bit codes, which must not carry the loss) with the same: its all-to-all and allgather, and one
  full-precision allreduce of the loss, aux and model state together;
* PowerSGD, its warm-up step (an exact allreduce) and its compressed step (start_iter 0 and 1): the loss, aux
  and model state ride in the first allreduce of either (both are traced, the compressed one makes two);
* an NNX module with BatchNorm through ``DataParallel``, and through the user's own train step with a
  ``DataParallelOptimizer``: the loss and the BatchNorm statistics ride in the gradients' allreduce.

The reported loss, aux and model state must equal the NumPy means over the two ranks' halves of the batch.

Algorithms whose replicas differ between averagings (decentralized; DiLoCo, whose first step is local) return
each rank's own loss and aux, through ``DataParallel`` and its NNX step: only the model state is averaged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from multiprocess import ONE_CPU_DEVICE, run_ranks

import bagua_jax
from bagua_jax import DataParallel, rank_slice
from bagua_jax.algorithms import ByteGrad, Decentralized, DiLoCo, GradientAllReduce, PowerSGD
from bagua_jax.counting import CountingCommunicator
from bagua_jax.nnx_data_parallel import DataParallelOptimizer

ROWS = 8
ALGORITHMS = {
    "gradient_allreduce": GradientAllReduce,
    "bytegrad": ByteGrad,
    "powersgd_exact": lambda: PowerSGD(rank=1, start_iter=1),
    "powersgd_compressed": lambda: PowerSGD(rank=1, start_iter=0),
}
OWN_LOSS_ALGORITHMS = {
    "decentralized": lambda: Decentralized(peer_selection_mode="shift_one"),
    "diloco": lambda: DiLoCo(sync_every=4),
}
# Allreduce bytes one step traces, 2 (n-1)/n of each message on 2 ranks: the model state's 4 floats, and for
# DiLoCo its outer exchange of the 4 weights (traced, though it runs only every sync_every steps). The loss and
# aux would add 8.
OWN_LOSS_ALLREDUCE_BYTES = {"decentralized": 16, "diloco": 32}


def loss_with_state(params: dict, batch: dict, model_state: dict):
    """A linear model's loss at ``params``; aux is the mean prediction, the new model state the batch's mean
    input (as BatchNorm keeps)."""
    prediction = batch["x"] @ params["w"]
    new_state = {"mean": jnp.mean(batch["x"], axis=0)}
    return jnp.mean((prediction - batch["y"]) ** 2), (new_state, jnp.mean(prediction))


class Normed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(4, 3, rngs=rngs)
        self.norm = nnx.BatchNorm(3, momentum=0.0, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.norm(self.linear(x)).sum(-1)


def nnx_loss(model: Normed, batch: dict) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def batch(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((ROWS, 4)).astype(np.float32), "y": rng.standard_normal(ROWS).astype(np.float32)}


def worker(seed: int) -> dict:
    comm = bagua_jax.NativeCommunicator.mpi_world(timeout=60)
    data, w = batch(seed), np.random.default_rng(seed + 1).standard_normal(4).astype(np.float32)
    result = {}
    for name, algorithm in ALGORITHMS.items():
        counter = CountingCommunicator(comm)
        dp = DataParallel(loss_with_state, optax.sgd(0.1), algorithm(), communicator=counter, has_aux=True)
        state = dp.init({"w": w}, model_state={"mean": np.zeros(4, np.float32)})
        counter.reset()
        state, (loss, aux) = dp.step(state, rank_slice(data, comm))
        result[name] = (counter.calls_by_op, float(loss), float(aux), np.asarray(state.model_state["mean"]))
    for name, algorithm in OWN_LOSS_ALGORITHMS.items():
        counter = CountingCommunicator(comm)
        dp = DataParallel(loss_with_state, optax.sgd(0.1), algorithm(), communicator=counter, has_aux=True)
        state = dp.init({"w": w}, model_state={"mean": np.zeros(4, np.float32)})
        counter.reset()
        state, (loss, aux) = dp.step(state, rank_slice(data, comm))
        nnx_dp = DataParallel(nnx_loss, optax.sgd(0.1), algorithm(), communicator=comm)
        nnx_state = nnx_dp.init(Normed(nnx.Rngs(0)))
        _, nnx_loss_value = nnx_dp.step(nnx_state, rank_slice(data, comm))
        result[name] = (counter.bytes_by_op, float(loss), float(aux), float(nnx_loss_value))
    counter = CountingCommunicator(comm)
    dp = DataParallel(nnx_loss, optax.sgd(0.1), "gradient_allreduce", communicator=counter)
    state = dp.init(Normed(nnx.Rngs(0)))
    counter.reset()
    state, loss = dp.step(state, rank_slice(data, comm))
    result["nnx"] = (counter.calls_by_op, float(loss), np.asarray(state.model.norm.mean[...]))
    counter, model = CountingCommunicator(comm), Normed(nnx.Rngs(0))
    own_train_step(model, DataParallelOptimizer(model, optax.sgd(0.1), communicator=counter), rank_slice(data, comm))
    result["own_step"] = (counter.calls_by_op, np.asarray(model.norm.mean[...]))
    return result


@nnx.jit
def own_train_step(model: Normed, optimizer: DataParallelOptimizer, batch: dict) -> None:
    """A train step as flax's NNX examples write one: ``optimizer.update`` averages the BatchNorm statistics."""
    optimizer.update(model, nnx.grad(nnx_loss)(model, batch))


def nnx_reference(data: dict) -> tuple[list[float], np.ndarray]:
    """The two halves' losses and the mean of their BatchNorm running means (momentum 0: the batch's own)."""
    losses, means = [], []
    for half in (slice(0, ROWS // 2), slice(ROWS // 2, ROWS)):
        model = Normed(nnx.Rngs(0))
        losses.append(float(nnx_loss(model, {k: v[half] for k, v in data.items()})))
        means.append(np.asarray(model.norm.mean[...]))
    return losses, np.mean(means, axis=0)


@pytest.mark.skipif(not bagua_jax.build_info()["mpi"], reason="built without the MPI engine")
def test_mean_loss_aux_and_model_state_cost_no_extra_message(rng):
    seed = int(rng.integers(2**31))
    results = run_ranks("test_step_messages_jax:worker", 2, seed, launcher="mpiexec", env=ONE_CPU_DEVICE)
    data, w = batch(seed), np.random.default_rng(seed + 1).standard_normal(4).astype(np.float32)
    halves = [{k: v[s] for k, v in data.items()} for s in (slice(0, ROWS // 2), slice(ROWS // 2, ROWS))]
    own_losses = [np.mean((h["x"] @ w - h["y"]) ** 2) for h in halves]
    own_auxes = [np.mean(h["x"] @ w) for h in halves]
    want_loss, want_aux = np.mean(own_losses), np.mean(own_auxes)
    want_state = np.mean([h["x"].mean(axis=0) for h in halves], axis=0)
    nnx_own_losses, nnx_batch_mean = nnx_reference(data)
    nnx_loss_mean = np.mean(nnx_own_losses)
    expected_calls = {
        "gradient_allreduce": {"allgather": 1, "allreduce": 1},
        "bytegrad": {"allgather": 2, "alltoall": 1, "allreduce": 1},
        "powersgd_exact": {"allgather": 1, "allreduce": 3},
        "powersgd_compressed": {"allgather": 1, "allreduce": 3},
    }
    for result in results:
        got = result.value
        for name, calls in expected_calls.items():
            got_calls, loss, aux, model_state = got[name]
            assert got_calls == calls, f"rank {result.rank}, {name}: {got_calls}"
            np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=f"rank {result.rank}, {name}")
            np.testing.assert_allclose(aux, want_aux, rtol=1e-5, atol=1e-6, err_msg=f"rank {result.rank}, {name}")
            np.testing.assert_allclose(model_state, want_state, rtol=1e-5, atol=1e-6, err_msg=f"rank {result.rank}")
        for name in OWN_LOSS_ALGORITHMS:
            got_bytes, loss, aux, nnx_loss_value = got[name]
            want_bytes = OWN_LOSS_ALLREDUCE_BYTES[name]
            assert got_bytes.get("allreduce") == want_bytes, f"rank {result.rank}, {name}: {got_bytes}"
            np.testing.assert_allclose(loss, own_losses[result.rank], rtol=1e-5, err_msg=f"rank {result.rank}, {name}")
            np.testing.assert_allclose(aux, own_auxes[result.rank], rtol=1e-5, atol=1e-6, err_msg=f"{name}")
            np.testing.assert_allclose(nnx_loss_value, nnx_own_losses[result.rank], rtol=1e-5, err_msg=f"{name}")
        got_calls, loss, batch_mean = got["nnx"]
        assert got_calls == {"allgather": 1, "allreduce": 1}, f"rank {result.rank}, nnx: {got_calls}"
        np.testing.assert_allclose(loss, nnx_loss_mean, rtol=1e-5, err_msg=f"rank {result.rank}, nnx")
        np.testing.assert_allclose(batch_mean, nnx_batch_mean, rtol=1e-5, atol=1e-6, err_msg=f"rank {result.rank}")
        got_calls, batch_mean = got["own_step"]
        assert got_calls == {"allreduce": 1}, f"rank {result.rank}, own NNX step: {got_calls}"
        np.testing.assert_allclose(batch_mean, nnx_batch_mean, rtol=1e-5, atol=1e-6, err_msg=f"rank {result.rank}")

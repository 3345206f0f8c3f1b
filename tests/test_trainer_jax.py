"""DataParallel takes what flax and equinox train steps need, checked against plain jnp.

Four simulated devices; the references compute every rank's step in plain jnp on its slice of
the batch (gradient allreduce: the mean of the ranks' gradients, then optax's SGD).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from algorithms_reference import bytegrad_bucket
from flax.training import train_state
from jax.flatten_util import ravel_pytree

from bagua_jax import DataParallel, TrainState
from bagua_jax.algorithms import Decentralized, GradientAllReduce

RANKS, LR = 4, 0.1


def mesh():
    return jax.make_mesh((RANKS,), ("ranks",))


def loss_with_state(params, batch, model_state, rng):
    """A loss with a running statistic (like BatchNorm's) and a random mask (like dropout)."""
    keep = jax.random.bernoulli(rng, 0.7, batch["x"].shape)
    x = jnp.where(keep, batch["x"], 0.0) / 0.7
    loss = jnp.mean((x @ params["w"] - batch["y"]) ** 2)
    mean = 0.9 * model_state["mean"] + 0.1 * jnp.mean(batch["x"], 0)
    return loss, ({"mean": mean, "count": model_state["count"] + 1}, jnp.mean(keep.astype(jnp.float32)))


def reference_step(params, model_state, batch, rng, average_model_state: bool):
    """Every rank's step in plain jnp: per-rank keys, gradient mean, SGD; new model states."""
    grads, states, aux = [], [], []
    for r in range(RANKS):
        part = jax.tree.map(lambda a: a[r * 4 : (r + 1) * 4], batch)
        rank_state = jax.tree.map(lambda a: a[r], model_state) if not average_model_state else model_state
        (_, (state, kept)), g = jax.value_and_grad(loss_with_state, has_aux=True)(
            params, part, rank_state, jax.random.fold_in(rng, r)
        )
        grads.append(g)
        states.append(state)
        aux.append(kept)
    mean_grad = jax.tree.map(lambda *g: sum(g) / RANKS, *grads)
    new_params = jax.tree.map(lambda p, g: p - LR * g, params, mean_grad)
    if average_model_state:
        new_state = {"mean": sum(s["mean"] for s in states) / RANKS, "count": states[0]["count"]}
    else:
        new_state = jax.tree.map(lambda *s: jnp.stack(s), *states)
    return new_params, new_state, np.mean(aux)


@pytest.mark.parametrize("average_model_state", [True, False], ids=["averaged", "per_rank"])
def test_model_state_aux_and_per_rank_keys_match_the_reference(average_model_state, rng):
    params = {"w": jnp.asarray(rng.standard_normal((3, 1)), jnp.float32)}
    model_state = {"mean": jnp.zeros(3, jnp.float32), "count": jnp.int32(0)}
    dp = DataParallel(
        loss_with_state,
        optax.sgd(LR),
        GradientAllReduce(),
        mesh=mesh(),
        has_aux=True,
        average_model_state=average_model_state,
    )
    state = dp.init(params, model_state=model_state)
    assert state.params["w"].shape == (3, 1)  # no device axis: the replicas are identical
    expected_params = params
    expected_state = model_state if average_model_state else jax.tree.map(lambda a: jnp.stack([a] * RANKS), model_state)
    for step in range(3):
        batch = {
            "x": jnp.asarray(rng.standard_normal((16, 3)), jnp.float32),
            "y": jnp.asarray(rng.standard_normal((16, 1)), jnp.float32),
        }
        key = jax.random.key(rng.integers(2**31))
        state, (loss, kept) = dp.step(state, batch, key)
        expected_params, expected_state, expected_kept = reference_step(
            expected_params, expected_state, batch, key, average_model_state
        )
        np.testing.assert_allclose(state.params["w"], expected_params["w"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state.model_state["mean"], expected_state["mean"], rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(state.model_state["count"], expected_state["count"])
        np.testing.assert_allclose(kept, expected_kept, rtol=1e-6)
    if not average_model_state:
        rows = np.asarray(state.model_state["mean"])
        assert rows.shape == (RANKS, 3) and not np.allclose(rows[0], rows[1])


def test_flax_train_state_in_and_out():
    class State(train_state.TrainState):
        batch_stats: dict

    def loss_fn(params, batch, model_state):
        loss = jnp.mean((batch["x"] @ params["w"]) ** 2)
        return loss, {"mean": 0.5 * model_state["mean"] + 0.5 * jnp.mean(batch["x"])}

    params = {"w": jnp.ones((2, 1), jnp.float32)}
    state = State.create(apply_fn=None, params=params, tx=optax.sgd(LR), batch_stats={"mean": jnp.float32(0)})
    dp = DataParallel(loss_fn, state.tx, GradientAllReduce(), mesh=mesh())
    state = dp.init(state)
    x = np.arange(16, dtype=np.float32).reshape(8, 2) / 16
    state, loss = dp.step(state, {"x": x})
    assert isinstance(state, State) and int(state.step) == 1 and state.params["w"].shape == (2, 1)
    expected_grad = 2 * x.T @ (x @ np.ones((2, 1))) / 8  # the mean over ranks of each rank's mean
    np.testing.assert_allclose(state.params["w"], 1 - LR * expected_grad, rtol=1e-5)
    np.testing.assert_allclose(state.batch_stats["mean"], 0.5 * x.mean(), rtol=1e-6)
    assert np.ndim(loss) == 0


def test_replicas_that_may_differ_keep_their_device_axis():
    dp = DataParallel(lambda p, b: jnp.sum(p["w"] * b["x"]), optax.sgd(LR), Decentralized(), mesh=mesh())
    state = dp.init({"w": np.zeros(3, np.float32)})
    assert state.params["w"].shape == (RANKS, 3)
    assert isinstance(state, TrainState)


def test_an_algorithm_by_name_steps_as_the_pipeline_reference(rng):
    """``DataParallel(loss, tx, "bytegrad")`` builds ByteGrad with its defaults; each step of SGD with momentum at
    flax's MNIST rate equals the NumPy pipeline (each rank's gradient, 8-bit exchange, same momentum) to float32
    rounding."""
    w0 = rng.standard_normal((6, 3)).astype(np.float32)

    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    dp = DataParallel(loss_fn, optax.sgd(LR, 0.9), "bytegrad", mesh=mesh())
    assert type(dp.algorithm).__name__ == "ByteGrad"
    state = dp.init({"w": w0})
    params, velocity = {"w": jnp.asarray(w0)}, jnp.zeros(w0.size, jnp.float32)
    for _ in range(4):
        batch = {k: rng.standard_normal((16, d)).astype(np.float32) for k, d in (("x", 6), ("y", 3))}
        grads = [
            np.asarray(
                ravel_pytree(jax.grad(loss_fn)(params, jax.tree.map(lambda a: a[r * 4 : (r + 1) * 4], batch)))[0]
            )
            for r in range(RANKS)
        ]
        padded = [np.concatenate([g, np.zeros(-g.size % RANKS, np.float32)]) for g in grads]
        reduced, _ = bytegrad_bucket(padded, None, local=None, average=True)
        velocity = jnp.asarray(reduced[: w0.size]) + 0.9 * velocity
        params = {"w": params["w"] - LR * velocity.reshape(w0.shape)}
        state, _ = dp.step(state, batch)
        np.testing.assert_allclose(state.params["w"], params["w"], rtol=0, atol=4 * np.spacing(np.float32(10)))


def test_params_view_gives_one_model_whatever_the_algorithm(rng):
    """Decentralized parameters carry a rank axis on the mesh; ``params_view`` gives the mean or rank 0's row,
    shaped as the model's, and gradient allreduce's parameters as they are."""

    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"]) ** 2)

    w0 = rng.standard_normal((3, 2)).astype(np.float32)
    batch = {"x": rng.standard_normal((16, 3)).astype(np.float32)}
    dp = DataParallel(loss_fn, optax.sgd(LR), Decentralized(peer_selection_mode="shift_one"), mesh=mesh())
    state, _ = dp.step(dp.init({"w": w0}), batch)
    rows = np.asarray(state.params["w"])
    assert rows.shape == (RANKS, 3, 2) and not np.allclose(rows[0], rows[1])
    np.testing.assert_allclose(dp.params_view(state)["w"], rows.astype(np.float64).mean(0), rtol=1e-6)
    np.testing.assert_array_equal(dp.params_view(state, "rank0")["w"], rows[0])
    allreduce = DataParallel(loss_fn, optax.sgd(LR), GradientAllReduce(), mesh=mesh())
    shared = allreduce.init({"w": w0})
    assert allreduce.params_view(shared)["w"] is shared.params["w"]
    with pytest.raises(ValueError, match="view must be 'average' or 'rank0'"):
        dp.params_view(state, "median")


def test_bad_flags_and_states_raise():
    with pytest.raises(ValueError, match="qadam is an optimizer itself and needs learning_rate"):
        DataParallel(lambda p, b: 0.0, None, "qadam", mesh=mesh())
    with pytest.raises(TypeError, match="has_aux must be a bool"):
        DataParallel(lambda p, b: 0.0, optax.sgd(LR), GradientAllReduce(), mesh=mesh(), has_aux=1)
    dp = DataParallel(lambda p, b: jnp.sum(p["w"]), optax.sgd(LR), GradientAllReduce(), mesh=mesh())
    with pytest.raises(TypeError, match="what init\\(\\) returned"):
        dp.step({"w": np.zeros(2, np.float32)}, {"x": np.zeros((4, 1), np.float32)})


@pytest.mark.parametrize("compiled_first", [True, False], ids=["compiled", "not-compiled"])
def test_compile_ahead_leaves_the_first_step_nothing_to_compile(rng, compiled_first):
    """``DataParallel.compile`` compiles the step without running it: the first step then compiles nothing (without
    it, that step compiles), and steps as a trainer that never compiled ahead does."""

    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)

    batch = {k: rng.standard_normal((16, d)).astype(np.float32) for k, d in (("x", 6), ("y", 3))}
    params = {"w": rng.standard_normal((6, 3)).astype(np.float32)}
    dp, plain = (DataParallel(loss_fn, optax.sgd(LR), "gradient_allreduce", mesh=mesh()) for _ in range(2))
    state = dp.init(params)
    compiles: list[str] = []

    def record(event: str, seconds: float, **_) -> None:
        if event.endswith("backend_compile_duration"):
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        if compiled_first:
            dp.compile(state, batch)
            compiles.clear()
        stepped, _ = dp.step(state, batch)
        jax.block_until_ready(stepped)
    finally:
        jax.monitoring.unregister_event_duration_listener(record)
    assert (compiles == []) == compiled_first, compiles
    expected, _ = plain.step(plain.init(params), batch)
    np.testing.assert_array_equal(stepped.params["w"], expected.params["w"])

"""bagua_jax.step_means: the step's means carried in the smallest float32 bucket, against NumPy, and the bucket
built with their room (not padded once finished, which XLA's CPU backend turns into a reduction per element)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bagua_jax.bucketing import plan_buckets
from bagua_jax.step_means import StepMeans


def _mlp(rng: np.random.Generator, widths: list[int]) -> list[jax.Array]:
    params = []
    for fan_in, fan_out in zip(widths, widths[1:]):
        params += [jnp.asarray(rng.standard_normal((fan_in, fan_out), np.float32) * 0.05), jnp.zeros(fan_out)]
    return params


def _loss(params: list[jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    h = x
    for i in range(0, len(params), 2):
        h = h @ params[i] + params[i + 1]
        h = jax.nn.relu(h) if i + 2 < len(params) else h
    return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()


def _step(bucket_bytes: int):
    """The gradients of an MLP averaged by a stand-in for the world's mean (halving, exact), the loss carried
    with them: the averaged buckets and the tree of means."""

    def step(params, x, y):
        loss, grads = jax.value_and_grad(_loss)(params, x, y)
        means = StepMeans({"loss": loss, "count": jnp.int32(7)})
        averaged = means.averaged_with(plan_buckets(grads, bucket_bytes), grads, lambda bucket: bucket * 0.5)
        return averaged, means.result(None)

    return step


def test_the_values_ride_at_the_end_of_the_smallest_float32_bucket(rng):
    params = _mlp(rng, [12, 8, 5])
    x, y = jnp.asarray(rng.standard_normal((6, 12), np.float32)), jnp.asarray(rng.integers(0, 5, 6))
    averaged, result = jax.jit(_step(bucket_bytes=400))(params, x, y)
    loss, grads = jax.jit(jax.value_and_grad(_loss))(params, x, y)
    # the 12x8 weights alone in the first bucket; 8 + 40 + 5 floats in the second, the smaller: it carries the loss
    flat = [np.concatenate([np.ravel(g) for g in leaves]) for leaves in (grads[:1], grads[1:])]
    assert [a.shape for a in averaged] == [(96,), (53,)]
    for got, expected in zip(averaged, flat):
        np.testing.assert_array_equal(np.asarray(got), expected * np.float32(0.5))
    assert float(result["loss"]) == np.float32(loss) * np.float32(0.5) and int(result["count"]) == 7


def test_the_carrier_bucket_is_built_with_the_room_for_the_values(rng):
    """Copied into a longer buffer once finished, the bucket was padded and XLA fused the pad with its last
    slice update, the output layer's bias gradient: that reduction over the batch then ran once per element of
    the bucket (17x the step of the network study's MLP, 4 ranks of the MPI engine)."""
    params = _mlp(rng, [3072, 512, 512, 10])
    x, y = jnp.asarray(rng.standard_normal((32, 3072), np.float32)), jnp.asarray(rng.integers(0, 10, 32))
    hlo = jax.jit(_step(bucket_bytes=10 << 20)).lower(params, x, y).compile().as_text()
    fusions = re.findall(r"\n(%fused_computation[^\n]*\{\n(?:[^\n]*\n)*?\})", hlo)
    assert fusions
    assert not [f.splitlines()[0] for f in fusions if " pad(" in f and " reduce(" in f]

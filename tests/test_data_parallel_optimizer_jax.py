"""``data_parallel_optimizer`` and ``rank_slice``, the two calls that make a user's own train step data-parallel.

conftest.py forces four simulated CPU devices; the optimizer runs under ``shard_map`` over them with a
:class:`LaxCommunicator` and is checked against the mean of the ranks' gradients in NumPy. ``rank_slice``
is checked against NumPy slicing on a stand-in communicator that only tells rank and size.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from bagua_jax import LaxCommunicator, data_parallel_optimizer, rank_slice

RANKS, LR = 4, 0.1


@dataclass
class RankOnly:
    """The part of a communicator ``rank_slice`` reads."""

    rank_index: int
    size: int

    def rank(self):
        return jnp.int32(self.rank_index)


def test_an_optimizer_by_name_averages_the_ranks_gradients(rng):
    grads = rng.standard_normal((RANKS, 5)).astype(np.float32)
    params = rng.standard_normal(5).astype(np.float32)
    tx = data_parallel_optimizer(optax.sgd(LR), "gradient_allreduce", LaxCommunicator("ranks", RANKS))

    def per_rank(g):
        updates, _ = tx.update(g[0], tx.init(params), params)
        return optax.apply_updates(params, updates)[None]

    mesh = Mesh(np.array(jax.devices()[:RANKS]), ("ranks",))
    out = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("ranks"), out_specs=P("ranks")))(grads)
    expected = params - LR * grads.astype(np.float64).mean(0)
    for row in np.asarray(out):
        np.testing.assert_allclose(row, expected, rtol=0, atol=4 * np.spacing(np.float32(np.abs(expected).max())))


def test_rank_slice_takes_this_ranks_equal_part_of_every_leaf(rng):
    batch = {"image": rng.standard_normal((8, 3)).astype(np.float32), "label": np.arange(8)}
    for rank in range(RANKS):
        part = rank_slice(batch, RankOnly(rank, RANKS))
        np.testing.assert_array_equal(part["image"], batch["image"][2 * rank : 2 * rank + 2])
        np.testing.assert_array_equal(part["label"], [2 * rank, 2 * rank + 1])
    images, labels = rank_slice((batch["image"], batch["label"]), RankOnly(3, RANKS))
    np.testing.assert_array_equal(labels, [6, 7])
    with pytest.raises(ValueError, match="a batch of 6 does not split evenly across 4 ranks"):
        rank_slice({"x": np.zeros((6, 2))}, RankOnly(0, RANKS))

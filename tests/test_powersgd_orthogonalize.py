"""Both front ends' batched orthogonalization against the float64 NumPy Gram-Schmidt, matrix by matrix.

The batch mixes heights (so the zero padding is exercised) and ranks, and holds a
zero column, which must stay zero. Tolerance: float32 Gram-Schmidt on at most four columns of
at most 40 rows stays within 1e-5 of the orthonormal result; padding that leaked into a
product, or a batch dimension mixed up, is off by order one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import torch
from powersgd_reference import gram_schmidt

from bagua_jax.algorithms.powersgd import orthogonalize_all as orthogonalize_all_jax
from bagua_torch.algorithms.powersgd import orthogonalize_all as orthogonalize_all_torch

SHAPES = [(7, 3), (40, 4), (1, 1), (13, 2), (9, 4), (30, 4), (8, 2)]


def random_ps(rng) -> list[np.ndarray]:
    ps = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    ps[3][:, 1] = 0  # a zero gradient's column
    return ps


def check(ps: list[np.ndarray], got: list[np.ndarray]) -> None:
    assert len(got) == len(ps)
    for p, q in zip(ps, got):
        np.testing.assert_allclose(q, gram_schmidt(p.astype(np.float64)), atol=1e-5)


def test_torch_batch_matches_gram_schmidt_per_matrix(rng):
    ps = random_ps(rng)
    inputs = [torch.from_numpy(p.copy()) for p in ps]
    got = orthogonalize_all_torch(inputs)
    check(ps, [q.numpy() for q in got])
    assert all(np.array_equal(t.numpy(), p) for t, p in zip(inputs, ps)), "the inputs were modified"


def test_jax_batch_matches_gram_schmidt_per_matrix(rng):
    ps = random_ps(rng)
    # Under jit, as the algorithm's step runs it (op by op, each small op compiles on its own: 5 s).
    check(ps, [np.asarray(q) for q in jax.jit(orthogonalize_all_jax)([jnp.asarray(p) for p in ps])])

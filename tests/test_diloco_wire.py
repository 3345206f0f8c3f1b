"""DiLoCo's outer-gradient exchange sends the same bytes from JAX and torch (bagua_common.algorithms.outer_exchange).

One rank of four is played by a recording communicator in each front end: it keeps the bytes of
every buffer handed to a collective and answers with data of the right shape (its own rows), so
the second stage's payload depends on the first's result too. The same float32 pseudo-gradient
and residual go through both front ends' exchanges; every payload, the results and the new
residuals must be equal bit for bit.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from bagua_jax.algorithms.diloco import EXCHANGE as JAX_EXCHANGE
from bagua_torch.algorithms.diloco import EXCHANGE as TORCH_EXCHANGE

RANKS = 4


class Recorder:
    """One rank of ``size``: records each payload's bytes; alltoall and allreduce answer the payload, allgather
    ``size`` copies of it."""

    def __init__(self, to_bytes, stack) -> None:
        self.size, self.sent, self._to_bytes, self._stack = RANKS, [], to_bytes, stack

    def _record(self, name: str, x):
        self.sent.append((name, self._to_bytes(x)))
        return x

    def allreduce(self, x, op="sum"):
        return self._record(f"allreduce {op}", x)

    def alltoall(self, x):
        return self._record("alltoall", x)

    def allgather(self, x):
        return self._stack([self._record("allgather", x)] * self.size)


def jax_bytes(x) -> bytes:
    return np.asarray(x).view(np.uint8).tobytes()


def torch_bytes(x) -> bytes:
    return x.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    "wire, feedback",
    [
        ("fp32", False),
        ("bf16", False),
        ("bf16", True),
        ("uint8", False),
        ("uint8", True),
        ("uint4", False),
        ("uint4", True),
    ],
)
def test_jax_and_torch_send_the_same_bytes(wire, feedback, rng):
    n = RANKS * int(rng.integers(40, 400))
    flat = (rng.standard_normal(n) * 10.0 ** rng.uniform(-4, 2)).astype(np.float32)
    flat[rng.integers(n, size=5)] = 0.0
    residual = (rng.standard_normal(n) * 1e-3).astype(np.float32) if feedback else None
    jax_comm, torch_comm = Recorder(jax_bytes, jnp.stack), Recorder(torch_bytes, torch.stack)
    jax_mean, jax_residual = JAX_EXCHANGE.average(
        jnp.asarray(flat), jax_comm, wire, None if residual is None else jnp.asarray(residual)
    )
    torch_mean, torch_residual = TORCH_EXCHANGE.average(
        torch.from_numpy(flat.copy()), torch_comm, wire, None if residual is None else torch.from_numpy(residual.copy())
    )
    assert [name for name, _ in jax_comm.sent] == [name for name, _ in torch_comm.sent]
    assert len(jax_comm.sent) == (1 if wire == "fp32" else 2)
    for (name, mine), (_, theirs) in zip(jax_comm.sent, torch_comm.sent):
        assert mine == theirs, f"{wire}: the {name} payloads differ"
    np.testing.assert_array_equal(np.asarray(jax_mean), torch_mean.numpy())
    if feedback:
        np.testing.assert_array_equal(np.asarray(jax_residual), torch_residual.numpy())
        assert np.any(np.asarray(jax_residual) != residual)  # the residual was updated

"""Every PyTorch algorithm trains an MLP on digits about as well as one process does; and the
torch and JAX front ends compress the same input to the same bytes.

Convergence: one job of 4 gloo processes (2 nodes x 2 ranks, so hierarchical algorithms use
both levels; see convergence_workers_torch.py) trains a fresh 64-32-10 MLP per algorithm
variant for 300 steps of a 128-example global batch (32 per rank). The single-process
baseline is ``torch.optim.Adam`` (lr 3e-3) on the same global batches from the same
initialization. The margin (5 accuracy points) is the JAX convergence test's: what
communication relaxation (compression, decentralized averaging, local steps between
asynchronous rounds) may cost on this task; in practice the variants land within about 2
points. Each rank's own model is evaluated, since decentralized and asynchronous replicas
differ slightly.
"""

from __future__ import annotations

import digits
import ml_dtypes
import numpy as np
import pytest
import torch
from convergence_workers_torch import LR, MLP, VARIANTS, accuracy, global_batches
from multiprocess import run_ranks
from torch import nn

from bagua_torch import ops as torch_ops
from bagua_torch.algorithms import REGISTRY

MARGIN = 0.05
NRANKS = 4
_cache: dict[str, dict] = {}


def job() -> list[dict]:
    """All runnable variants in one 4-process job, run once per session; per-rank values sorted by rank."""
    if "job" not in _cache:
        results = run_ranks("convergence_workers_torch:job", NRANKS, list(VARIANTS), timeout=300)
        _cache["job"] = sorted((r.value for r in results), key=lambda v: v["rank"])
    return _cache["job"]


@pytest.fixture(scope="module")
def baseline() -> float:
    """Test accuracy of single-process Adam on the same global batches, same initialization."""
    torch.manual_seed(0)
    _, _, x_test, y_test = digits.load()
    model = MLP()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for batch in global_batches():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(torch.from_numpy(batch["x"])), torch.from_numpy(batch["y"]).long())
        loss.backward()
        opt.step()
    return accuracy(model, x_test, y_test)


def test_every_builtin_algorithm_has_a_variant():
    assert {algorithm for algorithm, _ in VARIANTS.values()} == set(REGISTRY.names())


@pytest.mark.parametrize("name", VARIANTS)
def test_algorithm_converges_like_one_process(name, baseline):
    results = job()
    assert all(res["hierarchical"] for res in results)  # the 2 x 2 layout: hierarchical variants use two levels
    per_rank = [res[name]["accuracy"] for res in results]
    assert baseline > 0.9, baseline  # the task is learnt at all
    assert min(per_rank) >= baseline - MARGIN, (per_rank, baseline)
    for res in results:
        assert res[name]["loss_last"] < 0.5 * res[name]["loss_first"], res[name]
    if name == "async":
        rounds = {res[name]["rounds"] for res in results}
        assert len(rounds) == 1 and rounds.pop() >= 1, [res[name]["rounds"] for res in results]  # it did average


# ---- same kernels, same bytes ------------------------------------------------------------------


class _Torch:
    """The ByteGrad kernels through bagua_torch.ops, on NumPy in and out."""

    @staticmethod
    def array(x: np.ndarray):
        if x.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16)
        return torch.from_numpy(x.copy())

    @staticmethod
    def numpy(t) -> np.ndarray:
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
        return t.numpy().copy()

    def compress(self, x, k, residual=None):
        if residual is None:
            return self.numpy(torch_ops.minmax_uint8_compress(self.array(x), k)), None
        packed, r = torch_ops.minmax_uint8_compress_ef(self.array(x), self.array(residual), k)
        return self.numpy(packed), self.numpy(r)

    def decompress_reduce(self, packed, m, k):
        return self.numpy(torch_ops.minmax_uint8_decompress_reduce(self.array(packed), m, k, average=True))

    def decompress(self, packed, n, k, dtype):
        torch_dtype = torch.bfloat16 if dtype == ml_dtypes.bfloat16 else torch.float32
        return self.numpy(torch_ops.minmax_uint8_decompress(self.array(packed), n, k, torch_dtype))


class _Jax:
    """The ByteGrad kernels through bagua_jax.ops, on NumPy in and out."""

    def __init__(self):
        import jax.numpy as jnp

        from bagua_jax import ops

        self.ops, self.jnp = ops, jnp

    def compress(self, x, k, residual=None):
        if residual is None:
            return np.asarray(self.ops.minmax_uint8_compress(self.jnp.asarray(x), k)), None
        packed, new_residual = self.ops.minmax_uint8_compress_ef(self.jnp.asarray(x), self.jnp.asarray(residual), k)
        return np.asarray(packed), np.asarray(new_residual)

    def decompress_reduce(self, packed, m, k):
        return np.asarray(self.ops.minmax_uint8_decompress_reduce(self.jnp.asarray(packed), m, k, average=True))

    def decompress(self, packed, n, k, dtype):
        return np.asarray(self.ops.minmax_uint8_decompress(self.jnp.asarray(packed), n, k, dtype))


def bytegrad_step(kernels, buckets: list[np.ndarray], residuals: list[np.ndarray] | None) -> dict:
    """One ByteGrad step of ``n = len(buckets)`` ranks, simulated in one process: every rank compresses its
    bucket into n chunks (with error feedback if ``residuals``), the all-to-all hands slot r's chunks to
    rank r, which decodes and averages them and compresses the average as one chunk, the allgather hands
    all of those to everyone, who decodes them. Returns every intermediate buffer."""
    n = len(buckets)
    size = buckets[0].size
    m = size // n
    first = [kernels.compress(b, n, None if residuals is None else residuals[r]) for r, b in enumerate(buckets)]
    packed = [p for p, _ in first]
    chunk_bytes = packed[0].size // n
    received = [
        np.concatenate([packed[src][r * chunk_bytes : (r + 1) * chunk_bytes] for src in range(n)]) for r in range(n)
    ]
    reduced = [kernels.decompress_reduce(received[r], m, n) for r in range(n)]
    second = [kernels.compress(reduced[r], 1)[0] for r in range(n)]
    gathered = np.concatenate(second)
    return {
        "packed": packed,
        "residuals": [res for _, res in first],
        "reduced": reduced,
        "second": second,
        "result": kernels.decompress(gathered, size, n, buckets[0].dtype),
    }


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "error_feedback"])
def test_torch_and_jax_compress_a_bytegrad_step_to_identical_bytes(rng, dtype, error_feedback):
    n, size = NRANKS, NRANKS * 1000 + 4  # chunks of 1001 elements: not a multiple of anything convenient
    scale = 10.0 ** rng.uniform(-3, 3)
    buckets = [(rng.standard_normal(size) * scale * (1 + r)).astype(dtype) for r in range(n)]
    buckets[1][:7] = 0  # a run of equal values, and a constant chunk
    buckets[2][size // n : 2 * size // n] = buckets[2][size // n]
    residuals = (
        [(rng.standard_normal(size) * scale * 1e-2).astype(np.float32) for _ in range(n)] if error_feedback else None
    )
    from_torch = bytegrad_step(_Torch(), buckets, residuals)
    from_jax = bytegrad_step(_Jax(), buckets, residuals)
    for r in range(n):
        assert from_torch["packed"][r].dtype == np.uint8
        assert from_torch["packed"][r].tobytes() == from_jax["packed"][r].tobytes(), f"rank {r}'s n-chunk codes"
        if error_feedback:
            assert from_torch["residuals"][r].tobytes() == from_jax["residuals"][r].tobytes(), f"rank {r}'s residual"
        assert from_torch["reduced"][r].tobytes() == from_jax["reduced"][r].tobytes(), f"slot {r}'s average"
        assert from_torch["second"][r].tobytes() == from_jax["second"][r].tobytes(), f"slot {r}'s one-chunk codes"
    assert from_torch["result"].dtype == from_jax["result"].dtype == np.dtype(dtype)
    assert from_torch["result"].tobytes() == from_jax["result"].tobytes()
    # And it is an average: within two quantization steps of the exact mean of what was compressed.
    inputs = np.stack(
        [b.astype(np.float32) + (0 if residuals is None else residuals[r]) for r, b in enumerate(buckets)]
    )
    spread = inputs.max() - inputs.min()
    np.testing.assert_allclose(
        from_torch["result"].astype(np.float32),
        inputs.mean(0),
        atol=spread / 254 * 1.01 + 1e-6,
        rtol=1e-2 if dtype == ml_dtypes.bfloat16 else 0,
    )

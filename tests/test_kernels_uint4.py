"""The 4-bit min-max codec (MinMaxUInt4) through both front ends against the NumPy reference.

Same grid as the 8-bit codec with 14 steps between a chunk's minimum and maximum (16 codes, two per
byte): the bytes must equal the reference's from JAX and torch alike, decoding must stay within
``(hi - lo) / 28`` plus float32 rounding, exact zeros must decode to exact zeros.
"""

import kernels_reference as ref
import ml_dtypes
import numpy as np
import pytest
from algorithms_reference import minmax_allreduce
from conftest import random_values

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]


class FrontEnd:
    """One front end's 4-bit kernels on NumPy arrays in and out."""

    def __init__(self, name: str) -> None:
        self.name = name
        if name == "jax":
            from bagua_jax import ops

            self.dtypes = {d: d for d in DTYPES}
        else:
            import torch

            from bagua_torch import ops

            self.torch = torch
            self.dtypes = {np.float32: torch.float32, np.float16: torch.float16, ml_dtypes.bfloat16: torch.bfloat16}
        self.ops = ops

    def _in(self, a: np.ndarray):
        if self.name == "jax":
            return a
        if a.dtype == ml_dtypes.bfloat16:
            return self.torch.from_numpy(a.view(np.int16).copy()).view(self.torch.bfloat16)
        return self.torch.from_numpy(a.copy())

    def _out(self, t) -> np.ndarray:
        if self.name == "jax":
            return np.asarray(t)
        if t.dtype == self.torch.bfloat16:
            return t.view(self.torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()

    def compress(self, x: np.ndarray, k: int) -> np.ndarray:
        return self._out(self.ops.minmax_uint4_compress(self._in(x), k))

    def compress_ef(self, x: np.ndarray, residual: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        packed, new = self.ops.minmax_uint4_compress_ef(self._in(x), self._in(residual), k)
        return self._out(packed), self._out(new)

    def decompress(self, packed: np.ndarray, n: int, k: int, dtype=np.float32) -> np.ndarray:
        return self._out(self.ops.minmax_uint4_decompress(self._in(packed), n, k, self.dtypes[dtype]))

    def decompress_reduce(self, packed: np.ndarray, m: int, k: int, average: bool, dtype=np.float32) -> np.ndarray:
        reduce = self.ops.minmax_uint4_decompress_reduce
        return self._out(reduce(self._in(packed), m, k, average=average, dtype=self.dtypes[dtype]))


@pytest.fixture(scope="module", params=["jax", "torch"])
def front_end(request) -> FrontEnd:
    return FrontEnd(request.param)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("n", [1, 7919, 300_007])
def test_roundtrip_matches_reference_within_the_bound(front_end, rng, n, k, dtype):
    x = random_values(rng, n).astype(dtype)
    expected, _ = ref.minmax_compress(x, k, bits=4)
    packed = front_end.compress(x, k)
    assert (
        packed.size == ref.compressed_size(n, k, "minmax_uint4") == front_end.ops.compressed_size(n, k, "minmax_uint4")
    )
    np.testing.assert_array_equal(packed, expected)
    decoded = front_end.decompress(packed, n, k, dtype)
    np.testing.assert_array_equal(decoded, ref.minmax_decompress(expected, n, k, bits=4).astype(dtype))
    ref.assert_within_minmax_bound(x, front_end.decompress(packed, n, k), k, bits=4)


def test_jax_and_torch_give_the_same_bytes(rng):
    x = random_values(rng, 100_003)
    e = random_values(rng, x.size) * np.float32(0.01)
    jax_end, torch_end = FrontEnd("jax"), FrontEnd("torch")
    for k in (1, 4):
        np.testing.assert_array_equal(jax_end.compress(x, k), torch_end.compress(x, k))
        for a, b in zip(jax_end.compress_ef(x, e, k), torch_end.compress_ef(x, e, k)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("k", [1, 3])
def test_error_feedback_residual_is_exact(front_end, rng, k):
    x, e = random_values(rng, 50_001), random_values(rng, 50_001) * np.float32(0.1)
    expected, expected_residual = ref.minmax_compress(x, k, e, bits=4)
    packed, residual = front_end.compress_ef(x, e, k)
    np.testing.assert_array_equal(packed, expected)
    np.testing.assert_array_equal(residual, expected_residual)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("average", [True, False])
def test_decompress_reduce_matches_reference(front_end, rng, average, dtype):
    m, k = 10_007, 3  # odd m: each buffer's last byte holds one code
    buffers = np.concatenate([ref.minmax_compress(random_values(rng, m), 1, bits=4)[0] for _ in range(k)])
    out = front_end.decompress_reduce(buffers, m, k, average, dtype)
    np.testing.assert_array_equal(out, ref.decompress_reduce(buffers, m, k, "minmax_uint4", average).astype(dtype))


def test_exact_zeros_decode_to_exact_zeros(front_end, rng):
    # Every chunk's range holds 0, asymmetrically (where a grid from lo would miss 0).
    x = (random_values(rng, 30_001) * np.float32(3) + np.float32(0.7)).astype(np.float32)
    x[rng.random(x.size) < 0.3] = 0
    for k in (1, 3, 8):
        packed = front_end.compress(x, k)
        np.testing.assert_array_equal(packed, ref.minmax_compress(x, k, bits=4)[0])
        decoded = front_end.decompress(packed, x.size, k)
        assert np.all(decoded[x == 0] == 0)
        ref.assert_within_minmax_bound(x, decoded, k, bits=4)
        _, residual = front_end.compress_ef(x, np.zeros(x.size, np.float32), k)
        assert np.all(residual[x == 0] == 0)


def test_chunks_of_one_sign_use_a_grid_from_their_minimum(front_end, rng):
    x = np.abs(random_values(rng, 9_001)) + np.float32(0.5)
    for sign in (1, -1):
        y = (x * np.float32(sign)).astype(np.float32)
        packed = front_end.compress(y, 3)
        np.testing.assert_array_equal(packed, ref.minmax_compress(y, 3, bits=4)[0])
        decoded = front_end.decompress(packed, y.size, 3)
        for b, e in ref.chunk_bounds(y.size, 3):
            assert decoded[b:e].min() == y[b:e].min()  # code 0 decodes to lo exactly
        ref.assert_within_minmax_bound(y, decoded, 3, bits=4)


def test_constant_empty_and_nonfinite_chunks(front_end, rng):
    x = np.repeat(np.array([3.25, -1e-3, 0.0, 7e5], np.float32), [5, 5, 5, 4])
    np.testing.assert_array_equal(front_end.decompress(front_end.compress(x, 4), x.size, 4), x)
    tiny = random_values(rng, 5)
    packed = front_end.compress(tiny, 8)  # chunks of 1 element; chunks 5..7 are empty
    assert packed.size == 5 * 32 + 3 * 16
    np.testing.assert_array_equal(packed, ref.minmax_compress(tiny, 8, bits=4)[0])
    for bad in (np.nan, np.inf):
        y = random_values(rng, 301)
        y[150] = bad  # chunk 1 of 3
        decoded = front_end.decompress(front_end.compress(y, 3), y.size, 3)
        assert not np.isfinite(decoded[101:202]).any()
        assert np.isfinite(decoded[:101]).all() and np.isfinite(decoded[202:]).all()


def test_bad_inputs_raise_clear_errors(front_end):
    with pytest.raises(ValueError, match="expected 64"):  # 2 slots: 16-byte header, 10 bytes padded to 16
        front_end.decompress(np.zeros(47, np.uint8), 40, 2)
    with pytest.raises(ValueError, match="chunk count"):
        front_end.compress(np.ones(10, np.float32), 0)


@pytest.mark.parametrize("error_feedback", [False, True])
def test_the_shared_compressed_allreduce_carries_4_bit_codes(rng, error_feedback):
    """``codec="minmax_uint4"`` swaps the codes of the ByteGrad pipeline (4 ranks under ``shard_map``)."""
    import jax
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from bagua_jax import LaxCommunicator
    from bagua_jax.compressed_allreduce import PIPELINES

    n, size = 4, 4 * 1001
    xs = np.stack([random_values(rng, size) for _ in range(n)])
    residuals = np.stack([random_values(rng, size) * np.float32(0.01) for _ in range(n)])
    comm = LaxCommunicator("ranks", n)

    def rank(x, residual):
        result, new = PIPELINES.minmax_allreduce(
            x[0], comm, residual=residual[0] if error_feedback else None, codec="minmax_uint4"
        )
        return result[None], (residual if new is None else new[None])

    mesh = Mesh(np.array(jax.devices()[:n]), ("ranks",))
    run = jax.jit(jax.shard_map(rank, mesh=mesh, in_specs=(P("ranks"), P("ranks")), out_specs=P("ranks")))
    results, new_residuals = (np.asarray(a) for a in run(xs, residuals))
    expected, expected_residuals = minmax_allreduce(list(xs), list(residuals) if error_feedback else None, True, bits=4)
    for r in range(n):
        np.testing.assert_array_equal(results[r], expected, err_msg=f"rank {r}")
        if error_feedback:
            np.testing.assert_array_equal(new_residuals[r], expected_residuals[r], err_msg=f"rank {r}")

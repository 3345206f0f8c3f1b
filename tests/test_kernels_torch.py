"""The native kernels through bagua_torch.ops: same bytes as JAX, same numerics as NumPy."""

import kernels_reference as ref
import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import random_values

from bagua_torch import ops

TORCH_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: ml_dtypes.bfloat16}


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def from_numpy(a: np.ndarray) -> torch.Tensor:
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("k", [1, 3, 8])
def test_torch_and_jax_compress_to_identical_bytes(rng, dtype, k):
    import jax  # noqa: F401  (only this test needs both front ends)

    from bagua_jax import ops as jops

    x = random_values(rng, 100_003).astype(TORCH_DTYPES[dtype])
    e = random_values(rng, x.size) * np.float32(0.01)
    pairs = [
        (ops.minmax_uint8_compress(from_numpy(x), k), jops.minmax_uint8_compress(x, k)),
        (ops.sign_compress(from_numpy(x), k), jops.sign_compress(x, k)),
        (
            ops.minmax_uint8_compress_ef(from_numpy(x), torch.from_numpy(e.copy()), k)[0],
            jops.minmax_uint8_compress_ef(x, e, k)[0],
        ),
        (ops.sign_compress_ef(from_numpy(x), torch.from_numpy(e.copy()), k)[0], jops.sign_compress_ef(x, e, k)[0]),
    ]
    for from_torch, from_jax in pairs:
        np.testing.assert_array_equal(from_torch.numpy(), np.asarray(from_jax))


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_minmax_roundtrip_matches_reference(rng, dtype):
    n, k = 65_537, 3
    x = random_values(rng, n).astype(TORCH_DTYPES[dtype])
    expected, _ = ref.minmax_compress(x, k)
    compressed = ops.minmax_uint8_compress(from_numpy(x), k)
    np.testing.assert_array_equal(compressed.numpy(), expected)
    decoded = ops.minmax_uint8_decompress(compressed, n, k, dtype)
    assert decoded.dtype == dtype
    np.testing.assert_array_equal(to_numpy(decoded), ref.minmax_decompress(expected, n, k).astype(TORCH_DTYPES[dtype]))


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_exact_zeros_decode_to_exact_zeros(rng, dtype):
    n, k = 40_000, 3
    x = (random_values(rng, n) * np.float32(3) + np.float32(0.7)).astype(TORCH_DTYPES[dtype])
    x[rng.random(n) < 0.3] = 0
    compressed = ops.minmax_uint8_compress(from_numpy(x), k)
    np.testing.assert_array_equal(compressed.numpy(), ref.minmax_compress(x, k)[0])
    decoded = ops.minmax_uint8_decompress(compressed, n, k, dtype)
    assert torch.all(decoded[torch.from_numpy(x.astype(np.float32) == 0)] == 0)
    residual = torch.zeros(n)
    ops.minmax_uint8_compress_ef(from_numpy(x), residual, k)
    assert torch.all(residual[torch.from_numpy(x.astype(np.float32) == 0)] == 0)


def test_error_feedback_updates_the_residual_in_place(rng):
    n, k = 10_007, 2
    x, e = random_values(rng, n), random_values(rng, n) * np.float32(0.01)
    residual = torch.from_numpy(e.copy())
    compressed, returned = ops.minmax_uint8_compress_ef(torch.from_numpy(x), residual, k)
    assert returned is residual
    expected, expected_residual = ref.minmax_compress(x, k, e)
    np.testing.assert_array_equal(compressed.numpy(), expected)
    np.testing.assert_array_equal(residual.numpy(), expected_residual)


def test_preallocated_outputs_are_filled(rng):
    n, k = 4_099, 4
    x = torch.from_numpy(random_values(rng, n))
    out = torch.empty(ops.compressed_size(n, k, "sign"), dtype=torch.uint8)
    assert ops.sign_compress(x, k, out=out) is out
    decoded = torch.empty(n)
    assert ops.sign_decompress(out, n, k, out=decoded) is decoded
    np.testing.assert_array_equal(decoded.numpy(), ref.sign_decompress(out.numpy(), n, k))
    buffers = torch.cat([ops.minmax_uint8_compress(torch.from_numpy(random_values(rng, n)), 1) for _ in range(k)])
    reduced = torch.empty(n, dtype=torch.bfloat16)
    ops.minmax_uint8_decompress_reduce(buffers, n, k, average=False, dtype=torch.bfloat16, out=reduced)
    expected = ref.decompress_reduce(buffers.numpy(), n, k, "minmax_uint8", average=False)
    np.testing.assert_array_equal(to_numpy(reduced), expected.astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_elementwise_helpers_match_reference(rng, dtype):
    shape = (37, 101)
    x, y, z, w = (random_values(rng, 37 * 101).reshape(shape).astype(TORCH_DTYPES[dtype]) for _ in range(4))
    tx, ty, tz, tw = map(from_numpy, (x, y, z, w))
    cases = [
        (ops.average2(tx, ty), ref.average2(x, y)),
        (ops.axpy(tx, ty, 0.25), ref.axpy(x, y, 0.25)),
        (ops.async_average(tx, ty, tz, 4), ref.async_average(x, y, z, 4)),
        (ops.lowprec_decentralized_diff(tx, ty, tz, tw), ref.lowprec_decentralized_diff(x, y, z, w)),
    ]
    for got, expected in cases:
        assert got.shape == shape and got.dtype == dtype
        np.testing.assert_array_equal(to_numpy(got), expected.astype(TORCH_DTYPES[dtype]))
    expected = ref.axpy(x, y, 2.0).astype(TORCH_DTYPES[dtype])
    ops.axpy(tx, ty, 2.0, out=tx)  # in place
    np.testing.assert_array_equal(to_numpy(tx), expected)


def test_bad_inputs_raise_clear_errors():
    x = torch.ones(10)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        ops.minmax_uint8_compress(torch.ones(10, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="at least 1"):
        ops.sign_compress(x, 0)
    with pytest.raises(ValueError, match="has 63 elements, expected 64"):
        ops.minmax_uint8_decompress(torch.zeros(63, dtype=torch.uint8), 10, 2)
    with pytest.raises(ValueError, match="out must be"):
        ops.minmax_uint8_compress(x, 2, out=torch.empty(5, dtype=torch.uint8))
    with pytest.raises(ValueError, match="share dtype and shape"):
        ops.average2(x, torch.ones(10, dtype=torch.float16))


def test_jax_arrays_are_never_written_through_dlpack():
    import _bagua_ffi
    import jax.numpy as jnp

    x = jnp.zeros(8, jnp.float32)
    with pytest.raises(TypeError, match="JAX arrays are immutable"):
        _bagua_ffi.average2(torch.ones(8), torch.ones(8), x)
    np.testing.assert_array_equal(np.asarray(x), np.zeros(8, np.float32))
    # Read-only inputs are fine: the kernel only reads them.
    out = torch.empty(8)
    _bagua_ffi.average2(x, jnp.full(8, 2.0, jnp.float32), out)
    np.testing.assert_array_equal(out.numpy(), np.ones(8, np.float32))


class _TorchKernels:
    """The ByteGrad kernels through bagua_torch.ops, on NumPy in and out."""

    def compress(self, x, k, residual=None):
        if residual is None:
            return ops.minmax_uint8_compress(from_numpy(x.copy()), k).numpy(), None
        packed, r = ops.minmax_uint8_compress_ef(from_numpy(x.copy()), from_numpy(residual.copy()), k)
        return packed.numpy(), to_numpy(r)

    def decompress_reduce(self, packed, m, k):
        return to_numpy(ops.minmax_uint8_decompress_reduce(torch.from_numpy(packed.copy()), m, k, average=True))

    def decompress(self, packed, n, k, dtype):
        torch_dtype = next(t for t, d in TORCH_DTYPES.items() if d == dtype)
        return to_numpy(ops.minmax_uint8_decompress(torch.from_numpy(packed.copy()), n, k, torch_dtype))


class _JaxKernels:
    """The ByteGrad kernels through bagua_jax.ops, on NumPy in and out."""

    def __init__(self):
        from bagua_jax import ops as jops

        self.ops = jops

    def compress(self, x, k, residual=None):
        if residual is None:
            return np.asarray(self.ops.minmax_uint8_compress(x, k)), None
        packed, new_residual = self.ops.minmax_uint8_compress_ef(x, residual, k)
        return np.asarray(packed), np.asarray(new_residual)

    def decompress_reduce(self, packed, m, k):
        return np.asarray(self.ops.minmax_uint8_decompress_reduce(packed, m, k, average=True))

    def decompress(self, packed, n, k, dtype):
        return np.asarray(self.ops.minmax_uint8_decompress(packed, n, k, dtype))


def bytegrad_step(kernels, buckets: list[np.ndarray], residuals: list[np.ndarray] | None) -> dict:
    """One ByteGrad step of ``n = len(buckets)`` ranks, simulated in one process: every rank compresses its
    bucket into n chunks (with error feedback if ``residuals``), the all-to-all hands slot r's chunks to
    rank r, which decodes and averages them and compresses the average as one chunk, the allgather hands
    all of those to everyone, who decodes them. Returns every intermediate buffer."""
    n, size = len(buckets), buckets[0].size
    first = [kernels.compress(b, n, None if residuals is None else residuals[r]) for r, b in enumerate(buckets)]
    packed = [p for p, _ in first]
    chunk_bytes = packed[0].size // n
    received = [np.concatenate([p[r * chunk_bytes : (r + 1) * chunk_bytes] for p in packed]) for r in range(n)]
    reduced = [kernels.decompress_reduce(received[r], size // n, n) for r in range(n)]
    second = [kernels.compress(reduced[r], 1)[0] for r in range(n)]
    return {
        "packed": packed,
        "residuals": [res for _, res in first],
        "reduced": reduced,
        "second": second,
        "result": kernels.decompress(np.concatenate(second), size, n, buckets[0].dtype),
    }


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("error_feedback", [False, True], ids=["plain", "error_feedback"])
def test_torch_and_jax_compress_a_bytegrad_step_to_identical_bytes(rng, dtype, error_feedback):
    n, size = 4, 4 * 1000 + 4  # chunks of 1001 elements: not a multiple of anything convenient
    scale = 10.0 ** rng.uniform(-3, 3)
    buckets = [(rng.standard_normal(size) * scale * (1 + r)).astype(dtype) for r in range(n)]
    buckets[1][:7] = 0  # a run of equal values, and a constant chunk
    buckets[2][size // n : 2 * size // n] = buckets[2][size // n]
    residuals = (
        [(rng.standard_normal(size) * scale * 1e-2).astype(np.float32) for _ in range(n)] if error_feedback else None
    )
    from_torch = bytegrad_step(_TorchKernels(), buckets, residuals)
    from_jax = bytegrad_step(_JaxKernels(), buckets, residuals)
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

"""The CUDA kernels against the NumPy reference and the CPU kernels (needs a GPU)."""

import kernels_reference as ref
import ml_dtypes
import numpy as np
import pytest
from conftest import random_values

jax = pytest.importorskip("jax")
from bagua_jax import build_info, ops  # noqa: E402


def _gpus():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not _gpus(), reason="needs a CUDA device visible to JAX"),
]

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]


@pytest.fixture
def gpu():
    assert build_info()["cuda"], "a GPU is present but bagua was built without CUDA kernels"
    with jax.default_device(_gpus()[0]):
        yield


@pytest.mark.parametrize("n", [1, 7919, 4_000_037])
@pytest.mark.parametrize("k", [1, 2, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_cuda_kernels_match_reference(gpu, rng, n, k, dtype):
    x = random_values(rng, n).astype(dtype)
    e = random_values(rng, n) * np.float32(0.01)

    expected, expected_residual = ref.minmax_compress(x, k, e)
    compressed, residual = ops.minmax_uint8_compress_ef(jax.device_put(x), jax.device_put(e), k)
    np.testing.assert_array_equal(np.asarray(compressed), expected)
    np.testing.assert_array_equal(np.asarray(residual), expected_residual)
    plain = np.asarray(ops.minmax_uint8_compress(jax.device_put(x), k))
    np.testing.assert_array_equal(plain, ref.minmax_compress(x, k)[0])
    np.testing.assert_array_equal(
        np.asarray(ops.minmax_uint8_decompress(jax.device_put(plain), n, k, dtype)),
        ref.minmax_decompress(plain, n, k).astype(dtype),
    )

    signs = np.asarray(ops.sign_compress(jax.device_put(x), k))
    expected_signs, _ = ref.sign_compress(x, k)
    np.testing.assert_array_equal(ref.chunk_bits(signs, n, k), ref.chunk_bits(expected_signs, n, k))
    np.testing.assert_allclose(ref.chunk_scales(signs, n, k), ref.chunk_scales(expected_signs, n, k), rtol=2e-6)
    np.testing.assert_array_equal(
        np.asarray(ops.sign_decompress(jax.device_put(signs), n, k, dtype)),
        ref.sign_decompress(signs, n, k).astype(dtype),
    )
    signs_ef, sign_residual = ops.sign_compress_ef(jax.device_put(x), jax.device_put(e), k)
    y = (x.astype(np.float32) + e).astype(np.float32)
    np.testing.assert_array_equal(
        np.asarray(sign_residual), (y - ref.sign_decompress(np.asarray(signs_ef), n, k)).astype(np.float32)
    )


@pytest.mark.parametrize("format", ["minmax_uint8", "sign"])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_cuda_decompress_reduce_matches_reference(gpu, rng, format, k):
    m = 1_000_003
    compress = ref.minmax_compress if format == "minmax_uint8" else ref.sign_compress
    buffers = np.concatenate([compress(random_values(rng, m), 1)[0] for _ in range(k)])
    reduce = ops.minmax_uint8_decompress_reduce if format == "minmax_uint8" else ops.sign_decompress_reduce
    for average in (True, False):
        got = np.asarray(reduce(jax.device_put(buffers), m, k, average=average))
        np.testing.assert_array_equal(got, ref.decompress_reduce(buffers, m, k, format, average))


def test_cuda_special_chunks(gpu, rng):
    x = np.repeat(np.array([3.25, -1e-3, 0.0, 7e5], np.float32), [5, 5, 5, 4])
    decoded = ops.minmax_uint8_decompress(ops.minmax_uint8_compress(jax.device_put(x), 4), x.size, 4)
    np.testing.assert_array_equal(np.asarray(decoded), x)
    y = random_values(rng, 300)
    y[150] = np.nan
    decoded = np.asarray(ops.minmax_uint8_decompress(ops.minmax_uint8_compress(jax.device_put(y), 3), 300, 3))
    assert not np.isfinite(decoded[100:200]).any() and np.isfinite(decoded[:100]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_cuda_elementwise_helpers_match_reference(gpu, rng, dtype):
    x, y, z, w = (random_values(rng, 1_000_003).astype(dtype) for _ in range(4))
    d = jax.device_put
    cases = [
        (ops.average2(d(x), d(y)), ref.average2(x, y)),
        (ops.axpy(d(x), d(y), -0.37), ref.axpy(x, y, -0.37)),
        (ops.async_average(d(x), d(y), d(z), 3), ref.async_average(x, y, z, 3)),
        (ops.lowprec_decentralized_diff(d(x), d(y), d(z), d(w)), ref.lowprec_decentralized_diff(x, y, z, w)),
    ]
    for got, expected in cases:
        np.testing.assert_array_equal(np.asarray(got), expected.astype(dtype))


def test_torch_cuda_path_gives_the_same_bytes(gpu, rng):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")
    from bagua_torch import ops as tops

    x = random_values(rng, 1_000_003)
    from_torch = tops.minmax_uint8_compress(torch.from_numpy(x).cuda(), 8).cpu().numpy()
    np.testing.assert_array_equal(from_torch, np.asarray(ops.minmax_uint8_compress(jax.device_put(x), 8)))
    decoded = tops.minmax_uint8_decompress(torch.from_numpy(from_torch).cuda(), x.size, 8).cpu().numpy()
    np.testing.assert_array_equal(decoded, ref.minmax_decompress(from_torch, x.size, 8))

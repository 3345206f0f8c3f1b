"""The native kernels through bagua_jax.ops against the NumPy reference."""

import jax
import jax.numpy as jnp
import kernels_reference as ref
import ml_dtypes
import numpy as np
import pytest
from conftest import random_values

from bagua_jax import ops

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
SIZES = [1, 7919, 2_000_003]
CHUNKS = [1, 2, 3, 8]


def as_input(values: np.ndarray, dtype) -> np.ndarray:
    return values.astype(dtype)


def each_size_chunking_and_dtype(test):
    """Run ``test`` for every size ``n`` in SIZES, chunk count ``k`` in CHUNKS and ``dtype`` in DTYPES."""
    test = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)(test)
    test = pytest.mark.parametrize("k", CHUNKS)(test)
    return pytest.mark.parametrize("n", SIZES)(test)


@each_size_chunking_and_dtype
def test_minmax_roundtrip_matches_reference(rng, n, k, dtype):
    x = as_input(random_values(rng, n), dtype)
    expected, _ = ref.minmax_compress(x, k)
    compressed = np.asarray(jax.jit(ops.minmax_uint8_compress, static_argnums=1)(x, k))
    assert ops.compressed_size(n, k) == ref.compressed_size(n, k, "minmax_uint8") == compressed.size
    np.testing.assert_array_equal(compressed, expected)

    decoded = np.asarray(ops.minmax_uint8_decompress(compressed, n, k, dtype))
    assert decoded.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(decoded, ref.minmax_decompress(expected, n, k).astype(dtype))

    ref.assert_within_minmax_bound(x, np.asarray(ops.minmax_uint8_decompress(compressed, n, k)), k)


def test_a_group_holding_both_zeros_has_minus_zero_for_lo():
    """A group's lo and hi order -0 below +0 on every device (the CUDA kernels reduce order-preserving integer
    keys), whatever the order of its values: its header, the only byte the sign of a zero changes, agrees."""
    x = np.array([1.5, 0.0, -0.0, 2.0] * 4 + [-0.0, 0.0, 3.0] * 3, np.float32)
    for values in (x, x[::-1].copy()):
        compressed = np.asarray(ops.minmax_uint8_compress(values, 1))
        np.testing.assert_array_equal(compressed, ref.minmax_compress(values, 1)[0])
        assert np.signbit(compressed[:4].view(np.float32)[0])


@each_size_chunking_and_dtype
def test_sign_roundtrip_matches_reference(rng, n, k, dtype):
    x = as_input(random_values(rng, n), dtype)
    expected, _ = ref.sign_compress(x, k)
    compressed = np.asarray(ops.sign_compress(x, k))
    assert compressed.size == ref.compressed_size(n, k, "sign") == ops.compressed_size(n, k, "sign")
    np.testing.assert_array_equal(ref.chunk_bits(compressed, n, k), ref.chunk_bits(expected, n, k))
    # The scale's last bits depend on summation order (SPEC): compare closely, not exactly.
    np.testing.assert_allclose(ref.chunk_scales(compressed, n, k), ref.chunk_scales(expected, n, k), rtol=2e-6)
    decoded = np.asarray(ops.sign_decompress(compressed, n, k, dtype))
    np.testing.assert_array_equal(decoded, ref.sign_decompress(compressed, n, k).astype(dtype))


@pytest.mark.parametrize("n", [1, 7919, 1_000_003])
@pytest.mark.parametrize("k", CHUNKS)
def test_minmax_error_feedback_residual_is_exact(rng, n, k):
    x, e = random_values(rng, n), random_values(rng, n) * np.float32(0.01)
    expected, expected_residual = ref.minmax_compress(x, k, e)
    compressed, residual = ops.minmax_uint8_compress_ef(x, e, k)
    np.testing.assert_array_equal(np.asarray(compressed), expected)
    np.testing.assert_array_equal(np.asarray(residual), expected_residual)


@pytest.mark.parametrize("n", [1, 7919, 1_000_003])
@pytest.mark.parametrize("k", CHUNKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_sign_error_feedback_residual_is_exact(rng, n, k, dtype):
    x = as_input(random_values(rng, n), dtype)
    e = random_values(rng, n) * np.float32(0.1)
    compressed, residual = ops.sign_compress_ef(x, e, k)
    compressed, residual = np.asarray(compressed), np.asarray(residual)
    y = (x.astype(np.float32) + e).astype(np.float32)
    expected, _ = ref.sign_compress(x, k, e)
    np.testing.assert_array_equal(ref.chunk_bits(compressed, n, k), ref.chunk_bits(expected, n, k))
    decoded = ref.sign_decompress(compressed, n, k)
    # Exact with the kernel's own scale: residual = y - (+-scale).
    np.testing.assert_array_equal(residual, (y - decoded).astype(np.float32))
    np.testing.assert_allclose(decoded + residual, y, rtol=0, atol=np.float32(np.abs(y).max()) * 2**-23)


@pytest.mark.parametrize("codec", ["minmax_uint8", "sign"])
def test_compressors_match_reference_over_several_cache_groups(rng, codec):
    """Above 8 MiB, the CPU compressors measure and encode a group of chunks at a time (kGroupBytes
    in kernels_cpu.cc): each chunk, in whichever group, gets its own header, codes and residuals.
    Every chunk has its own scale, so that another chunk's header would give other codes."""
    n, k = 3_000_017, 5  # 12 MB of float32 in chunks of 2.4 MB: groups of 3 and 2 chunks
    scales = np.repeat(10.0 ** rng.uniform(-3, 3, k), -(-n // k))[:n].astype(np.float32)
    x = random_values(rng, n) * scales
    e = random_values(rng, n) * scales * np.float32(0.01)
    if codec == "minmax_uint8":
        expected, expected_residual = ref.minmax_compress(x, k, e)
        compressed, residual = ops.minmax_uint8_compress_ef(x, e, k)
        np.testing.assert_array_equal(np.asarray(compressed), expected)
        np.testing.assert_array_equal(np.asarray(residual), expected_residual)
        return
    compressed, residual = (np.asarray(a) for a in ops.sign_compress_ef(x, e, k))
    expected, _ = ref.sign_compress(x, k, e)
    np.testing.assert_array_equal(ref.chunk_bits(compressed, n, k), ref.chunk_bits(expected, n, k))
    np.testing.assert_allclose(ref.chunk_scales(compressed, n, k), ref.chunk_scales(expected, n, k), rtol=2e-6)
    np.testing.assert_array_equal(residual, (x + e) - ref.sign_decompress(compressed, n, k))


@pytest.mark.parametrize("format", ["minmax_uint8", "sign"])
@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("k", CHUNKS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_decompress_reduce_matches_reference(rng, format, average, k, dtype):
    m = 30_011
    compress = ref.minmax_compress if format == "minmax_uint8" else ref.sign_compress
    buffers = np.concatenate([compress(random_values(rng, m), 1)[0] for _ in range(k)])
    reduce = ops.minmax_uint8_decompress_reduce if format == "minmax_uint8" else ops.sign_decompress_reduce
    out = np.asarray(reduce(buffers, m, k, average=average, dtype=dtype))
    expected = ref.decompress_reduce(buffers, m, k, format, average)
    np.testing.assert_array_equal(out, expected.astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_exact_zeros_decode_to_exact_zeros(rng, dtype):
    # Every chunk's range holds 0, asymmetrically (where a grid from lo would miss 0).
    x = (random_values(rng, 30_000) * np.float32(3) + np.float32(0.7)).astype(dtype)
    x[rng.random(x.size) < 0.3] = 0
    for k in (1, 3, 8):
        compressed = np.asarray(ops.minmax_uint8_compress(x, k))
        np.testing.assert_array_equal(compressed, ref.minmax_compress(x, k)[0])
        decoded = np.asarray(ops.minmax_uint8_decompress(compressed, x.size, k))
        assert np.all(decoded[x == 0] == 0)
        ref.assert_within_minmax_bound(x, decoded, k)
        _, residual = ops.minmax_uint8_compress_ef(x, np.zeros(x.size, np.float32), k)
        assert np.all(np.asarray(residual)[x == 0] == 0)


def test_chunks_of_one_sign_use_a_grid_from_their_minimum(rng):
    x = np.abs(random_values(rng, 9_000)) + np.float32(0.5)
    for sign in (1, -1):
        y = (x * np.float32(sign)).astype(np.float32)
        compressed = np.asarray(ops.minmax_uint8_compress(y, 3))
        np.testing.assert_array_equal(compressed, ref.minmax_compress(y, 3)[0])
        decoded = np.asarray(ops.minmax_uint8_decompress(compressed, y.size, 3))
        for b, e in ref.chunk_bounds(y.size, 3):
            assert decoded[b:e].min() == y[b:e].min()  # code 0 decodes to lo exactly
        ref.assert_within_minmax_bound(y, decoded, 3)


@pytest.mark.parametrize("length", [5, 40])  # 40: whole vector steps of a constant chunk
def test_constant_chunks_decode_exactly(length):
    x = np.repeat(np.array([3.25, -1e-3, 0.0, 7e5], np.float32), length)
    compressed = np.asarray(ops.minmax_uint8_compress(x, 4))
    np.testing.assert_array_equal(compressed, ref.minmax_compress(x, 4)[0])
    np.testing.assert_array_equal(np.asarray(ops.minmax_uint8_decompress(compressed, x.size, 4)), x)
    _, residual = ops.minmax_uint8_compress_ef(x, np.zeros(x.size, np.float32), 4)
    np.testing.assert_array_equal(np.asarray(residual), 0)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_chunks_decode_nonfinite(rng, bad):
    x = random_values(rng, 300)
    x[150] = bad  # chunk 1 of 3
    decoded = np.asarray(ops.minmax_uint8_decompress(ops.minmax_uint8_compress(x, 3), 300, 3))
    assert not np.isfinite(decoded[100:200]).any()
    assert np.isfinite(decoded[:100]).all() and np.isfinite(decoded[200:]).all()


def test_empty_chunks_have_a_header_only(rng):
    x = random_values(rng, 5)
    for format, compress, decompress in [
        ("minmax_uint8", ops.minmax_uint8_compress, ops.minmax_uint8_decompress),
        ("sign", ops.sign_compress, ops.sign_decompress),
    ]:
        compressed = compress(x, 8)  # chunks of 1 element; chunks 5..7 are empty
        assert compressed.size == 5 * 32 + 3 * 16
        reference_decode = ref.minmax_decompress if format == "minmax_uint8" else ref.sign_decompress
        np.testing.assert_array_equal(decompress(compressed, 5, 8), reference_decode(np.asarray(compressed), 5, 8))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_elementwise_helpers_match_reference(rng, dtype):
    n = 100_003
    x, y, z, w = (as_input(random_values(rng, n), dtype) for _ in range(4))
    cases = [
        (ops.average2(x, y), ref.average2(x, y)),
        (ops.axpy(x, y, -0.37), ref.axpy(x, y, -0.37)),
        (ops.async_average(x, y, z, 3), ref.async_average(x, y, z, 3)),
        (ops.lowprec_decentralized_diff(x, y, z, w), ref.lowprec_decentralized_diff(x, y, z, w)),
    ]
    for got, expected in cases:
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(np.asarray(got), expected.astype(dtype))


def test_lowprec_decentralized_diff_is_the_formula_and_exactly_zero_where_all_four_agree(rng):
    x, w, left, right = (random_values(rng, 100_003) for _ in range(4))
    exact = x.astype(np.float64) + left / 3.0 + right / 3.0 - (5.0 / 3.0) * w.astype(np.float64)
    scale = np.abs(np.stack([x, w, left, right])).max(0).astype(np.float64)
    np.testing.assert_array_less(
        np.abs(np.asarray(ops.lowprec_decentralized_diff(x, w, left, right)) - exact), 4e-7 * scale
    )
    # A frozen coordinate (x = w = L = R) must send exact zeros: the codec keeps them, so it
    # never moves; a few ulps instead are encoded whenever a chunk holds nothing larger.
    np.testing.assert_array_equal(np.asarray(ops.lowprec_decentralized_diff(x, x, x, x)), 0)


def test_vmap_compresses_each_row(rng):
    x = random_values(rng, 4 * 1001).reshape(4, 1001)
    batched = np.asarray(jax.vmap(lambda r: ops.minmax_uint8_compress(r, 3))(x))
    for row, compressed in zip(x, batched):
        np.testing.assert_array_equal(compressed, ref.minmax_compress(row, 3)[0])
    summed = jax.vmap(ops.axpy, in_axes=(0, 0, None))(x, x, 2.0)
    np.testing.assert_array_equal(np.asarray(summed), ref.axpy(x, x, 2.0))


def test_shard_map_sees_the_local_shard(rng):
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    devices = np.array(jax.devices()[:4])
    mesh = Mesh(devices, ("ranks",))
    x = random_values(rng, 4 * 2053)
    size = ops.compressed_size(2053, 2)

    @jax.jit
    def compress_shards(x):
        return jax.shard_map(
            lambda s: ops.minmax_uint8_compress(s, 2), mesh=mesh, in_specs=P("ranks"), out_specs=P("ranks")
        )(x)

    out = np.asarray(compress_shards(x)).reshape(len(devices), size)
    for r in range(len(devices)):
        np.testing.assert_array_equal(out[r], ref.minmax_compress(x[r * 2053 : (r + 1) * 2053], 2)[0])


def test_bad_inputs_raise_clear_errors():
    x = jnp.ones(10, jnp.float32)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        ops.minmax_uint8_compress(jnp.ones(10, jnp.int32), 2)
    with pytest.raises(ValueError, match="chunk count"):
        ops.sign_compress(x, 0)
    with pytest.raises(ValueError, match="expected 64"):
        ops.minmax_uint8_decompress(jnp.zeros(63, jnp.uint8), 10, 2)
    with pytest.raises(TypeError, match="1-D uint8"):
        ops.minmax_uint8_decompress(jnp.zeros(64, jnp.int8), 10, 2)
    with pytest.raises(ValueError, match="residual"):
        ops.minmax_uint8_compress_ef(x, jnp.zeros(9, jnp.float32), 2)
    with pytest.raises(ValueError, match="share dtype and shape"):
        ops.average2(x, jnp.ones(11, jnp.float32))


def test_native_handler_rejects_bad_buffers_itself():
    """A call that bypasses the Python checks still gets a clear error, not a crash."""
    call = jax.ffi.ffi_call("bagua_minmax_decompress", jax.ShapeDtypeStruct((10,), jnp.float32))
    with pytest.raises(Exception, match="compressed input has 63 elements, expected 64"):
        jax.block_until_ready(call(jnp.zeros(63, jnp.uint8), k=np.int64(2)))
    call = jax.ffi.ffi_call("bagua_minmax_compress", jax.ShapeDtypeStruct((64,), jnp.uint8))
    with pytest.raises(Exception, match="float32, float16 or bfloat16, got int32"):
        jax.block_until_ready(call(jnp.zeros(10, jnp.int32), k=np.int64(2)))


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
def test_every_16_bit_value_converts_exactly(dtype):
    """All finite 16-bit values survive the kernels' float32 round trip. XLA runs custom calls
    with float32 denormals flushed to zero: float16 subnormals are normal float32 and must come
    through; bfloat16 subnormals are float32 subnormals, flushed like in any XLA computation."""
    values = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    as_f32 = values.astype(np.float32)
    keep = np.isfinite(as_f32) & ((np.abs(as_f32) >= np.finfo(np.float32).tiny) | (as_f32 == 0))
    values = values[keep]
    same = ops.axpy(values, values, 0.0)  # x + 0 * x == x, signed zeros included
    np.testing.assert_array_equal(np.asarray(same).view(np.uint16), values.view(np.uint16))

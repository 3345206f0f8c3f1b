"""Finite inputs at the edges of float32 through every codec kernel, on both front ends (SPEC section 2).

Subnormal and tiny ranges (where 254 / (hi - lo) overflows or (hi - lo) / 254 is subnormal), values
near the float32 limit (where hi - lo overflows) and sign scales whose sum overflows must decode to
finite values within the bound, the same bytes as the NumPy reference, from JAX and torch alike, whatever
the calling thread's flush-to-zero mode.
"""

import kernels_reference as ref
import numpy as np
import pytest

F32 = np.float32
FLT_MAX = float(np.finfo(F32).max)
CHUNK, K = 1000, 4


def extreme_chunks(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Name -> K chunks of CHUNK float32 values whose ranges float32 alone cannot grid."""
    u = rng.uniform(-1, 1, CHUNK * K)
    tiny = {
        "subnormal": u * 1e-40,  # subnormal values and range, zero inside
        "tiny_range": u * 1e-37,  # normal values, 254 / range overflows
        "tiny_range_offset": 1e-30 + np.abs(u) * 3e-37,  # z = lo, range of a few ulps
        "just_below_threshold": u * 2.0**-120,
    }
    huge = {
        "huge": u * 3e38,  # hi - lo overflows
        "huge_positive": 1e38 + np.abs(u) * 2.4e38,
        "float_limits": np.where(u > 0, FLT_MAX, -FLT_MAX) * (np.abs(u) > 0.5),
        "huge_with_small": np.where(np.abs(u) > 0.99, u * 3.4e38, u),
    }
    out = {name: x.astype(F32) for name, x in {**tiny, **huge}.items()}
    for name, x in out.items():
        if x.min() < 0:  # exact zeros inside ranges that hold 0
            x[rng.random(x.size) < 0.1] = 0
    return out


CASES = list(extreme_chunks(np.random.default_rng(0)))


def _front_end(name: str):
    """(compress, compress_ef, decompress, sign_compress, sign_compress_ef, sign_decompress, reduce) -> numpy."""
    if name == "jax":
        from bagua_jax import ops

        def call(fn):
            return lambda *a, **kw: _to_numpy(fn(*a, **kw))

    else:
        import torch

        from bagua_torch import ops

        def call(fn):
            def wrapped(*a, **kw):
                return _to_numpy(
                    fn(*(torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v for v in a), **kw)
                )

            return wrapped

    return {
        "minmax_compress": call(ops.minmax_uint8_compress),
        "minmax_compress_ef": call(ops.minmax_uint8_compress_ef),
        "minmax_decompress": call(ops.minmax_uint8_decompress),
        "minmax_reduce": call(ops.minmax_uint8_decompress_reduce),
        "minmax4_compress": call(ops.minmax_uint4_compress),
        "minmax4_compress_ef": call(ops.minmax_uint4_compress_ef),
        "minmax4_decompress": call(ops.minmax_uint4_decompress),
        "minmax4_reduce": call(ops.minmax_uint4_decompress_reduce),
        "sign_compress": call(ops.sign_compress),
        "sign_compress_ef": call(ops.sign_compress_ef),
        "sign_decompress": call(ops.sign_decompress),
        "sign_reduce": call(ops.sign_decompress_reduce),
        "average2": call(ops.average2),
        "axpy": call(ops.axpy),
        "async_average": call(ops.async_average),
        "lowprec_decentralized_diff": call(ops.lowprec_decentralized_diff),
    }


def _to_numpy(result):
    if isinstance(result, tuple):
        return tuple(_to_numpy(r) for r in result)
    return result.numpy() if hasattr(result, "numpy") and not isinstance(result, np.ndarray) else np.asarray(result)


@pytest.fixture(scope="module", params=["jax", "torch"])
def kernels(request):
    return _front_end(request.param)


def assert_in_bound(x: np.ndarray, decoded: np.ndarray, bits: int) -> None:
    """Half a step, (hi - lo) / 508 (8 bits) or / 28 (4 bits), per element plus float32 rounding, computed in
    float64 (hi - lo may overflow float32).

    The rounding: of the float32 step (a relative 2**-24 of (hi - lo) over up to 254 steps) and of the result.
    """
    assert np.isfinite(decoded).all()
    for b, e in ref.chunk_bounds(x.size, K):
        seg = x[b:e].astype(np.float64)
        span = seg.max() - seg.min()
        ulp = np.maximum(np.spacing(np.abs(seg)) * 2.0**29, 2.0**-149)  # float32's ulp, from float64's
        half_step = span / (2 * ref.minmax_steps(bits))
        assert np.all(np.abs(decoded[b:e].astype(np.float64) - seg) <= half_step + span * 2.0**-21 + 2 * ulp)


CODECS = {8: "minmax", 4: "minmax4"}


@pytest.mark.parametrize("bits", CODECS)
@pytest.mark.parametrize("case", CASES)
def test_minmax_codes_decode_finite_within_the_bound(kernels, case, bits):
    codec = CODECS[bits]
    x = extreme_chunks(np.random.default_rng(0))[case]
    assert all(ref.minmax_wide(*ref.minmax_bounds(x[b:e])) for b, e in ref.chunk_bounds(x.size, K))
    expected, expected_residual = ref.minmax_compress(x, K, bits=bits)
    compressed = kernels[f"{codec}_compress"](x, K)
    np.testing.assert_array_equal(compressed, expected)
    decoded = kernels[f"{codec}_decompress"](compressed, x.size, K)
    np.testing.assert_array_equal(decoded, ref.minmax_decompress(expected, x.size, K, bits=bits))
    assert_in_bound(x, decoded, bits)
    assert np.all(decoded[x == 0] == 0)
    compressed, residual = kernels[f"{codec}_compress_ef"](x, np.zeros(x.size, F32), K)
    np.testing.assert_array_equal(compressed, expected)
    np.testing.assert_array_equal(residual, expected_residual)
    assert np.isfinite(residual).all()


@pytest.mark.parametrize("bits", CODECS)
@pytest.mark.parametrize("average", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_minmax_decompress_reduce_of_extreme_chunks(kernels, case, average, bits):
    x = extreme_chunks(np.random.default_rng(0))[case]
    buffers = np.concatenate([ref.minmax_compress(x[b:e], 1, bits=bits)[0] for b, e in ref.chunk_bounds(x.size, K)])
    out = kernels[f"{CODECS[bits]}_reduce"](buffers, CHUNK, K, average=average)
    np.testing.assert_array_equal(out, ref.decompress_reduce(buffers, CHUNK, K, f"minmax_uint{bits}", average))
    if average:  # an average of finite values is finite, even where their float32 sum is not
        assert np.isfinite(out).all()


def test_sign_scales_whose_sum_overflows_stay_finite(kernels):
    rng = np.random.default_rng(1)
    x = (rng.choice([-1, 1], CHUNK * K) * rng.uniform(2e38, 3.4e38, CHUNK * K)).astype(F32)
    expected, _ = ref.sign_compress(x, K)
    compressed = kernels["sign_compress"](x, K)
    scales = ref.chunk_scales(compressed, x.size, K)
    assert np.isfinite(scales).all()
    np.testing.assert_allclose(scales, ref.chunk_scales(expected, x.size, K), rtol=2e-6)
    np.testing.assert_array_equal(ref.chunk_bits(compressed, x.size, K), ref.chunk_bits(expected, x.size, K))
    decoded = kernels["sign_decompress"](compressed, x.size, K)
    np.testing.assert_array_equal(decoded, ref.sign_decompress(compressed, x.size, K))
    _, residual = kernels["sign_compress_ef"](x, np.zeros(x.size, F32), K)
    np.testing.assert_array_equal(residual, (x - decoded).astype(F32))
    # k single-chunk buffers with scales near 3e38: their float32 sum overflows, their average does not.
    buffers = np.concatenate([ref.sign_compress(x[b:e], 1)[0] for b, e in ref.chunk_bounds(x.size, K)])
    for average in (True, False):
        out = kernels["sign_reduce"](buffers, CHUNK, K, average=average)
        np.testing.assert_array_equal(out, ref.decompress_reduce(buffers, CHUNK, K, "sign", average))
    assert np.isfinite(kernels["sign_reduce"](buffers, CHUNK, K, average=True)).all()


def test_subnormal_sign_scales_are_not_flushed(kernels):
    x = (np.random.default_rng(2).standard_normal(CHUNK * K) * 1e-42).astype(F32)
    compressed = kernels["sign_compress"](x, K)
    scales = ref.chunk_scales(compressed, x.size, K)
    assert np.all(scales > 0)
    np.testing.assert_allclose(scales, ref.chunk_scales(ref.sign_compress(x, K)[0], x.size, K), rtol=2e-6)


@pytest.mark.parametrize("amplitude", [1e-40, 3.4e38])
def test_elementwise_helpers_at_the_float32_edges(kernels, amplitude):
    # Near the limit an intermediate (a + b, x + left / 3) overflows while the result is finite.
    rng = np.random.default_rng(5)
    x, y, z, w = (rng.uniform(-amplitude, amplitude, 10_007).astype(F32) for _ in range(4))
    y[:100] = x[:100]  # average2 of equal huge values: a + b overflows, (a + b) / 2 does not
    cases = [
        (kernels["average2"](x, y), ref.average2(x, y)),
        (kernels["axpy"](x, y, -0.75), ref.axpy(x, y, -0.75)),
        (kernels["async_average"](x, y, z, 1), ref.async_average(x, y, z, 1)),
        (kernels["lowprec_decentralized_diff"](x, y, z, w), ref.lowprec_decentralized_diff(x, y, z, w)),
    ]
    for got, expected in cases:
        np.testing.assert_array_equal(got, expected)
    assert np.isfinite(cases[0][0]).all()  # an average of finite values
    if amplitude < 1:
        assert np.count_nonzero(cases[0][0]) > x.size // 2  # subnormal results are not flushed


@pytest.mark.parametrize("amplitude", [1e-40, 1.0, 3.4e38])
def test_async_average_for_power_of_two_and_other_rank_counts(kernels, amplitude, rng):
    # The CPU kernel divides by a power-of-two rank count as a multiplication by its exact inverse:
    # the same bits as the division, subnormal and rescaled (overflowing) elements included.
    x, y, z = (rng.uniform(-amplitude, amplitude, 10_007).astype(F32) for _ in range(3))
    for ranks in (2, 3, 8, 1000, 1024, 2**40):
        np.testing.assert_array_equal(kernels["async_average"](x, y, z, ranks), ref.async_average(x, y, z, ranks))


def test_in_place_helpers_rescale_from_the_original_inputs():
    """torch's out= may be an input: where a * y overflows and x + a * y does not, the rescaled
    result needs the x that the output overwrites."""
    import torch

    from bagua_torch import ops

    rng = np.random.default_rng(6)
    x = (-rng.uniform(2e38, 3.4e38, 10_007)).astype(F32)
    y = (-x * rng.uniform(0.5, 0.9, x.size)).astype(F32)
    expected = ref.axpy(x, y, 2.0)
    assert np.isfinite(expected).all() and (np.abs(y.astype(np.float64)) * 2 > np.finfo(F32).max).any()
    tx = torch.from_numpy(x.copy())
    ops.axpy(tx, torch.from_numpy(y), 2.0, out=tx)
    np.testing.assert_array_equal(tx.numpy(), expected)


def test_jax_and_torch_give_the_same_bytes_for_subnormals():
    jax_kernels, torch_kernels = _front_end("jax"), _front_end("torch")
    for x in extreme_chunks(np.random.default_rng(3)).values():
        np.testing.assert_array_equal(jax_kernels["minmax_compress"](x, K), torch_kernels["minmax_compress"](x, K))
        np.testing.assert_array_equal(jax_kernels["minmax4_compress"](x, K), torch_kernels["minmax4_compress"](x, K))
        np.testing.assert_array_equal(jax_kernels["sign_compress"](x, K), torch_kernels["sign_compress"](x, K))


def test_torch_flush_denormal_mode_does_not_change_the_bytes():
    import torch

    x = extreme_chunks(np.random.default_rng(4))["subnormal"]
    kernels = _front_end("torch")
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-to-zero mode")
    try:
        compressed = kernels["minmax_compress"](x, K)
        decoded = kernels["minmax_decompress"](compressed, x.size, K)
    finally:
        torch.set_flush_denormal(False)
    np.testing.assert_array_equal(compressed, ref.minmax_compress(x, K)[0])
    np.testing.assert_array_equal(decoded, ref.minmax_decompress(compressed, x.size, K))
    assert np.count_nonzero(decoded) > x.size // 2

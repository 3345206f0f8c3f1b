"""Bagua's native kernels as JAX operations.

Each function is one XLA FFI custom call on the CPU or CUDA platform. They work
under ``jax.jit``, under ``jax.vmap`` (compressions map per example; elementwise
helpers broadcast) and inside ``jax.shard_map`` (a call sees the local shard).
Compression flattens its input; the compressed buffer layout is documented in
``xla_ffi/layout.h`` and sized by :func:`compressed_size`.
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from bagua_common.algorithms.codec_operations import codec_operations
from bagua_common.algorithms.kernel_dtypes import KERNEL_FLOAT_DTYPES
from bagua_jax._native import library

Format = Literal["minmax_uint8", "minmax_uint4", "sign"]
KERNEL_FLOATS = tuple(jnp.dtype(name) for name in KERNEL_FLOAT_DTYPES)
"""The dtypes of :data:`bagua_common.algorithms.kernel_dtypes.KERNEL_FLOAT_DTYPES` as JAX dtypes."""
_TARGET_PREFIX = {"minmax_uint8": "bagua_minmax", "minmax_uint4": "bagua_minmax_uint4", "sign": "bagua_sign"}


def compressed_size(n: int, k: int, format: Format = "minmax_uint8") -> int:
    """Return the size in bytes of ``n`` elements compressed into ``k`` chunks.

    ``format`` is ``"minmax_uint8"`` (one byte per element plus a 16-byte header per
    group of 8192 elements of a chunk), ``"minmax_uint4"`` (half a byte per element plus
    the headers) or ``"sign"`` (one bit per element plus one header per chunk); each group
    is padded to a multiple of 16 bytes (docs/formats.md).
    """
    return int(library.compressed_bytes(format, int(n), int(k)))


def _float_array(name: str, x: jax.typing.ArrayLike) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype not in KERNEL_FLOATS:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {x.dtype}")
    return x


def _chunk_count(k: int) -> np.int64:
    if int(k) != k or k < 1:
        raise ValueError(f"the chunk count k must be a positive integer, got {k}")
    return np.int64(k)


def _compressed_array(c: jax.typing.ArrayLike, expected: int) -> jax.Array:
    c = jnp.asarray(c)
    if c.dtype != jnp.uint8 or c.ndim != 1:
        raise TypeError(f"a compressed buffer is a 1-D uint8 array, got {c.dtype}{list(c.shape)}")
    if c.size != expected:
        raise ValueError(f"the compressed buffer has {c.size} bytes, expected {expected}")
    return c


def _output_dtype(dtype: jax.typing.DTypeLike) -> jnp.dtype:
    dtype = jnp.dtype(dtype)
    if dtype not in KERNEL_FLOATS:
        raise TypeError(f"the output dtype must be float32, float16 or bfloat16, got {dtype}")
    return dtype


def _compress(format: Format, x: jax.typing.ArrayLike, k: int) -> jax.Array:
    x = _float_array("x", x)
    k = _chunk_count(k)
    out = jax.ShapeDtypeStruct((compressed_size(x.size, k, format),), jnp.uint8)
    return jax.ffi.ffi_call(_TARGET_PREFIX[format] + "_compress", out, vmap_method="sequential")(x.reshape(-1), k=k)


def _compress_ef(
    format: Format, x: jax.typing.ArrayLike, residual: jax.typing.ArrayLike, k: int
) -> tuple[jax.Array, jax.Array]:
    x = _float_array("x", x)
    residual = jnp.asarray(residual)
    if residual.dtype != jnp.float32 or residual.size != x.size:
        raise ValueError(
            f"the error-feedback residual must be float32 with {x.size} elements, "
            f"got {residual.dtype}{list(residual.shape)}"
        )
    k = _chunk_count(k)
    outs = (
        jax.ShapeDtypeStruct((compressed_size(x.size, k, format),), jnp.uint8),
        jax.ShapeDtypeStruct((x.size,), jnp.float32),
    )
    compressed, new_residual = jax.ffi.ffi_call(
        _TARGET_PREFIX[format] + "_compress_ef",
        outs,
        vmap_method="sequential",
        input_output_aliases={1: 1},
    )(x.reshape(-1), residual.reshape(-1), k=k)
    return compressed, new_residual.reshape(residual.shape)


def _decompress(
    format: Format, compressed: jax.typing.ArrayLike, n: int, k: int, dtype: jax.typing.DTypeLike = jnp.float32
) -> jax.Array:
    k = _chunk_count(k)
    compressed = _compressed_array(compressed, compressed_size(n, k, format))
    out = jax.ShapeDtypeStruct((int(n),), _output_dtype(dtype))
    return jax.ffi.ffi_call(_TARGET_PREFIX[format] + "_decompress", out, vmap_method="sequential")(compressed, k=k)


def _decompress_reduce(
    format: Format,
    compressed: jax.typing.ArrayLike,
    m: int,
    k: int,
    *,
    average: bool = True,
    dtype: jax.typing.DTypeLike = jnp.float32,
) -> jax.Array:
    k = _chunk_count(k)
    compressed = _compressed_array(compressed, int(k) * compressed_size(m, 1, format))
    out = jax.ShapeDtypeStruct((int(m),), _output_dtype(dtype))
    return jax.ffi.ffi_call(_TARGET_PREFIX[format] + "_decompress_reduce", out, vmap_method="sequential")(
        compressed, k=k, average=bool(average)
    )


_OPERATIONS = (_compress, _compress_ef, _decompress, _decompress_reduce)
"""Each operation of :data:`~bagua_common.algorithms.codec_operations.OPERATIONS` for a codec given first."""


(
    minmax_uint8_compress,
    minmax_uint8_compress_ef,
    minmax_uint8_decompress,
    minmax_uint8_decompress_reduce,
) = codec_operations("minmax_uint8", _OPERATIONS, module=__name__)
(
    minmax_uint4_compress,
    minmax_uint4_compress_ef,
    minmax_uint4_decompress,
    minmax_uint4_decompress_reduce,
) = codec_operations("minmax_uint4", _OPERATIONS, module=__name__)
sign_compress, sign_compress_ef, sign_decompress, sign_decompress_reduce = codec_operations(
    "sign", _OPERATIONS, module=__name__
)


def _elementwise(target: str, operands: tuple[jax.typing.ArrayLike, ...], **attrs) -> jax.Array:
    arrays = [_float_array("operand", a) for a in operands]
    first = arrays[0]
    for a in arrays[1:]:
        if a.dtype != first.dtype or a.shape != first.shape:
            raise ValueError(
                f"operands must share dtype and shape, got {first.dtype}{list(first.shape)} "
                f"and {a.dtype}{list(a.shape)}"
            )
    out = jax.ShapeDtypeStruct(first.shape, first.dtype)
    return jax.ffi.ffi_call(target, out, vmap_method="broadcast_all")(*arrays, **attrs)


def average2(a: jax.typing.ArrayLike, b: jax.typing.ArrayLike) -> jax.Array:
    """Return ``(a + b) / 2`` computed in float32, in the inputs' dtype."""
    return _elementwise("bagua_average2", (a, b))


def axpy(x: jax.typing.ArrayLike, y: jax.typing.ArrayLike, a: float) -> jax.Array:
    """Return ``x + a * y`` computed in float32, in the inputs' dtype."""
    return _elementwise("bagua_axpy", (x, y), a=np.float32(a))


def async_average(
    x: jax.typing.ArrayLike,
    reduced: jax.typing.ArrayLike,
    snapshot: jax.typing.ArrayLike,
    ranks: int,
) -> jax.Array:
    """Return ``x + (reduced / ranks - snapshot)``: the asynchronous model-average update.

    ``reduced`` is the sum over ``ranks`` of the snapshots taken when the round
    began, so local progress made during the round is kept.
    """
    if int(ranks) != ranks or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, got {ranks}")
    return _elementwise("bagua_async_average", (x, reduced, snapshot), ranks=np.int64(ranks))


def lowprec_decentralized_diff(
    x: jax.typing.ArrayLike,
    w: jax.typing.ArrayLike,
    left: jax.typing.ArrayLike,
    right: jax.typing.ArrayLike,
) -> jax.Array:
    """Return ``x + left / 3 + right / 3 - (5 / 3) * w``, computed in float32 as
    ``(x - w) + (left - w) / 3 + (right - w) / 3`` (exactly 0 where all four agree).

    This is the difference each rank compresses and sends to both ring neighbours in
    low-precision decentralized SGD (``w``: its last communicated weights; ``left``
    and ``right``: its copies of the neighbours' weights).
    """
    return _elementwise("bagua_lowprec_decentralized_diff", (x, w, left, right))

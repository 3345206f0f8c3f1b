"""The native kernels the kernel benchmarks time, and how one call of each is set up.

Shared by ``kernels.py`` and the workers of ``kernels_release.py``, which import either this
tree's ``bagua_jax`` or a release's: so this module imports nothing else of this tree.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

KERNELS = (
    "minmax_compress",
    "minmax_decompress",
    "minmax_decompress_reduce",
    "minmax_uint4_compress",
    "minmax_uint4_decompress",
    "minmax_uint4_decompress_reduce",
    "sign_compress",
    "sign_decompress",
    "sign_decompress_reduce",
    "axpy",
    "async_average",
)
"""The kernels timed; ``"bagua_" + name`` is each one's FFI target (``minmax`` alone is the 8-bit codec)."""
AXPY_A = 0.5


def native_kernels(ops: Any, n: int, k: int) -> dict[str, Callable]:
    """Every name in ``KERNELS`` -> its native kernel through ``ops`` (``bagua_jax.ops`` or ``bagua_torch.ops``, which
    take the same arguments), for ``n`` float32 elements in ``k`` chunks; the decompressions take what the
    compressions return."""
    m = n // k
    return {
        "minmax_compress": lambda x: ops.minmax_uint8_compress(x, k),
        "minmax_decompress": lambda c: ops.minmax_uint8_decompress(c, n, k),
        "minmax_decompress_reduce": lambda c: ops.minmax_uint8_decompress_reduce(c, m, k),
        "minmax_uint4_compress": lambda x: ops.minmax_uint4_compress(x, k),
        "minmax_uint4_decompress": lambda c: ops.minmax_uint4_decompress(c, n, k),
        "minmax_uint4_decompress_reduce": lambda c: ops.minmax_uint4_decompress_reduce(c, m, k),
        "sign_compress": lambda x: ops.sign_compress(x, k),
        "sign_decompress": lambda c: ops.sign_decompress(c, n, k),
        "sign_decompress_reduce": lambda c: ops.sign_decompress_reduce(c, m, k),
        "axpy": lambda x, y: ops.axpy(x, y, AXPY_A),
        "async_average": lambda x, r, s: ops.async_average(x, r, s, k),
    }


def jitted_native_kernels(ops: Any, n: int, k: int) -> dict[str, Callable]:
    """:func:`native_kernels` through ``ops`` (a ``bagua_jax.ops`` module), each under ``jax.jit``."""
    return {name: jax.jit(kernel) for name, kernel in native_kernels(ops, n, k).items()}


def kernel_call(impl: Any, kernel: str, data: Sequence[Any]) -> tuple[Callable, tuple]:
    """The function and arguments running ``kernel`` on ``impl`` (an object with one attribute per
    name in ``KERNELS`` and ``sync``); decompressions get compressed data."""
    x, y, z = data
    codec, decompression, _ = kernel.partition("_decompress")
    if decompression:
        inputs = getattr(impl, codec + "_compress")(x)
        impl.sync(inputs)
        return getattr(impl, kernel), (inputs,)
    if kernel == "axpy":
        return impl.axpy, (x, y)
    if kernel == "async_average":
        return impl.async_average, (x, y, z)
    return getattr(impl, kernel), (x,)

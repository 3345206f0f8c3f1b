"""Bagua's native kernels on torch tensors.

The tensors travel to the shared native library through DLPack (no C++ is built
against libtorch). CUDA tensors run on ``torch.cuda.current_stream()``; CPU tensors
run on all cores. Every function takes an optional preallocated ``out=``.
Compression flattens its input; the buffer layout is the one the JAX operations
use, so both front ends produce identical bytes.
"""

from __future__ import annotations

from typing import Any, Literal

import _bagua_ffi
import torch

from bagua_common.algorithms.codec_operations import codec_operations
from bagua_common.algorithms.kernel_dtypes import KERNEL_FLOAT_DTYPES
from bagua_common.comm.bagua_net import bagua_net_plugin_path

Format = Literal["minmax_uint8", "minmax_uint4", "sign"]
KERNEL_FLOATS = tuple(getattr(torch, name) for name in KERNEL_FLOAT_DTYPES)
"""The dtypes of :data:`bagua_common.algorithms.kernel_dtypes.KERNEL_FLOAT_DTYPES` as torch dtypes."""


def build_info() -> dict[str, Any]:
    """Report what the native library contains (see ``bagua_jax.build_info``)."""
    return dict(_bagua_ffi.build_info(), bagua_net_plugin=bagua_net_plugin_path())


def compressed_size(n: int, k: int, format: Format = "minmax_uint8") -> int:
    """Return the size in bytes of ``n`` elements compressed into ``k`` chunks."""
    return int(_bagua_ffi.compressed_bytes(format, int(n), int(k)))


def _stream(t: torch.Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.is_cuda else 0


def _float_tensor(name: str, t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in KERNEL_FLOATS:
        raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
    return t.detach().contiguous().view(-1)


def _output(out: torch.Tensor | None, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
    if out.dtype != dtype or out.numel() != numel or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of {numel} elements, got {out.dtype}{list(out.shape)}"
        )
    return out


def _compressed(c: torch.Tensor) -> torch.Tensor:
    if not isinstance(c, torch.Tensor) or c.dtype != torch.uint8:
        raise TypeError("a compressed buffer must be a uint8 torch.Tensor")
    return c.contiguous().view(-1)


def _compress(format: Format, x: torch.Tensor, k: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
    flat = _float_tensor("x", x)
    out = _output(out, compressed_size(flat.numel(), k, format), torch.uint8, flat.device)
    _bagua_ffi.compress(format, flat, out, int(k), _stream(flat))
    return out


def _compress_ef(
    format: Format, x: torch.Tensor, residual: torch.Tensor, k: int, *, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    flat = _float_tensor("x", x)
    if residual.dtype != torch.float32 or residual.numel() != flat.numel() or not residual.is_contiguous():
        raise ValueError(
            f"the residual must be a contiguous float32 tensor of {flat.numel()} elements, "
            f"got {residual.dtype}{list(residual.shape)}"
        )
    out = _output(out, compressed_size(flat.numel(), k, format), torch.uint8, flat.device)
    _bagua_ffi.compress_ef(format, flat, residual.view(-1), out, int(k), _stream(flat))
    return out, residual


def _decompress(
    format: Format,
    compressed: torch.Tensor,
    n: int,
    k: int,
    dtype: torch.dtype = torch.float32,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    compressed = _compressed(compressed)
    out = _output(out, int(n), dtype, compressed.device)
    _bagua_ffi.decompress(format, compressed, out, int(k), _stream(compressed))
    return out


def _decompress_reduce(
    format: Format,
    compressed: torch.Tensor,
    m: int,
    k: int,
    *,
    average: bool = True,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    compressed = _compressed(compressed)
    out = _output(out, int(m), dtype, compressed.device)
    _bagua_ffi.decompress_reduce(format, compressed, out, int(k), bool(average), _stream(compressed))
    return out


_OPERATIONS = (_compress, _compress_ef, _decompress, _decompress_reduce)
"""Each operation of :data:`~bagua_common.algorithms.codec_operations.OPERATIONS` for a codec given first."""


_NOTE = (
    "Takes an optional preallocated ``out=``; the error-feedback ``residual`` (a contiguous float32 tensor) is "
    "updated in place and returned."
)
(
    minmax_uint8_compress,
    minmax_uint8_compress_ef,
    minmax_uint8_decompress,
    minmax_uint8_decompress_reduce,
) = codec_operations("minmax_uint8", _OPERATIONS, module=__name__, note=_NOTE)
(
    minmax_uint4_compress,
    minmax_uint4_compress_ef,
    minmax_uint4_decompress,
    minmax_uint4_decompress_reduce,
) = codec_operations("minmax_uint4", _OPERATIONS, module=__name__, note=_NOTE)
sign_compress, sign_compress_ef, sign_decompress, sign_decompress_reduce = codec_operations(
    "sign", _OPERATIONS, module=__name__, note=_NOTE
)


def _elementwise_operands(*tensors: torch.Tensor) -> list[torch.Tensor]:
    flats = [_float_tensor("operand", t) for t in tensors]
    for t in tensors[1:]:
        if t.dtype != tensors[0].dtype or t.shape != tensors[0].shape:
            raise ValueError(
                f"operands must share dtype and shape, got {tensors[0].dtype}{list(tensors[0].shape)} "
                f"and {t.dtype}{list(t.shape)}"
            )
    return flats


def _shaped_output(like: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return _output(out, like.numel(), like.dtype, like.device)


def average2(a: torch.Tensor, b: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``(a + b) / 2`` computed in float32, in the inputs' dtype and shape."""
    fa, fb = _elementwise_operands(a, b)
    result = _shaped_output(a, out)
    _bagua_ffi.average2(fa, fb, result.view(-1), _stream(fa))
    return result.view(a.shape)


def axpy(x: torch.Tensor, y: torch.Tensor, a: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Return ``x + a * y`` computed in float32; ``out=x`` updates ``x`` in place."""
    fx, fy = _elementwise_operands(x, y)
    result = _shaped_output(x, out)
    _bagua_ffi.axpy(fx, float(a), fy, result.view(-1), _stream(fx))
    return result.view(x.shape)


def async_average(
    x: torch.Tensor,
    reduced: torch.Tensor,
    snapshot: torch.Tensor,
    ranks: int,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return ``x + (reduced / ranks - snapshot)``, the asynchronous model-average update."""
    if int(ranks) != ranks or ranks < 1:
        raise ValueError(f"ranks must be a positive integer, got {ranks}")
    fx, fr, fs = _elementwise_operands(x, reduced, snapshot)
    result = _shaped_output(x, out)
    _bagua_ffi.async_average(fx, fr, fs, int(ranks), result.view(-1), _stream(fx))
    return result.view(x.shape)


def lowprec_decentralized_diff(
    x: torch.Tensor,
    w: torch.Tensor,
    left: torch.Tensor,
    right: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Return ``x + left / 3 + right / 3 - (5 / 3) * w``, computed in float32 as
    ``(x - w) + (left - w) / 3 + (right - w) / 3`` (exactly 0 where all four agree)."""
    fx, fw, fl, fr = _elementwise_operands(x, w, left, right)
    result = _shaped_output(x, out)
    _bagua_ffi.lowprec_decentralized_diff(fx, fw, fl, fr, result.view(-1), _stream(fx))
    return result.view(x.shape)

"""The four operations of each compression codec, named and described once for both front ends' ``ops``.

Every codec of the native library (``minmax_uint8``, ``minmax_uint4``, ``sign``) offers the same
four kernels: compress, compress with error feedback, decompress, and decompress-then-reduce. A
front end writes each operation once, taking the codec as its first argument, and
:func:`codec_operations` makes the public functions (``minmax_uint8_compress``, ...) of it, with
their names and docstrings, so a codec added to the library is one entry of :data:`CODECS`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OPERATIONS = ("compress", "compress_ef", "decompress", "decompress_reduce")
"""The operations of every codec, in the order :func:`codec_operations` returns them."""


@dataclass(frozen=True)
class CodecDescription:
    """How a codec's docstrings speak of it: its ``codes`` in words and the ``detail`` of its compression."""

    codes: str
    detail: str


CODECS: dict[str, CodecDescription] = {
    "minmax_uint8": CodecDescription(
        "8-bit min-max codes",
        "Each chunk stores its float32 minimum and maximum and one code per element, on a 254-step grid "
        "through 0 (SPEC section 2), so exact zeros stay zero; decoding errs by at most ``(hi - lo) / 508`` "
        "plus float32 rounding.",
    ),
    "minmax_uint4": CodecDescription(
        "4-bit min-max codes, two per byte",
        "The 8-bit codec's grid with 14 steps between each chunk's minimum and maximum (16 codes, SPEC "
        "section 2's zero anchor), so exact zeros stay zero; decoding errs by at most ``(hi - lo) / 28`` "
        "plus float32 rounding.",
    ),
    "sign": CodecDescription(
        "signs, one bit per element",
        "Each chunk stores ``scale = mean(|x|)`` and the bits ``x >= 0`` packed eight to a byte, least "
        "significant bit first; decoding gives ``+scale`` or ``-scale``.",
    ),
}
"""Each codec's description, by the name the native library knows it by."""

_DOCSTRINGS = {
    "compress": "Compress ``x`` (flattened) into ``k`` chunks of {codes}.\n\n{detail} Returns a 1-D uint8 "
    "buffer of ``compressed_size(x.size, k, {format!r})`` bytes.",
    "compress_ef": "Compress ``x + residual`` into ``k`` chunks of {codes}; returns ``(compressed, new_residual)``."
    "\n\nThe residual is float32 with ``x``'s size; the new residual is ``(x + residual) - "
    "decompress(compressed)``, so the error of one step is fed into the next (error feedback).",
    "decompress": "Decode ``n`` elements compressed into ``k`` chunks of {codes}, as a 1-D array of ``dtype``.",
    "decompress_reduce": "Decode ``k`` single-chunk buffers of ``m`` elements ({codes}) and sum or average them."
    "\n\n``compressed`` is the ``k`` buffers laid end to end, as an all-to-all of chunks delivers them; the "
    "reduction runs in float32 in buffer order and the result has ``m`` elements of ``dtype``.",
}


def codec_operations(
    format: str, operations: tuple[Callable[..., Any], ...], *, module: str, note: str = ""
) -> tuple[Callable[..., Any], ...]:
    """The public functions of codec ``format``: each of ``operations`` (the front end's, in the order of
    :data:`OPERATIONS`, taking the codec as first argument) bound to it, named ``{format}_{operation}``
    in ``module``, with the codec's docstring and the front end's ``note`` appended."""
    if format not in CODECS:
        raise ValueError(f"unknown codec {format!r}; codecs: {', '.join(CODECS)}")
    if len(operations) != len(OPERATIONS):
        raise ValueError(f"a codec has {len(OPERATIONS)} operations ({', '.join(OPERATIONS)}), got {len(operations)}")
    description = CODECS[format]
    public = []
    for operation, implementation in zip(OPERATIONS, operations):
        bound = _bind(implementation, format)
        bound.__name__ = bound.__qualname__ = f"{format}_{operation}"
        bound.__module__ = module
        doc = _DOCSTRINGS[operation].format(codes=description.codes, detail=description.detail, format=format)
        bound.__doc__ = doc + (f"\n\n{note}" if note else "")
        public.append(bound)
    return tuple(public)


def _bind(implementation: Callable[..., Any], format: str) -> Callable[..., Any]:
    """``implementation`` with its first argument (the codec) fixed to ``format``, and the signature to match."""

    def bound(*args: Any, **kwargs: Any) -> Any:
        return implementation(format, *args, **kwargs)

    signature = inspect.signature(implementation)
    bound.__signature__ = signature.replace(parameters=list(signature.parameters.values())[1:])
    return bound

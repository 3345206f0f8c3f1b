"""The average of the ranks' pseudo-gradients (DiLoCo's outer gradient), written once for both front ends.

A flat float32 buffer of a multiple of ``n = comm.size`` elements goes through one of:

* ``fp32``: an allreduce (average) in float32, the backend's summation order;
* ``bf16``: the ByteGrad pipeline with bfloat16 in place of codes: every rank sends chunk ``j``
  to rank ``j`` as bfloat16 (all-to-all), rank ``j`` sums what it received in float32 in rank
  order and divides by ``n``, and an allgather of that average (bfloat16) hands it to all;
* ``uint8`` / ``uint4``: the min-max pipeline of :mod:`bagua_common.algorithms.compressed_allreduce`
  (ByteGrad) with 8-bit or 4-bit codes.

Every rank ends with the same bits, and JAX and torch send the same bytes for the same input.
Bytes sent per rank: ``2 (n-1)/n`` of the buffer in its wire format (4, 2, about 1 and about
1/2 bytes an element). With a ``residual`` (error feedback), the first compression encodes
``x + residual`` and the new residual is what that encoding lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bagua_common.algorithms.compressed_allreduce import CodecKernels, CompressedAllreduce

Array = Any

Cast = Callable[[Array, str], Array]
"""``cast(x, "bfloat16" | "float32")``: ``x`` converted by the front end (round to nearest even)."""

_CODECS = {"uint8": "minmax_uint8", "uint4": "minmax_uint4"}


class OuterExchange:
    """The pseudo-gradient averages over one front end's ``kernels`` and ``cast``."""

    def __init__(self, kernels: CodecKernels, cast: Cast) -> None:
        self._cast = cast
        self._minmax = CompressedAllreduce(kernels)

    def average(self, flat: Array, comm: Any, wire: str, residual: Array | None = None) -> tuple[Array, Array | None]:
        """The ranks' mean of ``flat`` (float32, 1-D, a multiple of ``comm.size`` elements) sent as ``wire``.

        Returns ``(mean, new residual)``; the residual (float32, like ``flat``) is None unless given.
        """
        n = comm.size
        if flat.ndim != 1 or flat.shape[0] % n:
            raise ValueError(f"a pseudo-gradient buffer must be 1-D with a multiple of {n} elements")
        if wire == "fp32":
            return comm.allreduce(flat, "avg"), residual
        if wire in _CODECS:
            return self._minmax.minmax_allreduce(flat, comm, residual=residual, codec=_CODECS[wire])
        if wire != "bf16":
            raise ValueError(f"unknown outer exchange format {wire!r}")
        sent = flat if residual is None else flat + residual
        packed = self._cast(sent, "bfloat16")
        if residual is not None:
            residual = sent - self._cast(packed, "float32")
        rows = self._cast(comm.alltoall(packed.reshape(n, -1)), "float32")
        total = rows[0]
        for j in range(1, n):  # rank order, so that both front ends round alike
            total = total + rows[j]
        gathered = comm.allgather(self._cast(total / n, "bfloat16"))
        return self._cast(gathered.reshape(-1), "float32"), residual

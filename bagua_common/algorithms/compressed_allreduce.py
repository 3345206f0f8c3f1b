"""Allreduce of a flat bucket through compression (the ByteGrad pipeline) or in full precision, for both front ends.

Each rank splits its bucket (a multiple of ``n = comm.size`` elements) into ``n`` chunks and
compresses them; an all-to-all hands rank r chunk r of every rank; rank r decodes and averages
(or sums) them in float32, compresses that one chunk again, and an allgather hands every rank
all reduced chunks to decode. Every rank ends with the same bits. Bytes sent per rank are about
``2 * (n-1)/n`` of the compressed bucket: a quarter of a float32 ring allreduce for 8-bit codes,
an eighth for 4-bit codes, a thirty-second for 1-bit signs.

The two-level form wraps either pipeline: a full-precision reduce-scatter (average) inside the
node (``intra``), the compressed exchange of this rank's slice across nodes (``inter``), and an
allgather inside the node. :func:`allreduce_over` is the same form with a full-precision
allreduce between nodes (gradient allreduce, and QAdam's warm-up), or one flat allreduce.

A front end supplies its kernels (``bagua_jax.ops`` or ``bagua_torch.ops``: the same functions
on its own arrays) and its communicators; the sequence of operations, and so the bits, are the
same in both. Nothing here blocks on its own or keeps state: under ``jax.jit`` it traces, and
the residuals are returned (torch's kernels also update them in place).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

from bagua_common.comm.collectives import ReduceOp

Array = Any
"""A front end's array: a ``jax.Array`` or a ``torch.Tensor``."""

Levels = tuple[Any, Any] | None
"""``(intra, inter)`` communicators for the two-level form, or None for one flat exchange."""

MinMaxCodec = Literal["minmax_uint8", "minmax_uint4"]
"""The min-max codes on the wire: 8 bits (254 steps per chunk) or 4 bits (14 steps), SPEC section 2."""
MINMAX_CODECS: tuple[str, ...] = ("minmax_uint8", "minmax_uint4")


class CodecKernels(Protocol):
    """The compression kernels a front end's ``ops`` module provides (see ``bagua_jax.ops``)."""

    def minmax_uint8_compress(self, x: Array, k: int) -> Array: ...
    def minmax_uint8_compress_ef(self, x: Array, residual: Array, k: int) -> tuple[Array, Array]: ...
    def minmax_uint8_decompress(self, compressed: Array, n: int, k: int, dtype: Any) -> Array: ...
    def minmax_uint8_decompress_reduce(self, compressed: Array, m: int, k: int, *, average: bool) -> Array: ...
    def minmax_uint4_compress(self, x: Array, k: int) -> Array: ...
    def minmax_uint4_compress_ef(self, x: Array, residual: Array, k: int) -> tuple[Array, Array]: ...
    def minmax_uint4_decompress(self, compressed: Array, n: int, k: int, dtype: Any) -> Array: ...
    def minmax_uint4_decompress_reduce(self, compressed: Array, m: int, k: int, *, average: bool) -> Array: ...
    def sign_compress_ef(self, x: Array, residual: Array, k: int) -> tuple[Array, Array]: ...
    def sign_decompress(self, compressed: Array, n: int, k: int, dtype: Any) -> Array: ...
    def sign_decompress_reduce(self, compressed: Array, m: int, k: int, *, average: bool) -> Array: ...


def _chunk_elements(bucket: Array, comm: Any) -> int:
    n = comm.size
    if bucket.ndim != 1 or bucket.shape[0] % n:
        raise ValueError(f"a bucket must be 1-D with a multiple of {n} elements, got shape {list(bucket.shape)}")
    return bucket.shape[0] // n


def hierarchical(
    exchange: Callable[[Array, Any], Array], bucket: Array, intra: Any, inter: Any, op: ReduceOp = ReduceOp.AVG
) -> Array:
    """Reduce ``bucket`` over ``intra`` x ``inter`` ranks, ``exchange`` doing the part between nodes.

    A full-precision reduce-scatter (``op``: an average by default) inside the node,
    ``exchange(slice, inter)`` (which must reduce a 1-D slice over the ``inter`` ranks the same
    way) between nodes, an allgather inside the node. The bucket needs a multiple of
    ``intra.size * inter.size`` elements.
    """
    mine = intra.reduce_scatter(bucket.reshape(intra.size, -1), op)
    return intra.allgather(exchange(mine, inter)).reshape(-1)


def allreduce_over(bucket: Array, world: Any, levels: Levels, op: ReduceOp = ReduceOp.AVG) -> Array:
    """Allreduce ``bucket`` in full precision (``op`` "avg" or "sum") over ``world``, or with ``levels`` in two.

    SPEC's hierarchical allreduce (reduce inside the node, allreduce between nodes, broadcast
    inside the node) as a reduce-scatter inside the node, an allreduce of this rank's slice
    between nodes and an allgather inside the node: the same sums, but every rank of a node
    carries ``1/intra.size`` of the traffic between nodes (instead of one root all of it) and no
    rank waits on a root. The two-level form needs a multiple of ``intra.size`` elements.
    """
    if levels is None:
        return world.allreduce(bucket, op)
    return hierarchical(lambda mine, inter: inter.allreduce(mine, op), bucket, *levels, op)


class CompressedAllreduce:
    """The compressed allreduces over one front end's ``kernels``; each returns its result and new residuals."""

    def __init__(self, kernels: CodecKernels) -> None:
        self._kernels = kernels

    def minmax_allreduce(
        self,
        bucket: Array,
        comm: Any,
        *,
        levels: Levels = None,
        average: bool = True,
        residual: Array | None = None,
        codec: MinMaxCodec = "minmax_uint8",
    ) -> tuple[Array, Array | None]:
        """Allreduce ``bucket`` over ``comm`` with min-max codes on the wire (ByteGrad): ``(result, new residual)``.

        ``codec`` picks 8-bit (the default, Bagua's) or 4-bit codes. With a float32 ``residual``
        of the bucket's size, the first compression uses error feedback (it encodes
        ``bucket + residual``); without one the second result is None. With ``levels``, the
        two-level form over them instead of ``comm`` (the world): the residual is then this rank's
        intra-node slice's.
        """
        if levels is not None:
            intra, inter = levels
            result, (residual,) = _two_level(
                lambda mine, node_comm: self.minmax_allreduce(
                    mine, node_comm, average=average, residual=residual, codec=codec
                ),
                bucket,
                intra,
                inter,
            )
            if not average:  # the intra-node leg always averages: scale its mean back to a sum
                result = result * intra.size
            return result, residual
        compress, compress_ef, decompress, decompress_reduce = self._minmax_kernels(codec)
        n, m = comm.size, _chunk_elements(bucket, comm)
        if residual is None:
            packed = compress(bucket, n)
        else:
            packed, residual = compress_ef(bucket, residual, n)
        received = comm.alltoall(packed.reshape(n, -1))
        mine = decompress_reduce(received.reshape(-1), m, n, average=average)
        gathered = comm.allgather(compress(mine, 1))
        return decompress(gathered.reshape(-1), n * m, n, bucket.dtype), residual

    def _minmax_kernels(self, codec: MinMaxCodec) -> tuple[Callable[..., Any], ...]:
        """``(compress, compress_ef, decompress, decompress_reduce)`` of ``codec``."""
        if codec not in MINMAX_CODECS:
            raise ValueError(f"unknown min-max codec {codec!r}; use one of {', '.join(MINMAX_CODECS)}")
        operations = ("compress", "compress_ef", "decompress", "decompress_reduce")
        return tuple(getattr(self._kernels, f"{codec}_{operation}") for operation in operations)

    def sign_allreduce(
        self,
        bucket: Array,
        comm: Any,
        worker_residual: Array,
        server_residual: Array,
        *,
        levels: Levels = None,
        average: bool = True,
        scale: float = 1.0,
    ) -> tuple[Array, Array, Array]:
        """Allreduce ``bucket`` over ``comm`` with 1-bit signs and error feedback on both sides (1-bit Adam).

        ``worker_residual`` (float32, the bucket's size) feeds back the error of compressing the
        bucket before the all-to-all; ``server_residual`` (float32, one chunk) the error of
        compressing this rank's reduced chunk before the allgather. Returns the result and both
        new residuals. With ``levels``, the averaging two-level form over them instead of ``comm``
        (the world): the worker residual is then this rank's intra-node slice's. ``scale`` multiplies
        the reduced chunk before the server compresses it (a fault-tolerant step's weighing: the mean
        over the ranks that contributed, the others having sent zeros), so that the server residual
        is what the scaled result left out.
        """
        if levels is not None:
            intra, inter = levels
            result, (worker_residual, server_residual) = _two_level(
                lambda mine, node_comm: self.sign_allreduce(
                    mine, node_comm, worker_residual, server_residual, scale=scale
                ),
                bucket,
                intra,
                inter,
            )
            return result, worker_residual, server_residual
        ops = self._kernels
        n, m = comm.size, _chunk_elements(bucket, comm)
        packed, worker_residual = ops.sign_compress_ef(bucket, worker_residual, n)
        received = comm.alltoall(packed.reshape(n, -1))
        mine = ops.sign_decompress_reduce(received.reshape(-1), m, n, average=average)
        if scale != 1.0:
            mine = mine * scale
        repacked, server_residual = ops.sign_compress_ef(mine, server_residual, 1)
        gathered = comm.allgather(repacked)
        result = ops.sign_decompress(gathered.reshape(-1), n * m, n, bucket.dtype)
        return result, worker_residual, server_residual


def _two_level(
    exchange: Callable[[Array, Any], tuple[Array, ...]], bucket: Array, intra: Any, inter: Any
) -> tuple[Array, tuple[Array, ...]]:
    """:func:`hierarchical` around an ``exchange`` that returns ``(slice result, *new residuals)``: the bucket's
    result and the residuals."""
    residuals: list[tuple[Array, ...]] = []

    def keep_residuals(mine: Array, comm: Any) -> Array:
        result, *new = exchange(mine, comm)
        residuals.append(tuple(new))
        return result

    return hierarchical(keep_residuals, bucket, intra, inter), residuals[0]

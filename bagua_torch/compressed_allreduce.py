"""Allreduce of a flat bucket through compression, on torch tensors: the ByteGrad pipeline.

The same pipelines, step for step, as :mod:`bagua_jax.compressed_allreduce` (same
kernels, same buffer layout, same order of operations), so both front ends produce the
same bits for the same bucket. Each rank splits its bucket (a multiple of
``n = comm.size`` elements) into ``n`` chunks and compresses them; an all-to-all hands
rank r chunk r of every rank; rank r decodes and averages (or sums) them in float32,
compresses that one chunk again, and an allgather hands every rank all reduced chunks
to decode. Every rank ends with the same bits.

These functions block (they call the communicators' synchronous collectives); the
algorithms run them on a worker thread (:meth:`~bagua_torch.algorithms.base.AlgorithmImpl.run_async`).
Residuals are updated in place.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from bagua_torch import ops
from bagua_torch.communicator import Communicator


def _chunk_elements(bucket: torch.Tensor, comm: Communicator) -> int:
    n = comm.size
    if bucket.dim() != 1 or bucket.numel() % n:
        raise ValueError(f"a bucket must be 1-D with a multiple of {n} elements, got shape {list(bucket.shape)}")
    return bucket.numel() // n


def minmax_allreduce(
    bucket: torch.Tensor,
    comm: Communicator,
    *,
    average: bool = True,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """Allreduce ``bucket`` with 8-bit min-max codes on the wire (ByteGrad); returns a new tensor of its dtype.

    With a float32 ``residual`` of the bucket's size, the first compression uses error
    feedback: it encodes ``bucket + residual`` and leaves the new error in ``residual``.
    """
    n, m = comm.size, _chunk_elements(bucket, comm)
    if residual is None:
        packed = ops.minmax_uint8_compress(bucket, n)
    else:
        packed, _ = ops.minmax_uint8_compress_ef(bucket, residual, n)
    received = comm.alltoall(packed.view(n, -1))
    mine = ops.minmax_uint8_decompress_reduce(received.view(-1), m, n, average=average)
    gathered = comm.allgather(ops.minmax_uint8_compress(mine, 1))
    return ops.minmax_uint8_decompress(gathered.view(-1), n * m, n, bucket.dtype)


def sign_allreduce(
    bucket: torch.Tensor,
    comm: Communicator,
    worker_residual: torch.Tensor,
    server_residual: torch.Tensor,
    *,
    average: bool = True,
) -> torch.Tensor:
    """Allreduce ``bucket`` with 1-bit signs and error feedback on both sides (1-bit Adam).

    ``worker_residual`` (float32, the bucket's size) feeds back the error of compressing
    the bucket before the all-to-all; ``server_residual`` (float32, one chunk,
    ``bucket.numel() / n``) the error of compressing this rank's reduced chunk before the
    allgather. Both are updated in place.
    """
    n, m = comm.size, _chunk_elements(bucket, comm)
    packed, _ = ops.sign_compress_ef(bucket, worker_residual, n)
    received = comm.alltoall(packed.view(n, -1))
    mine = ops.sign_decompress_reduce(received.view(-1), m, n, average=average)
    gathered = comm.allgather(ops.sign_compress_ef(mine, server_residual, 1)[0])
    return ops.sign_decompress(gathered.view(-1), n * m, n, bucket.dtype)


def hierarchical(
    exchange: Callable[[torch.Tensor, Communicator], torch.Tensor],
    bucket: torch.Tensor,
    intra: Communicator,
    inter: Communicator,
) -> torch.Tensor:
    """Average ``bucket`` over ``intra`` x ``inter`` ranks, compressing only between nodes.

    A full-precision reduce-scatter (average) inside the node, ``exchange(slice, inter)``
    (which must average a 1-D slice over the ``inter`` ranks) between nodes, an allgather
    inside the node. The bucket needs a multiple of ``intra.size * inter.size`` elements.
    """
    rows = bucket.view(intra.size, -1)
    mine = intra.reduce_scatter(rows, "avg")
    return intra.allgather(exchange(mine, inter)).view(-1)

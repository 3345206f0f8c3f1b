"""NumPy references of the algorithms' communication steps, all n ranks simulated in one process.

Both front ends' tests check their algorithms against these functions, so the JAX and torch
implementations are pinned to the same numbers. They compose the kernel references of
``kernels_reference.py`` (which share no code with the native kernels) as the SPEC describes each
algorithm.
"""

from __future__ import annotations

import kernels_reference as ref
import numpy as np

F32 = np.float32


def assert_params_equal(a: dict, b: dict, msg: str = "") -> None:
    """Assert two ``{name: array}`` dicts hold the same names and the same values bit for bit."""
    assert a.keys() == b.keys()
    for k, value in a.items():
        np.testing.assert_array_equal(value, b[k], err_msg=f"{msg} {k}")


def assert_tree_equal(got, want, msg: str = "") -> None:
    """Assert two nested trees of dicts, lists and tuples hold the same keys, lengths and leaves bit for bit."""
    if isinstance(want, dict):
        assert got.keys() == want.keys(), msg
        for key in want:
            assert_tree_equal(got[key], want[key], f"{msg}/{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), msg
        for i, (a, b) in enumerate(zip(got, want)):
            assert_tree_equal(a, b, f"{msg}[{i}]")
    else:
        np.testing.assert_array_equal(got, want, err_msg=msg)


def max_diff(a: dict, b: dict) -> float:
    """The largest absolute difference between two ``{name: array}`` dicts."""
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def unflatten(flat: list[np.ndarray], buckets: list[list[str]], shapes: dict[str, tuple[int, ...]]) -> dict:
    """The named arrays in flat ``buckets`` (each bucket's names in order, any padding after them)."""
    out = {}
    for names, bucket in zip(buckets, flat):
        offset = 0
        for name in names:
            size = int(np.prod(shapes[name]))
            out[name] = bucket[offset : offset + size].reshape(shapes[name])
            offset += size
    return out


def minmax_allreduce(xs: list[np.ndarray], residuals: list[np.ndarray] | None, average: bool, bits: int = 8):
    """ByteGrad's compressed allreduce among ``len(xs)`` ranks holding ``xs``: compress into k chunks
    of ``bits``-bit codes (with error feedback when ``residuals`` is given), all-to-all the slots,
    decode-reduce, recompress one chunk, gather. Returns (the result every rank decodes, the new
    residuals or None)."""
    k = len(xs)
    m = xs[0].size // k
    compressed = [
        ref.minmax_compress(x, k, None if residuals is None else residuals[r], bits=bits) for r, x in enumerate(xs)
    ]
    slot = compressed[0][0].size // k
    chunks = []
    for r in range(k):
        received = np.concatenate([packed[r * slot : (r + 1) * slot] for packed, _ in compressed])
        mine = ref.decompress_reduce(received, m, k, f"minmax_uint{bits}", average)
        chunks.append(ref.minmax_compress(mine, 1, bits=bits)[0])
    result = ref.minmax_decompress(np.concatenate(chunks), k * m, k, bits=bits)
    return result, None if residuals is None else [res for _, res in compressed]


def bytegrad_bucket(buckets: list[np.ndarray], residuals, *, local: int | None, average: bool):
    """One bucket of ByteGrad over all ranks (``buckets[r]`` is rank r's): flat, or hierarchical with
    ``local`` ranks per node (each node averages in float32, local rank j's slice goes through
    :func:`minmax_allreduce` among the nodes). Returns (the result on every rank, the new residuals
    per rank or None)."""
    n = len(buckets)
    if local is None:
        return minmax_allreduce(buckets, residuals, average)
    a, b = local, n // local
    slices = node_average_slices(buckets, a)
    pieces, fed = [], [None] * n
    for j in range(a):
        group = None if residuals is None else [residuals[i * a + j] for i in range(b)]
        piece, group = minmax_allreduce([slices[i][j] for i in range(b)], group, average)
        pieces.append(piece if average else (piece * F32(a)).astype(F32))
        for i in range(b):
            fed[i * a + j] = None if group is None else group[i]
    return np.concatenate(pieces), (None if residuals is None else fed)


def node_average_slices(buckets: list[np.ndarray], local: int) -> list[list[np.ndarray]]:
    """``[i][j]``: slice j (of ``local``) of node i's bucket averaged in float32 over its ``local``
    ranks (world ranks ``i * local ... i * local + local - 1``), summed in rank order."""
    s = buckets[0].size // local
    out = []
    for i in range(len(buckets) // local):
        row = []
        for j in range(local):
            acc = np.zeros(s, F32)
            for jj in range(local):
                acc = (acc + buckets[i * local + jj][j * s : (j + 1) * s]).astype(F32)
            row.append((acc / F32(local)).astype(F32))
        out.append(row)
    return out


def low_precision_ring_round(xs, ws, lefts, rights):
    """One LowPrecisionDecentralized round among the ``len(xs)`` ranks of a ring, on float32 arrays:
    rank r's local weights ``xs[r]``, its copies ``ws[r]`` of its own weights and ``lefts[r]``,
    ``rights[r]`` of its neighbours'. Each rank sends its 8-bit compressed difference; returns the
    new (weights = copies of its own, left copies, right copies) per rank."""
    n, m = len(xs), xs[0].size
    decoded = [
        ref.minmax_decompress(ref.minmax_compress(ref.lowprec_decentralized_diff(x, w, left, right), 1)[0], m, 1)
        for x, w, left, right in zip(xs, ws, lefts, rights)
    ]
    new_w = [(ws[r] + decoded[r]).astype(F32) for r in range(n)]
    new_left = [(lefts[r] + decoded[(r - 1) % n]).astype(F32) for r in range(n)]
    new_right = [(rights[r] + decoded[(r + 1) % n]).astype(F32) for r in range(n)]
    return new_w, new_left, new_right

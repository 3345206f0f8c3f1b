"""NumPy reference of the kernels' numerics (SPEC section 2), written from the spec.

This module is the definition the native kernels are tested against; it shares no
code with them. Every float32 step is a separate NumPy float32 operation, so the
rounding matches a kernel that rounds each step on its own.
"""

from __future__ import annotations

import numpy as np

HEADER_BYTES = 16
SLOT_ALIGNMENT = 16
MINMAX_GROUP_ELEMENTS = 8192
F32 = np.float32


def chunk_bounds(n: int, k: int) -> list[tuple[int, int]]:
    c = -(-n // k) if n else 0
    return [(min(i * c, n), min((i + 1) * c, n)) for i in range(k)]


def group_bounds(n: int, k: int, format: str) -> list[tuple[int, int]]:
    """The groups of every chunk in order: min-max chunks in groups of MINMAX_GROUP_ELEMENTS from the chunk's
    start (the last one shorter), a sign chunk whole; an empty chunk is one empty group."""
    size = n if format == "sign" else MINMAX_GROUP_ELEMENTS
    groups = []
    for b, e in chunk_bounds(n, k):
        groups += [(g, min(g + size, e)) for g in range(b, e, max(size, 1))] or [(b, b)]
    return groups


def _slot(header: np.ndarray, payload: np.ndarray) -> np.ndarray:
    padded = -(-payload.size // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
    body = np.zeros(padded, np.uint8)
    body[: payload.size] = payload
    return np.concatenate([header.astype(F32).view(np.uint8), body])


def payload_size(elements: int, format: str) -> int:
    """Bytes of a chunk's codes: one per element (8-bit), one per two (4-bit) or one per eight (sign)."""
    per_byte = {"minmax_uint8": 1, "minmax_uint4": 2, "sign": 8}[format]
    return -(-elements // per_byte)


def compressed_size(n: int, k: int, format: str) -> int:
    return sum(
        HEADER_BYTES + -(-payload_size(e - b, format) // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
        for b, e in group_bounds(n, k, format)
    )


def _with_residual(x: np.ndarray, residual: np.ndarray | None) -> np.ndarray:
    y = np.asarray(x).astype(F32).reshape(-1)
    return y if residual is None else (y + residual.astype(F32).reshape(-1)).astype(F32)


# ---- MinMaxUInt8 and MinMaxUInt4 -------------------------------------------------
#
# The same zero-anchored grid for both: 2**bits codes, 2**bits - 2 steps (254 or 14) between a chunk's
# minimum and maximum, the largest code left for rounding. 4-bit codes pack two per byte, element 2i in
# the low nibble of byte i.


def minmax_steps(bits: int) -> int:
    return (1 << bits) - 2


def _order_keys(bits: np.ndarray) -> np.ndarray:
    """int32 keys with the order of the float32 values whose bits these are, and -0 < +0 (its own inverse)."""
    return bits ^ ((bits >> 31) & np.int32(0x7FFFFFFF))


def minmax_bounds(seg: np.ndarray) -> tuple[np.float32, np.float32]:
    """A group's lo and hi: its least and greatest value, with -0 below +0; NaN for both if it holds NaN."""
    if seg.size == 0:
        return F32(0), F32(0)
    if np.isnan(seg).any():
        return F32(np.nan), F32(np.nan)
    keys = _order_keys(seg.astype(F32).view(np.int32))
    lo, hi = _order_keys(np.array([keys.min(), keys.max()], np.int32)).view(F32)
    return lo, hi


def minmax_wide(lo: np.float32, hi: np.float32) -> bool:
    """Whether a finite chunk's grid needs double: a range below 2**-118, or magnitudes of 2**126 or more."""
    magnitude = max(abs(float(lo)), abs(float(hi)))
    with np.errstate(all="ignore"):
        span = float(F32(hi - lo))
    return bool(np.isfinite(magnitude) and (magnitude >= 2.0**126 or 0 < span < 2.0**-118))


def minmax_grid(
    lo: np.float32, hi: np.float32, bits: int = 8
) -> tuple[np.floating, np.floating, np.floating, np.floating]:
    """(z, scale, base, step): the zero-anchored grid of a chunk with bounds lo, hi.

    float32 values, each step rounded to float32; float64 ones for a chunk that float32 cannot grid
    (:func:`minmax_wide`).
    """
    t = np.float64 if minmax_wide(lo, hi) else F32
    z = t(0) if lo <= 0 <= hi else t(lo)
    with np.errstate(all="ignore"):
        span = t(t(hi) - t(lo))
        scale = t(t(minmax_steps(bits)) / span)
        base = np.rint(t(t(t(lo) - z) * scale))
        step = t(span / t(minmax_steps(bits)))
    base = t(0) if np.isnan(base) else t(base)  # a constant chunk: 0 * inf
    return z, scale, base, step


def minmax_encode(seg: np.ndarray, lo: np.float32, hi: np.float32, bits: int = 8) -> np.ndarray:
    z, scale, base, _ = minmax_grid(lo, hi, bits)
    t = type(z)
    with np.errstate(all="ignore"):
        v = (np.rint(((seg.astype(t) - z).astype(t) * scale).astype(t)) - base).astype(t)
    v = np.where(np.isnan(v), t(0), v)  # a constant chunk (0 * inf) or a NaN chunk
    return np.clip(v, 0, (1 << bits) - 1).astype(np.uint8)


def minmax_decode(q: np.ndarray, lo: np.float32, hi: np.float32, bits: int = 8) -> np.ndarray:
    z, _, base, step = minmax_grid(lo, hi, bits)
    k = (q.astype(F32) + F32(base)).astype(F32)
    if type(z) is F32:
        return (z + (k * step).astype(F32)).astype(F32)
    # A wide chunk decodes in float32 on values scaled by a power of two into the normal range, clamped
    # so that scaling back cannot overflow.
    unit = F32(2.0**-64) if max(abs(float(lo)), abs(float(hi))) < 2.0**126 else F32(2.0**64)
    scaled_step = F32(step / np.float64(unit))
    v = (F32(F32(z) / unit) + (k * scaled_step).astype(F32)).astype(F32)
    limit = F32(np.finfo(F32).max * 2.0**-64)
    return (np.clip(v, -limit, limit) * unit).astype(F32)


def assert_within_minmax_bound(x: np.ndarray, decoded: np.ndarray, k: int, bits: int = 8) -> None:
    """The SPEC bound: half a step, (hi - lo) / 508 (8 bits) or / 28 (4 bits), per element, plus float32
    rounding of the step and the result."""
    assert np.isfinite(decoded).all()
    for b, e in chunk_bounds(x.size, k):
        if b == e:
            continue
        seg = x[b:e].astype(np.float64)
        span = seg.max() - seg.min()
        bound = span / (2 * minmax_steps(bits)) + 2**-21 * (span + np.abs(seg)) + 2**-149
        assert np.all(np.abs(decoded[b:e].astype(np.float64) - seg) <= bound)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """4-bit codes two per byte, element 2i in the low nibble of byte i (an odd count's last high nibble: 0)."""
    padded = np.zeros(-(-q.size // 2) * 2, np.uint8)
    padded[: q.size] = q
    return padded[0::2] | (padded[1::2] << 4)


def unpack_nibbles(packed: np.ndarray, count: int) -> np.ndarray:
    return np.stack([packed & 0xF, packed >> 4], axis=1).reshape(-1)[:count]


def minmax_compress(
    x: np.ndarray, k: int, residual: np.ndarray | None = None, bits: int = 8
) -> tuple[np.ndarray, np.ndarray]:
    """Return (compressed bytes, new residual y - decode) for y = x (+ residual), with 8- or 4-bit codes."""
    y = _with_residual(x, residual)
    slots, new_residual = [], np.empty_like(y)
    for b, e in group_bounds(y.size, k, f"minmax_uint{bits}"):
        seg = y[b:e]
        lo, hi = minmax_bounds(seg)
        q = minmax_encode(seg, lo, hi, bits)
        with np.errstate(all="ignore"):
            new_residual[b:e] = seg - minmax_decode(q, lo, hi, bits)
        slots.append(_slot(np.array([lo, hi, 0, 0], F32), q if bits == 8 else pack_nibbles(q)))
    return np.concatenate(slots), new_residual


def _slots(buffer: np.ndarray, n: int, k: int, format: str):
    """(first, end, header, payload) of every group in order."""
    offset = 0
    for b, e in group_bounds(n, k, format):
        header = buffer[offset : offset + 8].view(F32)
        payload = payload_size(e - b, format)
        yield b, e, header, buffer[offset + HEADER_BYTES : offset + HEADER_BYTES + payload]
        offset += HEADER_BYTES + -(-payload // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


def minmax_decompress(buffer: np.ndarray, n: int, k: int, bits: int = 8) -> np.ndarray:
    out = np.empty(n, F32)
    for b, e, header, codes in _slots(buffer, n, k, f"minmax_uint{bits}"):
        q = codes if bits == 8 else unpack_nibbles(codes, e - b)
        out[b:e] = minmax_decode(q, header[0], header[1], bits)
    return out


# ---- 1-bit sign ----------------------------------------------------------------


def sign_scale(seg: np.ndarray) -> np.float32:
    return F32(np.mean(np.abs(seg.astype(np.float64)))) if seg.size else F32(0)


def sign_compress(x: np.ndarray, k: int, residual: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Return (compressed bytes, new residual) for y = x (+ residual)."""
    y = _with_residual(x, residual)
    slots, new_residual = [], np.empty_like(y)
    for b, e in chunk_bounds(y.size, k):
        seg = y[b:e]
        scale = sign_scale(seg)
        bits = seg >= 0
        new_residual[b:e] = seg - np.where(bits, scale, -scale)
        slots.append(_slot(np.array([scale, 0, 0, 0], F32), np.packbits(bits, bitorder="little")))
    return np.concatenate(slots), new_residual


def sign_decompress(buffer: np.ndarray, n: int, k: int) -> np.ndarray:
    out = np.empty(n, F32)
    for b, e, header, packed in _slots(buffer, n, k, "sign"):
        bits = np.unpackbits(packed, bitorder="little")[: e - b].astype(bool)
        out[b:e] = np.where(bits, header[0], -header[0])
    return out


def decompress_reduce(buffers: np.ndarray, m: int, k: int, format: str, average: bool) -> np.ndarray:
    """Sum (or average) in float32, in order, the k single-chunk buffers of m elements."""
    decode = {
        "minmax_uint8": minmax_decompress,
        "minmax_uint4": lambda buffer, n, k: minmax_decompress(buffer, n, k, bits=4),
        "sign": sign_decompress,
    }[format]
    size = compressed_size(m, 1, format)
    decoded = [decode(buffers[j * size : (j + 1) * size], m, 1) for j in range(k)]
    acc = np.zeros(m, F32)
    with np.errstate(over="ignore", invalid="ignore"):
        for d in decoded:
            acc = (acc + d).astype(F32)
        if average:
            acc = (acc / F32(k)).astype(F32)
        # An overflowed float32 sum is summed again with every value scaled by 2**-64, then scaled back.
        scaled = np.zeros(m, F32)
        for d in decoded:
            scaled = (scaled + (d * F32(2.0**-64)).astype(F32)).astype(F32)
        if average:
            scaled = (scaled / F32(k)).astype(F32)
        return np.where(np.isinf(acc), (scaled * F32(2.0**64)).astype(F32), acc)


def chunk_scales(buffer: np.ndarray, n: int, k: int) -> np.ndarray:
    """The per-chunk float32 scales stored in a sign-compressed buffer."""
    return np.array([header[0] for _, _, header, _ in _slots(buffer, n, k, "sign")], F32)


def chunk_bits(buffer: np.ndarray, n: int, k: int) -> np.ndarray:
    """The sign bits (payload bytes) of a sign-compressed buffer, chunk by chunk."""
    return np.concatenate([p for _, _, _, p in _slots(buffer, n, k, "sign")] or [np.zeros(0, np.uint8)])


# ---- Elementwise helpers -------------------------------------------------------
# Each is linear in its tensors; where the float32 result is not finite, the helper runs again on the tensors
# scaled by 2**-64 and the result is scaled back (an intermediate overflow with a finite result).


def _overflow_safe(helper, *tensors: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        result = helper(*(t.astype(F32) for t in tensors))
        scaled = (helper(*((t.astype(F32) * F32(2.0**-64)).astype(F32) for t in tensors)) * F32(2.0**64)).astype(F32)
    return np.where(np.isfinite(result), result, scaled)


def average2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _overflow_safe(lambda a, b: ((a + b).astype(F32) * F32(0.5)).astype(F32), a, b)


def axpy(x: np.ndarray, y: np.ndarray, a: float) -> np.ndarray:
    return _overflow_safe(lambda x, y: (x + (F32(a) * y).astype(F32)).astype(F32), x, y)


def async_average(x: np.ndarray, reduced: np.ndarray, snapshot: np.ndarray, ranks: int) -> np.ndarray:
    def helper(x, reduced, snapshot):
        return (x + ((reduced / F32(ranks)).astype(F32) - snapshot).astype(F32)).astype(F32)

    return _overflow_safe(helper, x, reduced, snapshot)


def lowprec_decentralized_diff(x: np.ndarray, w: np.ndarray, left: np.ndarray, right: np.ndarray) -> np.ndarray:
    def helper(x, w, left, right):
        acc = (x - w).astype(F32)
        acc = (acc + ((left - w).astype(F32) / F32(3)).astype(F32)).astype(F32)
        return (acc + ((right - w).astype(F32) / F32(3)).astype(F32)).astype(F32)

    return _overflow_safe(helper, x, w, left, right)

"""What each CUDA kernel of ``xla_ffi/kernels_cuda.cu`` is designed to do with memory, written once.

Three offline checks and one prediction read it:

* ``tests/test_cuda_shim.py`` runs the kernels under the CPU shim with its access log on
  (``tests/cuda_shim/access_audit.cc``) and compares every kernel's accesses with :data:`ACCESSES`: how
  often each byte of each buffer is read and written, and what share moves in 16-byte and in coalesced
  warp accesses;
* ``tests/test_cuda_resources.py`` compiles the kernels for sm_90 (``ptxas -v``) and fails when a kernel
  spills, or when the warps its registers leave resident (:func:`resident_warps`) keep fewer loads in
  flight than the kernel needs (:func:`needed_warps`);
* ``benchmarks/gpu_check.py`` prints, next to each measured fraction of a device-to-device copy, the
  fraction :func:`predicted_fraction` expects from the same numbers.

**Bytes in flight.** By Little's law a multiprocessor keeps its share of the memory bandwidth busy only
with bandwidth x latency bytes requested and not yet returned. CUB sizes an H200 for 48 KiB of loads in
flight per multiprocessor (``arch_to_min_bytes_in_flight``), for transforms that read about as much as they
write; a kernel whose reads are a share ``r`` of its traffic needs ``48 KiB x 2r`` of loads in flight (a
decoder, whose reads are codes, needs less; a compressor, which writes codes, more). A resident warp keeps
:func:`loads_per_warp` bytes requested ahead of their use.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass

KIB = 1024
LOADS_IN_FLIGHT_PER_SM = 48 * KIB  # CUB's H200 figure, for a transform that reads half its traffic
TILE_ELEMENTS = 8192  # a block's tile: a min-max group (xla_ffi/layout.h, cuda_geometry.h)
WARPS = 8  # warps of a block (256 threads), every kernel
ITEMS_AHEAD = 2  # tiles a block keeps requested from the L2 cache ahead of its work (kItemsAhead)
COMPRESS_ITEMS_AHEAD = 3  # ... min-max compression without feedback, two blocks an SM (kCompressItemsAhead)
REDUCE_PER_LANE = {8: 8, 4: 8, 1: 32}  # decompress-reduce: elements a lane holds, by code bits (kReducePerLane)
REDUCE_CODE_BYTES, REDUCE_CODE_REGISTERS = 192, 64  # min-max: codes a lane loads before adding any, at most
# in this many registers (kReduceInFlight)
SIGN_REDUCE_IN_FLIGHT = 16  # sign: inputs whose words a lane loads before adding any
ELEMENTWISE_BYTES_PER_LANE = 32  # two 16-byte slots of each input, the next step's requested ahead
HEADER_BYTES = 16

# Hopper (sm_90): what bounds the warps a multiprocessor holds.
SM90 = {"registers": 65536, "warps": 64, "blocks": 32, "smem": 228 * KIB, "smem_reserved": KIB}
THREADS = 256  # threads per block, every kernel
H200 = {"sms": 132, "schedulers": 4, "clock_hz": 1.98e9, "copy_bytes_per_s": 3.9e12}
ISSUE_EFFICIENCY = 0.6  # the share of the issue slots a memory-bound loop can count on (research note §1)

SIZES = {"float": 4, "bagua::BFloat16": 2, "bagua::Half": 2}
"""Element bytes of the kernels' dtypes, by the name ptxas's entries give them."""


@dataclass(frozen=True)
class Kernel:
    """One instantiation of a kernel template, parsed from its demangled name."""

    template: str  # minmax_compress, decompress, decompress_reduce, sign_stats, sign_feedback, elementwise, ...
    element: int  # bytes of T
    bits: int = 0  # code bits: 8, 4, or 1 (sign); 0 where there are none
    feedback: bool = False  # a compressor with error feedback (reads and writes a float32 residual)
    inputs: int = 1  # elementwise: tensors read
    slot: int = 1  # U: elements a lane moves in one access of T (16 bytes of them, or 1 where misaligned)


_PARAMS = re.compile(r"^void (\w+)<(.*)>\(")


def _codec_bits(codec: str) -> int:
    if codec == "SignCodec":
        return 1
    return int(re.fullmatch(r"MinMaxCodec<(\d)>", codec).group(1))


def _split(arguments: str) -> list[str]:
    """Template arguments at the top level of nesting."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(arguments):
        depth += {"<": 1, ">": -1}.get(c, 0)
        if c == "," and depth == 0:
            parts.append(arguments[start:i].strip())
            start = i + 1
    return [*parts, arguments[start:].strip()]


def parse_kernel(name: str) -> Kernel | None:
    """The kernel of a demangled ptxas entry name (anonymous namespaces removed), or None for the tiny
    per-chunk header kernels, which move no bulk data."""
    m = _PARAMS.match(name)
    if m is None:
        return None
    template, args = m.group(1), _split(m.group(2))
    if template == "minmax_compress_kernel":  # <kBits, U, T, kFeedback>
        return Kernel("minmax_compress", SIZES[args[2]], int(args[0]), args[3] == "true", slot=int(args[1]))
    if template in ("decompress_kernel", "decompress_reduce_kernel"):  # <Codec, U, T>
        return Kernel(template.removesuffix("_kernel"), SIZES[args[2]], _codec_bits(args[0]), slot=int(args[1]))
    if template == "sign_stats_kernel":  # <U, T, kFeedback>
        return Kernel("sign_stats", SIZES[args[1]], 1, args[2] == "true", slot=int(args[0]))
    if template == "sign_feedback_kernel":  # <U, T>
        return Kernel("sign_feedback", SIZES[args[1]], 1, True, slot=int(args[0]))
    if template == "elementwise_kernel":  # <T, U, N, F>
        return Kernel("elementwise", SIZES[args[0]], inputs=int(args[2]), slot=int(args[1]))
    return None


def traffic(kernel: Kernel, k: int = 8) -> tuple[float, float]:
    """(bytes read, bytes written) per element of the kernel's tensor, as the design moves them from memory
    (headers included); decompress-reduce per output element with ``k`` inputs."""
    codes = kernel.bits / 8
    headers = HEADER_BYTES / TILE_ELEMENTS if kernel.bits in (4, 8) else 0.0
    residual = 4.0 if kernel.feedback else 0.0
    if kernel.template == "minmax_compress":
        return kernel.element + residual, codes + headers + residual
    if kernel.template == "sign_stats":
        return kernel.element + residual, codes
    if kernel.template == "sign_feedback":
        return kernel.element + residual, residual
    if kernel.template == "decompress":
        return codes + headers, kernel.element
    if kernel.template == "decompress_reduce":
        return k * (codes + headers), kernel.element
    return kernel.inputs * kernel.element, kernel.element  # elementwise


def reduce_in_flight(kernel: Kernel) -> int:
    """Decompress-reduce: the inputs whose codes a lane loads before it adds any. A min-max lane holds its
    codes in slots of L elements (U, or all its elements where U = 1); REDUCE_CODE_BYTES of them, as far as
    REDUCE_CODE_REGISTERS registers hold them (each slot's load takes registers of its own until it is used)."""
    if kernel.bits == 1:
        return SIGN_REDUCE_IN_FLIGHT
    per_lane = REDUCE_PER_LANE[kernel.bits]
    slot = per_lane if kernel.slot == 1 else kernel.slot
    by_bytes = REDUCE_CODE_BYTES // (per_lane * kernel.bits // 8)
    return min(by_bytes, REDUCE_CODE_REGISTERS // (per_lane // slot * math.ceil(kernel.bits * slot / 32)))


def loads_per_warp(kernel: Kernel) -> int:
    """Bytes a resident warp keeps requested from memory ahead of their use: a block's ITEMS_AHEAD next tiles
    (L2 prefetches, in no register; COMPRESS_ITEMS_AHEAD for min-max compression without feedback) shared by its
    warps; for decompress-reduce the codes of :func:`reduce_in_flight` inputs a lane loads before adding any;
    for the elementwise helpers a warp's next step of every input."""
    if kernel.template == "minmax_compress" and not kernel.feedback:
        return COMPRESS_ITEMS_AHEAD * TILE_ELEMENTS * kernel.element // WARPS
    if kernel.template in ("minmax_compress", "sign_stats", "sign_feedback"):
        return ITEMS_AHEAD * TILE_ELEMENTS * (kernel.element + (4 if kernel.feedback else 0)) // WARPS
    if kernel.template == "decompress":
        return ITEMS_AHEAD * TILE_ELEMENTS * kernel.bits // 8 // WARPS
    if kernel.template == "decompress_reduce":
        return reduce_in_flight(kernel) * 32 * REDUCE_PER_LANE[kernel.bits] * kernel.bits // 8
    return kernel.inputs * 32 * ELEMENTWISE_BYTES_PER_LANE


def needed_loads(kernel: Kernel, k: int = 8) -> float:
    """Bytes of loads a multiprocessor must keep in flight for the kernel's traffic (the module's note)."""
    read, written = traffic(kernel, k)
    return LOADS_IN_FLIGHT_PER_SM * 2 * read / (read + written)


def needed_warps(kernel: Kernel, k: int = 8) -> int:
    """Resident warps a multiprocessor needs for :func:`needed_loads`; none for U = 1. That variant serves
    tensors that start misaligned or whose chunks are not whole slots: each access moves one element and holds a
    register until it is used, so a 16-bit helper of four inputs cannot keep 48 KiB in flight in any register
    budget. Its design asks only that it does not spill."""
    if kernel.slot == 1:
        return 0
    return math.ceil(needed_loads(kernel, k) / loads_per_warp(kernel))


def resident_warps(registers: int, smem: int = 0) -> int:
    """Warps of a kernel of ``THREADS``-thread blocks one sm_90 multiprocessor holds, given ptxas's
    registers per thread and shared memory per block: registers are allocated 256 a warp."""
    per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    warps = min(SM90["warps"], SM90["registers"] // per_warp)
    blocks = min(SM90["blocks"], warps // (THREADS // 32))
    if smem:
        blocks = min(blocks, SM90["smem"] // (smem + SM90["smem_reserved"]))
    return blocks * (THREADS // 32)


def instruction_budget(kernel: Kernel, k: int = 8) -> float:
    """Lane instructions per element the H200 can issue at the copy's bandwidth for the kernel's bytes
    per element, at :data:`ISSUE_EFFICIENCY`."""
    read, written = traffic(kernel, k)
    lanes_per_s = H200["sms"] * H200["schedulers"] * 32 * H200["clock_hz"]
    elements_per_s = H200["copy_bytes_per_s"] / (read + written)
    return ISSUE_EFFICIENCY * lanes_per_s / elements_per_s


def predicted_fraction(
    kernel: Kernel, registers: int, smem: int = 0, instructions: float | None = None, k: int = 8
) -> float:
    """The fraction of a device-to-device copy's bandwidth (bytes read plus written) the design expects:
    one pass over memory, capped by the loads in flight its resident warps hold and, where ``instructions``
    (SASS lane instructions per element) is known, by the issue rate."""
    in_flight = resident_warps(registers, smem) * loads_per_warp(kernel) / needed_loads(kernel, k)
    fraction = min(1.0, in_flight)
    if instructions:
        fraction = min(fraction, instruction_budget(kernel, k) / instructions)
    return fraction


@dataclass(frozen=True)
class Access:
    """How often each byte of a buffer is read and written by one kernel run (``None``: not checked, as a
    header read by every thread), and the least shares of its bytes that move in 16-byte accesses and in
    coalesced warp accesses."""

    reads: int | None = 0
    writes: int | None = 0
    wide: float = 0.0
    coalesced: float = 0.99


_ONCE_WIDE_IN = Access(reads=1, wide=1.0)
_ONCE_WIDE_OUT = Access(writes=1, wide=1.0)
_CODES_OUT = Access(writes=1)
_CODES_IN = Access(reads=1)
_HEADERS_OUT = Access(writes=1, coalesced=0.0)  # thread 0 of the block writes a group's header
_ANY_HEADER = Access(reads=None, writes=None, coalesced=0.0)  # every thread reads it; or zeroed, summed into, set

ACCESSES: dict[str, dict[str, Access]] = {}
"""kernel run of the access audit -> buffer -> the design's accesses (float32; :func:`accesses` gives a
dtype's); every buffer a run touches is listed."""
for _codec in ("minmax_uint8", "minmax_uint4"):
    ACCESSES[f"{_codec}_compress"] = {
        "x": _ONCE_WIDE_IN,
        "compressed.payload": _CODES_OUT,
        "compressed.header": _HEADERS_OUT,
    }
    ACCESSES[f"{_codec}_compress_feedback"] = {
        **ACCESSES[f"{_codec}_compress"],
        "residual": _ONCE_WIDE_IN,
        "residual_out": _ONCE_WIDE_OUT,
    }
ACCESSES["sign_compress"] = {  # one pass: the bits are written while |x| is summed
    "x": _ONCE_WIDE_IN,
    "compressed.payload": _CODES_OUT,
    "compressed.header": _ANY_HEADER,
}
ACCESSES["sign_compress_feedback"] = {  # two passes: the residual needs the chunk's scale
    "x": Access(reads=2, wide=1.0),
    "residual": Access(reads=2, wide=1.0),
    "residual_out": _ONCE_WIDE_OUT,
    "compressed.payload": _CODES_OUT,
    "compressed.header": _ANY_HEADER,
}
for _codec in ("minmax_uint8", "minmax_uint4", "sign"):
    for _operation in ("decompress", "decompress_reduce"):
        ACCESSES[f"{_codec}_{_operation}"] = {
            "compressed.payload": _CODES_IN,
            "compressed.header": _ANY_HEADER,
            "out": _ONCE_WIDE_OUT,
        }
ACCESSES["axpy"] = {"x": _ONCE_WIDE_IN, "y": _ONCE_WIDE_IN, "out": _ONCE_WIDE_OUT}
ACCESSES["async_average"] = {"x": _ONCE_WIDE_IN, "y": _ONCE_WIDE_IN, "z": _ONCE_WIDE_IN, "out": _ONCE_WIDE_OUT}


def accesses(kernel: str, dtype: str) -> dict[str, Access]:
    """The design's accesses of an audited kernel run on a tensor of ``dtype`` ("f32" or "bf16"). A 16-bit
    slot is 8 elements, so its float32 residuals are 32 bytes: two 16-byte accesses, each taking every other
    16 bytes of the warp's run (its pair of accesses covers the run; each alone is not contiguous)."""
    design = dict(ACCESSES.get(kernel, {}))
    if dtype != "f32":
        for buffer in ("residual", "residual_out"):
            if buffer in design:
                design[buffer] = dataclasses.replace(design[buffer], coalesced=0.0)
    return design


def audit_mismatches(audit: str) -> list[str]:
    """Where the access audit's output (``tests/cuda_shim/access_audit.cc``: one line per kernel, dtype and
    buffer) differs from :data:`ACCESSES`; empty when every kernel moves its bytes as designed."""
    rows: dict[tuple[str, str], dict[str, dict]] = {}
    for line in audit.splitlines():
        kernel, dtype, buffer, _, rmin, rmax, wmin, wmax, wide, coalesced = line.split()
        rows.setdefault((kernel, dtype), {})[buffer] = {
            "reads": (int(rmin), int(rmax)),
            "writes": (int(wmin), int(wmax)),
            "wide": float(wide),
            "coalesced": float(coalesced),
        }
    out = [f"{k} {d}: not audited" for k in ACCESSES for d in ("f32", "bf16") if (k, d) not in rows]
    for (kernel, dtype), buffers in rows.items():
        design = accesses(kernel, dtype)
        for buffer, got in buffers.items():
            want = design.get(buffer)
            if want is None:
                if got["reads"][1] or got["writes"][1]:
                    out.append(f"{kernel} {dtype}: touches {buffer}, which its design does not list")
                continue
            for what in ("reads", "writes"):
                expected = getattr(want, what)
                if expected is not None and got[what] != (expected, expected):
                    out.append(f"{kernel} {dtype} {buffer}: {what} per byte {got[what]}, design {expected}")
            for what in ("wide", "coalesced"):
                if got[what] < getattr(want, what):
                    least = getattr(want, what)
                    out.append(f"{kernel} {dtype} {buffer}: {what} share {got[what]}, design at least {least}")
    return out

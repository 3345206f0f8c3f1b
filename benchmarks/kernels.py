"""Throughput of Bagua's native kernels next to plain jnp, torch and NumPy, and a memory copy.

What is measured
----------------
For float32 inputs of each size, every kernel below runs through the native library
(``bagua_jax.ops`` under ``jax.jit``, the "native" column) and as the same math written
plainly in jitted ``jax.numpy``, in ``torch`` and in NumPy (CPU only). A plain memory
copy of the input runs on the same device in the same run (``jax.jit(jnp.copy)``,
``dst.copy_(src)``, ``np.copyto``); the copy reference is the fastest of them.

    minmax_compress           n float32 -> k chunks of 8-bit min-max codes (groups of 8192)
    minmax_decompress         k chunks of codes -> n float32
    minmax_decompress_reduce  k single-chunk buffers of m = n/k codes -> mean, m float32
    minmax_uint4_*            the same three with 4-bit codes, two a byte
    sign_compress             n float32 -> k chunks of sign bits + mean(|x|) scales
    sign_decompress           k chunks of sign bits -> n float32
    sign_decompress_reduce    k single-chunk buffers of m sign bits -> mean, m float32
    axpy                      x + a * y
    async_average             x + (reduced / ranks - snapshot), ranks = k

Throughput is logical bytes read + written per second (GB/s, 1e9 bytes): the native
kernel's input bytes plus output bytes, e.g. ``4n + compressed_size(n, k)`` for a
compression and ``4n`` read + ``4n`` written for a copy. Every implementation of one
kernel is charged the same byte count, so every ratio is a ratio of times; ratios above
1 mean the native kernel is faster. Each measurement is the median wall time
(``time.perf_counter``) of several calls after three untimed warm-up calls (the first
compiles), waiting on ``block_until_ready`` for JAX and ``torch.cuda.synchronize`` for
CUDA torch. The implementations of one kernel are timed in interleaved rounds (one
call of each per round, in a random order each round), so load from elsewhere on the
machine and the cache state left by the previous call hit them alike. When
``--repeats`` is not given, the number of rounds adapts to the size: at least 3, more
until the calls took a second per implementation, at most 100. The JSON results also
record the median minor page faults per call and the load average before and after.
With torch selected the native kernels are also timed through ``bagua_torch.ops``
("native_torch" in the results).

Every call allocates its output (each front end's default) except the torch and NumPy
copies, which write into a preallocated destination. On CPU the script first asks
glibc (``mallopt``) to keep freed memory for reuse: by default each large output would
land on freshly mapped pages, and faulting in and zeroing them (tens of ms for 256 MiB)
costs more than most of the kernels, hiding the differences between them (see
``retain_freed_memory``); ``--fresh-pages`` keeps the default. Sizes up to a few MiB
fit in the CPU's caches, so those rows measure cache rather than DRAM bandwidth.

Before timing, every implementation's results are checked against the native ones at
the smallest size, so all rows compute the same math. ``n`` is rounded down to a
multiple of ``8 * k`` so that the chunks split evenly and the plain versions need no
padding.

How to run
----------
    python3 benchmarks/kernels.py                 # gpu if JAX sees one, else cpu
    python3 benchmarks/kernels.py --device cpu --sizes 1 16 256 --k 8
    python3 benchmarks/kernels.py --quick         # 1 and 4 MiB smoke run
    python3 benchmarks/kernels.py --device cpu --sizes 64 --against edd8caa   # vs a release

``--against REF`` builds the git ref REF's CPU kernels (once per machine: the build is kept under
``~/.cache/bagua/releases/``) and times them side by side with this tree's, interleaved call by
call, printing the ratio per kernel (see ``kernels_release.py``; it writes ``kernels-cpu-vs-REF.*``).

It prints a table of ratios per size and writes ``kernels-<device>.md`` and
``kernels-<device>.json`` to ``--out`` (default ``benchmarks/results/``; a ``--quick``
run writes ``kernels-<device>-quick.*``), recording the device, the versions, the date,
the command line and whether the done-when criteria hold: on GPU, MinMaxUInt8 compress
and decompress at 256 MiB reach 80% of the copy bandwidth and 2x jitted jnp; on CPU,
the native kernels beat jitted jnp and NumPy for every kernel and size.

The default sizes are 1, 4, 16, 64, 256 and 1024 MiB of float32 input on GPU. On CPU
the default stops at 256 MiB: with freed memory retained, the inputs, outputs and
temporaries of all the frameworks peaked at 9.7 GB of host memory for 256 MiB inputs,
so 1 GiB inputs would need well over the 24 GiB of the 2-core machine this was written
on, and that one size would take longer there than the rest of the run together.
Pass ``--sizes 1 4 16 64 256 1024`` on a larger machine to include it.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

try:
    import resource
except ImportError:  # not on Windows; page faults are then reported as 0
    resource = None  # type: ignore[assignment]

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to torch too

import harness.results
import jax
import jax.numpy as jnp
import numpy as np
from harness.console import Progress
from harness.machine import device_info, retain_freed_memory
from harness.options import add_out_option, add_subset_option
from harness.results import finish_meta, header_lines, run_meta
from native_kernels import AXPY_A, KERNELS, jitted_native_kernels, kernel_call, native_kernels

from bagua_jax import ops as bagua_ops

MIB = 1 << 20
GB = 1e9
BASELINES = ("jnp", "torch", "numpy")
FRAMEWORKS = ("jax", "torch", "numpy")
GPU_SIZES_MIB = (1, 4, 16, 64, 256, 1024)
CPU_SIZES_MIB = (1, 4, 16, 64, 256)
QUICK_SIZES_MIB = (1, 4)
WARMUP_CALLS, MIN_REPEATS, MAX_REPEATS, QUICK_MAX_REPEATS, TARGET_SECONDS = 3, 3, 100, 5, 1.0


# --------------------------------------------------------------------------- plain math


MINMAX_GROUP = 8192  # elements of a min-max group (xla_ffi/layout.h); the sizes here make chunks of whole groups
UINT8_STEPS, UINT4_STEPS = 254, 14  # a group's steps between lo and hi (docs/formats.md)


def xp_minmax_compress(xp: Any, x: Any, k: int, steps: int = UINT8_STEPS) -> tuple[Any, Any, Any]:
    """Min-max codes of ``k`` chunks in groups: ``(codes[g, s], lo[g, 1], hi[g, 1])`` for ``g`` groups of ``s``
    elements, one code a byte, in NumPy or ``jax.numpy`` (``xp``)."""
    chunks = x.reshape(-1, min(MINMAX_GROUP, x.size // k))
    lo = chunks.min(axis=1, keepdims=True)
    hi = chunks.max(axis=1, keepdims=True)
    z, scale, base = xp_minmax_grid(xp, lo, hi, steps)
    codes = xp.clip(xp.rint((chunks - z) * scale) - base, 0, steps + 1).astype(xp.uint8)
    return codes, lo, hi


def xp_minmax_grid(xp: Any, lo: Any, hi: Any, steps: int) -> tuple[Any, Any, Any]:
    """The SPEC's zero-anchored grid: anchor, scale and base code offset of each chunk."""
    z = xp.where((lo <= 0) & (hi >= 0), xp.float32(0), lo)
    with np.errstate(divide="ignore"):  # a constant chunk's steps / 0 is discarded by the where
        scale = xp.where(hi > lo, xp.float32(steps) / (hi - lo), xp.float32(0))
    return z, scale, xp.rint((lo - z) * scale)


def xp_minmax_decode(xp: Any, compressed: tuple[Any, Any, Any], steps: int = UINT8_STEPS) -> Any:
    codes, lo, hi = compressed
    z, _, base = xp_minmax_grid(xp, lo, hi, steps)
    return z + (codes.astype(xp.float32) + base) * ((hi - lo) / xp.float32(steps))


def xp_minmax_uint4_compress(xp: Any, x: Any, k: int) -> tuple[Any, Any, Any]:
    """4-bit min-max codes, two a byte (element ``2i`` in the low nibble of byte ``i``), and each group's range."""
    codes, lo, hi = xp_minmax_compress(xp, x, k, UINT4_STEPS)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), lo, hi


def xp_minmax_uint4_decode(xp: Any, compressed: tuple[Any, Any, Any]) -> Any:
    packed, lo, hi = compressed
    codes = xp.stack([packed & 15, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
    return xp_minmax_decode(xp, (codes, lo, hi), UINT4_STEPS)


def xp_sign_compress(xp: Any, x: Any, k: int) -> tuple[Any, Any]:
    """Chunked sign bits (LSB first) and ``mean(|x|)`` scales: ``(bits[k, c/8], scale[k, 1])``, in NumPy or
    ``jax.numpy`` (``xp``)."""
    chunks = x.reshape(k, -1)
    scale = xp.abs(chunks).mean(axis=1, keepdims=True)
    return xp.packbits(chunks >= 0, axis=1, bitorder="little"), scale


def xp_sign_decode(xp: Any, compressed: tuple[Any, Any]) -> Any:
    """The inverse of :func:`xp_sign_compress`: ``+scale`` or ``-scale`` per element, a row per chunk."""
    bits, scale = compressed
    positive = xp.unpackbits(bits, axis=1, bitorder="little").astype(bool)
    return xp.where(positive, scale, -scale)


def xp_codec_kernels(xp: Any, k: int) -> dict[str, Callable]:
    """:func:`codec_kernels` in NumPy or ``jax.numpy`` (``xp``)."""
    return codec_kernels(
        k,
        ("minmax", partial(xp_minmax_compress, xp, k=k), partial(xp_minmax_decode, xp)),
        ("minmax_uint4", partial(xp_minmax_uint4_compress, xp, k=k), partial(xp_minmax_uint4_decode, xp)),
        ("sign", partial(xp_sign_compress, xp, k=k), partial(xp_sign_decode, xp)),
    )


def torch_minmax_compress(x: Any, k: int, steps: int = UINT8_STEPS) -> tuple[Any, Any, Any]:
    import torch

    chunks = x.view(-1, min(MINMAX_GROUP, x.numel() // k))
    lo, hi = torch.aminmax(chunks, dim=1, keepdim=True)
    z, scale, base = torch_minmax_grid(lo, hi, steps)
    codes = (torch.round((chunks - z) * scale) - base).clamp_(0, steps + 1).to(torch.uint8)
    return codes, lo, hi


def torch_minmax_grid(lo: Any, hi: Any, steps: int) -> tuple[Any, Any, Any]:
    import torch

    z = torch.where((lo <= 0) & (hi >= 0), 0.0, lo)
    scale = torch.where(hi > lo, steps / (hi - lo), 0.0)
    return z, scale, torch.round((lo - z) * scale)


def torch_minmax_decode(compressed: tuple[Any, Any, Any], steps: int = UINT8_STEPS) -> Any:
    codes, lo, hi = compressed
    z, _, base = torch_minmax_grid(lo, hi, steps)
    return z + (codes.float() + base) * ((hi - lo) / steps)


def torch_minmax_uint4_compress(x: Any, k: int) -> tuple[Any, Any, Any]:
    codes, lo, hi = torch_minmax_compress(x, k, UINT4_STEPS)
    return codes[:, 0::2] | (codes[:, 1::2] << 4), lo, hi


def torch_minmax_uint4_decode(compressed: tuple[Any, Any, Any]) -> Any:
    import torch

    packed, lo, hi = compressed
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).view(packed.shape[0], -1)
    return torch_minmax_decode((codes, lo, hi), UINT4_STEPS)


def _bit_shifts(device: Any) -> Any:
    import torch

    return torch.arange(8, dtype=torch.uint8, device=device)


def torch_sign_compress(x: Any, k: int) -> tuple[Any, Any]:
    import torch

    chunks = x.view(k, -1)
    scale = chunks.abs().mean(dim=1, keepdim=True)
    bits = (chunks >= 0).to(torch.uint8).view(k, -1, 8)
    return (bits << _bit_shifts(x.device)).sum(dim=-1, dtype=torch.uint8), scale


def torch_sign_decode(compressed: tuple[Any, Any]) -> Any:
    import torch

    bits, scale = compressed
    positive = ((bits.unsqueeze(-1) >> _bit_shifts(bits.device)) & 1).view(bits.shape[0], -1)
    return torch.where(positive.bool(), scale, -scale)


def torch_codec_kernels(k: int) -> dict[str, Callable]:
    """:func:`codec_kernels` in torch."""
    return codec_kernels(
        k,
        ("minmax", partial(torch_minmax_compress, k=k), torch_minmax_decode),
        ("minmax_uint4", partial(torch_minmax_uint4_compress, k=k), torch_minmax_uint4_decode),
        ("sign", partial(torch_sign_compress, k=k), torch_sign_decode),
    )


def codec_kernels(k: int, *codecs: tuple[str, Callable, Callable]) -> dict[str, Callable]:
    """Each codec's compress, decompress and decompress-reduce, by their names in ``KERNELS``, from its ``(name,
    compress, decode)``: ``compress(x)`` gives the compressed data of ``k`` chunks, ``decode`` takes it back to
    rows of values (a row per group or chunk); decompress-reduce averages the ``k`` chunks."""
    kernels = {}
    for codec, compress, decode in codecs:
        kernels[f"{codec}_compress"] = compress
        kernels[f"{codec}_decompress"] = lambda c, decode=decode: decode(c).reshape(-1)
        kernels[f"{codec}_decompress_reduce"] = lambda c, decode=decode: decode(c).reshape(k, -1).mean(0)
    return kernels


# --------------------------------------------------------------------------- implementations


class Implementation:
    """The kernels of ``KERNELS`` on one framework for ``n`` float32 elements in ``k`` chunks.

    Subclasses set one attribute per name in ``KERNELS`` (each a callable; the
    decompressions take what the same implementation's compression returned) and
    ``copy`` (a callable making a plain copy of one input, or ``None``).
    """

    name = ""
    framework = ""

    def __init__(self, n: int, k: int, device: str) -> None:
        self.n, self.k, self.m, self.device = n, k, n // k, device
        self.copy: Callable[[Any], Any] | None = None

    def to_device(self, a: np.ndarray) -> Any:
        return a

    def to_numpy(self, a: Any) -> np.ndarray:
        return np.asarray(a)

    def sync(self, out: Any) -> None:
        pass


class _JaxImplementation(Implementation):
    framework = "jax"

    def __init__(self, n: int, k: int, device: str) -> None:
        super().__init__(n, k, device)
        self.jax_device = jax.devices(device)[0]

    def to_device(self, a: np.ndarray) -> jax.Array:
        return jax.device_put(a, self.jax_device)

    def sync(self, out: Any) -> None:
        jax.block_until_ready(out)


class NativeJax(_JaxImplementation):
    """Bagua's kernels through the XLA FFI (``bagua_jax.ops``), jitted."""

    name = "native"

    def __init__(self, n: int, k: int, device: str) -> None:
        super().__init__(n, k, device)
        for name, kernel in jitted_native_kernels(bagua_ops, n, k).items():
            setattr(self, name, kernel)


class Jnp(_JaxImplementation):
    """The same math in plain ``jax.numpy``, jitted; its copy is ``jax.jit(jnp.copy)``."""

    name = "jnp"

    def __init__(self, n: int, k: int, device: str) -> None:
        super().__init__(n, k, device)
        for name, kernel in xp_codec_kernels(jnp, k).items():
            setattr(self, name, jax.jit(kernel))
        self.axpy = jax.jit(lambda x, y: x + AXPY_A * y)
        self.async_average = jax.jit(lambda x, r, s: x + (r / k - s))
        self.copy = jax.jit(jnp.copy)


class _TorchImplementation(Implementation):
    framework = "torch"

    def __init__(self, n: int, k: int, device: str) -> None:
        import torch

        super().__init__(n, k, device)
        self.torch = torch
        self.torch_device = torch.device("cuda" if device == "gpu" else "cpu")

    def to_device(self, a: np.ndarray) -> Any:
        return self.torch.from_numpy(a).to(self.torch_device)

    def to_numpy(self, a: Any) -> np.ndarray:
        return a.cpu().numpy()

    def sync(self, out: Any) -> None:
        if self.torch_device.type == "cuda":
            self.torch.cuda.synchronize()


class NativeTorch(_TorchImplementation):
    """Bagua's kernels through the torch front end (``bagua_torch.ops``, DLPack)."""

    name = "native_torch"

    def __init__(self, n: int, k: int, device: str) -> None:
        super().__init__(n, k, device)
        from bagua_torch import ops

        for name, kernel in native_kernels(ops, n, k).items():
            setattr(self, name, kernel)


class Torch(_TorchImplementation):
    """The same math in plain torch; its copy is ``dst.copy_(src)``."""

    name = "torch"

    def __init__(self, n: int, k: int, device: str) -> None:
        super().__init__(n, k, device)
        for name, kernel in torch_codec_kernels(k).items():
            setattr(self, name, kernel)
        self.axpy = lambda x, y: x + AXPY_A * y
        self.async_average = lambda x, r, s: x + (r / k - s)
        self.copy = self._copy
        self._destination: Any = None

    def _copy(self, src: Any) -> Any:
        if self._destination is None or self._destination.shape != src.shape:
            self._destination = self.torch.empty_like(src)
        return self._destination.copy_(src)


class NumPy(Implementation):
    """The same math in NumPy (CPU only); its copy is ``np.copyto(dst, src)``."""

    name = "numpy"
    framework = "numpy"

    def __init__(self, n: int, k: int, device: str) -> None:
        super().__init__(n, k, device)
        for name, kernel in xp_codec_kernels(np, k).items():
            setattr(self, name, kernel)
        self.axpy = lambda x, y: x + np.float32(AXPY_A) * y
        self.async_average = lambda x, r, s: x + (r / np.float32(k) - s)
        self.copy = self._copy
        self._destination: np.ndarray | None = None

    def _copy(self, src: np.ndarray) -> np.ndarray:
        if self._destination is None or self._destination.shape != src.shape:
            self._destination = np.empty_like(src)
        np.copyto(self._destination, src)
        return self._destination


def implementations(frameworks: Sequence[str], n: int, k: int, device: str) -> list[Implementation]:
    """The native implementation first, then the baselines of the selected frameworks."""
    impls: list[Implementation] = [NativeJax(n, k, device)]
    if "jax" in frameworks:
        impls.append(Jnp(n, k, device))
    if "torch" in frameworks:
        impls += [NativeTorch(n, k, device), Torch(n, k, device)]
    if "numpy" in frameworks:
        impls.append(NumPy(n, k, device))
    return impls


# --------------------------------------------------------------------------- measuring


def logical_bytes(kernel: str, n: int, k: int) -> int:
    """Bytes the native kernel reads plus writes for ``n`` float32 elements in ``k`` chunks."""
    f32, m = 4 * n, n // k
    minmax, uint4, sign = (bagua_ops.compressed_size(n, k, f) for f in ("minmax_uint8", "minmax_uint4", "sign"))
    return {
        "minmax_compress": f32 + minmax,
        "minmax_decompress": minmax + f32,
        "minmax_decompress_reduce": k * bagua_ops.compressed_size(m, 1, "minmax_uint8") + 4 * m,
        "minmax_uint4_compress": f32 + uint4,
        "minmax_uint4_decompress": uint4 + f32,
        "minmax_uint4_decompress_reduce": k * bagua_ops.compressed_size(m, 1, "minmax_uint4") + 4 * m,
        "sign_compress": f32 + sign,
        "sign_decompress": sign + f32,
        "sign_decompress_reduce": k * bagua_ops.compressed_size(m, 1, "sign") + 4 * m,
        "axpy": 3 * f32,
        "async_average": 4 * f32,
    }[kernel]


def _minor_page_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0


@dataclass
class Timing:
    """The timed calls of one implementation of one kernel."""

    times: list[float] = field(default_factory=list)
    faults: list[int] = field(default_factory=list)


def time_round_robin(
    calls: Sequence[tuple[Callable, tuple, Callable[[Any], None]]], repeats: int | None, max_repeats: int
) -> list[Timing]:
    """Time ``fn(*args)`` of every ``(fn, args, sync)`` in rounds, one call of each per round.

    Interleaving the implementations, in a fresh random order each round, exposes them
    alike to anything else the machine is doing and to what the previous call left in
    the cache. ``WARMUP_CALLS`` untimed calls of each come first: the first compiles and
    the next let the allocators settle (the first calls of a size still fault in fresh
    pages). With ``repeats`` None, rounds continue until at least ``MIN_REPEATS`` ran
    and the calls took ``TARGET_SECONDS`` per implementation in all, or ``max_repeats``
    rounds ran.
    """
    for fn, args, sync in calls:
        for _ in range(WARMUP_CALLS):
            out = fn(*args)
            sync(out)
            del out
    timings = [Timing() for _ in calls]
    # A fixed order would let one implementation always read inputs that the one before it
    # just pulled into the cache (and another always start cold), which decides the ratio
    # wherever the data fits in the last-level cache; a fresh order every round spreads both.
    order = random.Random(0)
    rounds, spent = 0, 0.0
    while True:
        for (fn, args, sync), timing in order.sample(list(zip(calls, timings, strict=True)), len(calls)):
            faults_before = _minor_page_faults()
            start = time.perf_counter()
            out = fn(*args)
            sync(out)
            elapsed = time.perf_counter() - start
            timing.times.append(elapsed)
            timing.faults.append(_minor_page_faults() - faults_before)
            spent += elapsed
            del out
        rounds += 1
        if repeats is not None:
            if rounds >= repeats:
                return timings
        elif rounds >= max_repeats or (rounds >= MIN_REPEATS and spent >= TARGET_SECONDS * len(calls)):
            return timings


@dataclass
class Measurement:
    size_mib: float
    n: int
    kernel: str  # a name in KERNELS, or "copy"
    impl: str  # native, native_torch, jnp, torch, numpy
    bytes: int
    median_s: float
    repeats: int
    page_faults: float  # median minor page faults per timed call (output pages faulted in)

    @property
    def gbps(self) -> float:
        return self.bytes / self.median_s / GB


def check_jax_copy_is_real(copy: Callable, x: jax.Array) -> None:
    """Fail unless the jitted copy returns a buffer other than its input."""
    out = copy(x)
    out.block_until_ready()
    if out.unsafe_buffer_pointer() == x.unsafe_buffer_pointer():
        raise RuntimeError("jax.jit(jnp.copy) returned its input buffer: the copy was elided")


def measure_size(
    impls: Sequence[Implementation],
    size_mib: float,
    n: int,
    k: int,
    rng: np.random.Generator,
    repeats: int | None,
    max_repeats: int,
    progress: Progress,
) -> list[Measurement]:
    """Time every kernel, and the copies, of every implementation at one size.

    Implementations of one framework share the inputs (the native kernels and jnp use
    the same JAX arrays); the implementations of a kernel are timed together, in rounds.
    """
    host = [rng.standard_normal(n, dtype=np.float32) for _ in range(3)]
    data: dict[str, list[Any]] = {}
    for impl in impls:
        if impl.framework not in data:
            data[impl.framework] = [impl.to_device(a) for a in host]
            impl.sync(data[impl.framework])
    results = []
    jobs = [(kernel, impls, logical_bytes(kernel, n, k)) for kernel in KERNELS]
    jobs.append(("copy", [i for i in impls if i.copy is not None], 8 * n))
    for kernel, members, nbytes in jobs:
        calls = []
        for impl in members:
            inputs = data[impl.framework]
            if kernel == "copy":
                if isinstance(impl, Jnp):
                    check_jax_copy_is_real(impl.copy, inputs[0])
                calls.append((impl.copy, (inputs[0],), impl.sync))
            else:
                calls.append((*kernel_call(impl, kernel, inputs), impl.sync))
        timings = time_round_robin(calls, repeats, max_repeats)
        del calls
        for impl, timing in zip(members, timings, strict=True):
            m = Measurement(
                size_mib,
                n,
                kernel,
                impl.name,
                nbytes,
                statistics.median(timing.times),
                len(timing.times),
                statistics.median(timing.faults),
            )
            progress.line(
                f"{m.size_mib:g} MiB  {m.kernel:<30} {m.impl:<12} {m.gbps:8.2f} GB/s  "
                f"(median {m.median_s * 1e3:.3f} ms of {m.repeats}, {m.page_faults:g} page faults)"
            )
            results.append(m)
    return results


def verify(impls: Sequence[Implementation], n: int, k: int, rng: np.random.Generator) -> None:
    """Check that every implementation computes what the native kernels compute."""
    host = [rng.standard_normal(n, dtype=np.float32) for _ in range(3)]
    chunks = host[0].reshape(k, -1)
    widest = float((chunks.max(axis=1) - chunks.min(axis=1)).max())
    uint8_step, uint4_step = widest / UINT8_STEPS, widest / UINT4_STEPS
    tolerance = {  # (rtol, atol); a min-max code may differ by one step
        "minmax round trip": (0, 1.01 * uint8_step),
        "minmax decompress_reduce": (0, 1.01 * uint8_step),
        "minmax_uint4 round trip": (0, 1.01 * uint4_step),
        "minmax_uint4 decompress_reduce": (0, 1.01 * uint4_step),
        "sign round trip": (1e-4, 1e-6),
        "sign decompress_reduce": (1e-4, 1e-6),
        "axpy": (1e-6, 1e-6),
        "async_average": (1e-6, 1e-6),
    }
    expected = None
    for impl in impls:
        x, y, z = (impl.to_device(a) for a in host)
        got = {
            "minmax round trip": impl.minmax_decompress(impl.minmax_compress(x)),
            "minmax decompress_reduce": impl.minmax_decompress_reduce(impl.minmax_compress(x)),
            "minmax_uint4 round trip": impl.minmax_uint4_decompress(impl.minmax_uint4_compress(x)),
            "minmax_uint4 decompress_reduce": impl.minmax_uint4_decompress_reduce(impl.minmax_uint4_compress(x)),
            "sign round trip": impl.sign_decompress(impl.sign_compress(x)),
            "sign decompress_reduce": impl.sign_decompress_reduce(impl.sign_compress(x)),
            "axpy": impl.axpy(x, y),
            "async_average": impl.async_average(x, y, z),
        }
        got = {name: impl.to_numpy(value) for name, value in got.items()}
        if expected is None:
            expected = got
            continue
        for name, (rtol, atol) in tolerance.items():
            if not np.allclose(got[name], expected[name], rtol=rtol, atol=atol):
                error = np.max(np.abs(got[name] - expected[name]))
                raise AssertionError(f"{impl.name} {name} differs from native by up to {error:g}")


# --------------------------------------------------------------------------- reporting


def ratio_rows(measurements: Sequence[Measurement]) -> list[dict[str, Any]]:
    """Per size and kernel: native GB/s and native throughput over copy, jnp, torch and numpy."""
    table = {(m.size_mib, m.kernel, m.impl): m for m in measurements}
    rows = []
    for size in sorted({m.size_mib for m in measurements}):
        copies = [m.gbps for m in measurements if m.size_mib == size and m.kernel == "copy"]
        copy_gbps = max(copies) if copies else None
        for kernel in KERNELS:
            native = table[(size, kernel, "native")]
            row: dict[str, Any] = {
                "size_mib": size,
                "kernel": kernel,
                "native_gbps": native.gbps,
                "vs_copy": native.gbps / copy_gbps if copy_gbps else None,
            }
            for baseline in BASELINES:
                other = table.get((size, kernel, baseline))
                row[f"vs_{baseline}"] = other.median_s / native.median_s if other else None
            rows.append(row)
    return rows


def criteria(device: str, rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The issue's done-when checks on these results."""
    if device == "gpu":
        checks = [r for r in rows if r["size_mib"] == 256 and r["kernel"] in ("minmax_compress", "minmax_decompress")]
        failures = [
            f"{r['kernel']}: {_fmt(r['vs_copy'])}x copy, {_fmt(r['vs_jnp'])}x jnp"
            for r in checks
            if r["vs_copy"] is None or r["vs_jnp"] is None or r["vs_copy"] < 0.8 or r["vs_jnp"] < 2
        ]
        statement = "MinMaxUInt8 compress and decompress at 256 MiB reach >= 0.8x copy and >= 2x jnp"
        measured = len(checks) == 2 and all(r["vs_copy"] and r["vs_jnp"] for r in checks)
    else:
        failures = [
            f"{r['size_mib']:g} MiB {r['kernel']} vs {b}: {r[f'vs_{b}']:.2f}x"
            for r in rows
            for b in ("jnp", "numpy")
            if r[f"vs_{b}"] is not None and r[f"vs_{b}"] <= 1
        ]
        statement = "the native kernels beat jitted jnp and NumPy for every kernel and size"
        measured = all(r["vs_jnp"] is not None and r["vs_numpy"] is not None for r in rows)
    return {"statement": statement, "measured": measured, "met": measured and not failures, "failures": failures}


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None else format(value, spec)


def ratio_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Markdown lines of the ratio table."""
    lines = [
        "| size (MiB) | kernel | native GB/s | native/copy | native/jnp | native/torch | native/numpy |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size_mib']:g} | {r['kernel']} | {r['native_gbps']:.2f} | {_fmt(r['vs_copy'])} | "
            f"{_fmt(r['vs_jnp'])} | {_fmt(r['vs_torch'])} | {_fmt(r['vs_numpy'])} |"
        )
    return lines


def throughput_table(measurements: Sequence[Measurement]) -> list[str]:
    """Markdown lines of every implementation's GB/s, copies included."""
    impls = [i for i in ("native", "native_torch", "jnp", "torch", "numpy") if any(m.impl == i for m in measurements)]
    table = {(m.size_mib, m.kernel, m.impl): m.gbps for m in measurements}
    lines = ["| size (MiB) | kernel | " + " | ".join(impls) + " |", "|---:|---|" + "---:|" * len(impls)]
    for size in sorted({m.size_mib for m in measurements}):
        for kernel in (*KERNELS, "copy"):
            cells = [_fmt(table.get((size, kernel, i))) for i in impls]
            lines.append(f"| {size:g} | {kernel} | " + " | ".join(cells) + " |")
    return lines


def print_ratios(rows: Sequence[dict[str, Any]], measurements: Sequence[Measurement]) -> None:
    for size in sorted({r["size_mib"] for r in rows}):
        copies = ", ".join(f"{m.impl} {m.gbps:.2f}" for m in measurements if m.size_mib == size and m.kernel == "copy")
        print(f"\n{size:g} MiB float32 input; copy GB/s: {copies or 'not measured'} (reference: the best)")
        print(f"{'kernel':<32}{'GB/s':>9}{'/copy':>8}{'/jnp':>8}{'/torch':>8}{'/numpy':>8}")
        for r in rows:
            if r["size_mib"] == size:
                cells = [_fmt(r[key]) for key in ("vs_copy", "vs_jnp", "vs_torch", "vs_numpy")]
                print(f"{r['kernel']:<32}{r['native_gbps']:9.2f}" + "".join(f"{c:>8}" for c in cells))


def write_results(
    out_dir: Path,
    stem: str,
    meta: dict[str, Any],
    rows: Sequence[dict[str, Any]],
    measurements: Sequence[Measurement],
    verdict: dict[str, Any],
) -> tuple[Path, Path]:
    """Write ``<stem>.md`` and ``<stem>.json`` to ``out_dir``."""
    md = [
        f"# Bagua kernel throughput: {meta['device']['name']}",
        "",
        *header_lines(meta),
        f"- chunks k = {meta['k']}; async_average ranks = k; axpy a = {AXPY_A}",
        f"- timed calls per measurement: {meta['repeats']}; host memory: {meta['host_memory']}",
        "",
        "Throughput is the native kernel's logical bytes read + written per second (GB/s = 1e9 B/s);",
        "every implementation of a kernel is charged the same bytes, so ratios are time ratios and",
        "a ratio above 1 means the native kernel (bagua_jax under jax.jit) is faster. `copy` is the",
        "fastest plain memory copy measured in the same run on the same device (read + write bytes).",
        "",
        f"Done-when check: {verdict['statement']}: **{'met' if verdict['met'] else 'not met'}**"
        + ("" if verdict["measured"] else " (not all the needed rows were measured)"),
    ]
    md += [f"- {f}" for f in verdict["failures"]]
    md += [
        "",
        "## Ratios",
        "",
        *ratio_table(rows),
        "",
        "## Throughput (GB/s) of every implementation",
        "",
        "`native_torch` is the same native kernels called through `bagua_torch.ops`.",
        "",
        *throughput_table(measurements),
        "",
    ]
    payload = {
        **meta,
        "criteria": verdict,
        "ratios": list(rows),
        "measurements": [{**asdict(m), "gbps": m.gbps} for m in measurements],
    }
    return harness.results.write_results(out_dir, stem, md, payload)


# --------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=("cpu", "gpu"), default=None, help="where to run (default: gpu if JAX sees one, else cpu)"
    )
    parser.add_argument(
        "--sizes",
        type=float,
        nargs="+",
        default=None,
        metavar="MIB",
        help="float32 input sizes in MiB (default: 1 4 16 64 256 1024 on gpu, up to 256 on cpu)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: sizes 1 and 4 MiB, at most 5 timed calls each")
    parser.add_argument("--k", type=int, default=8, help="chunk count (default 8)")
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed calls per measurement (default: adaptive, 3 to 100)"
    )
    add_out_option(parser)
    add_subset_option(
        parser, "--frameworks", FRAMEWORKS, "baselines to run (default: jax torch numpy; numpy only on cpu)"
    )
    parser.add_argument(
        "--fresh-pages",
        action="store_true",
        help="on cpu, keep glibc's default of unmapping freed large blocks, so "
        "every output is faulted in afresh (see retain_freed_memory)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed of the inputs")
    parser.add_argument(
        "--against",
        metavar="REF",
        default=None,
        help="instead: build the git ref REF (a release) and time its native CPU kernels side by side "
        "with this tree's, as ratios (default --repeats: 20)",
    )
    args = parser.parse_args(argv)
    if args.k < 1:
        parser.error("--k must be positive")
    if args.repeats is not None and args.repeats < 1:
        parser.error("--repeats must be positive")
    return args


def resolve_defaults(args: argparse.Namespace) -> None:
    """Fill in the device-dependent defaults (this starts JAX's backends)."""
    if args.device is None:
        args.device = "gpu" if jax.default_backend() == "gpu" else "cpu"
    elif args.device == "gpu" and jax.default_backend() != "gpu":
        raise SystemExit("--device gpu: JAX sees no GPU here")
    if args.device == "gpu" and "numpy" in args.frameworks:
        args.frameworks = [f for f in args.frameworks if f != "numpy"]
        print("note: NumPy runs on the CPU only; it is left out of a gpu run", file=sys.stderr)
    if args.sizes is None:
        args.sizes = list(QUICK_SIZES_MIB if args.quick else GPU_SIZES_MIB if args.device == "gpu" else CPU_SIZES_MIB)


def element_count(size_mib: float, k: int) -> int:
    """Float32 elements in ``size_mib`` MiB, rounded down to a multiple of ``8 * k``."""
    n = int(size_mib * MIB) // 4 // (8 * k) * (8 * k)
    if n == 0:
        raise ValueError(f"{size_mib} MiB holds fewer than 8 * k = {8 * k} float32 elements")
    return n


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the benchmark, print the ratios, write the results; return the criteria verdict."""
    args = parse_args(argv)
    argv_used = sys.argv[1:] if argv is None else list(argv)
    if args.against is not None:
        import kernels_release

        if args.device == "gpu":
            raise SystemExit("--against compares the CPU kernels; leave out --device gpu")
        sizes = args.sizes or (QUICK_SIZES_MIB if args.quick else CPU_SIZES_MIB)
        kernels_release.compare(args.against, sizes, args.k, args.repeats or 20, args.out, argv_used)
        return {}
    retained = args.device != "gpu" and not args.fresh_pages and retain_freed_memory()
    resolve_defaults(args)
    retained = retained and args.device == "cpu"
    gpu = jax.devices("gpu")[0].device_kind if args.device == "gpu" else None
    packages = ["jax", "jaxlib", "numpy", *(["torch"] if "torch" in args.frameworks else [])]
    meta = run_meta(
        packages,
        argv=argv_used,
        device=device_info(args.device, gpu),
        k=args.k,
        sizes_mib=args.sizes,
        frameworks=args.frameworks,
        repeats=args.repeats if args.repeats is not None else "adaptive",
        host_memory="freed blocks retained for reuse (mallopt)" if retained else "allocator default",
    )
    if "torch" in args.frameworks:
        import torch

        meta["versions"]["torch_threads"] = torch.get_num_threads()
    if meta["load_average_before"][0] >= 1.0:
        print(
            f"warning: the 1-minute load average is {meta['load_average_before'][0]:.1f}; "
            "other work on this machine will disturb the timings",
            file=sys.stderr,
        )
    print(
        f"device: {meta['device']['name']}; frameworks: {' '.join(args.frameworks)}; "
        f"k = {args.k}; sizes (MiB): {' '.join(f'{s:g}' for s in args.sizes)}",
        flush=True,
    )
    rng = np.random.default_rng(args.seed)
    counts = [element_count(s, args.k) for s in args.sizes]

    verify(implementations(args.frameworks, min(counts), args.k, args.device), min(counts), args.k, rng)
    print("verified: every implementation matches the native kernels", flush=True)

    impls = implementations(args.frameworks, counts[0], args.k, args.device)
    per_size = len(KERNELS) * len(impls) + sum(i.copy is not None for i in impls)
    progress = Progress(per_size * len(counts))
    max_repeats = QUICK_MAX_REPEATS if args.quick else MAX_REPEATS
    measurements: list[Measurement] = []
    for size, n in zip(args.sizes, counts, strict=True):
        impls = implementations(args.frameworks, n, args.k, args.device)
        measurements += measure_size(impls, size, n, args.k, rng, args.repeats, max_repeats, progress)
        del impls

    finish_meta(meta)
    rows = ratio_rows(measurements)
    verdict = criteria(args.device, rows)
    print_ratios(rows, measurements)
    stem = f"kernels-{args.device}" + ("-quick" if args.quick else "")
    paths = write_results(args.out, stem, meta, rows, measurements, verdict)
    outcome = "met" if verdict["met"] else "NOT met" if verdict["measured"] else "not checked (rows missing)"
    print(f"\n{verdict['statement']}: {outcome}")
    for failure in verdict["failures"]:
        print(f"  {failure}")
    print("wrote " + " and ".join(str(p) for p in paths))
    return verdict


if __name__ == "__main__":
    main()

"""The native kernels of this tree against those of a release, side by side: ``kernels.py --against REF``.

Builds the git ref ``REF`` (its CPU kernels only) from ``git archive`` into
``~/.cache/bagua/releases/<commit>-<python>-jaxlib<version>/`` (``$XDG_CACHE_HOME`` if set; kept, so
a second run from any checkout of the repository starts at once), then times both libraries in one
worker process: this tree's ``bagua_jax`` with the native library the caller's ``PYTHONPATH`` (then
the environment) provides, so a build of this tree installed with ``pip install --target DIR`` is
timed with ``PYTHONPATH=DIR``; and the release's native library, loaded beside it under another
module name, its FFI targets registered with the prefix ``release_`` and called through this tree's
``bagua_jax.ops`` with the target names so prefixed (the same custom calls: the release's ``ops``
built the same HLO). The results name both libraries. Both sides time the same kernels on the same
input arrays (``native_kernels.py``: ``bagua_jax.ops`` under ``jax.jit``, float32, ``k`` chunks), one
call at a time, alternating in a fresh random order each round, so both see the same load from the
rest of the machine and the same allocator. Each round gives a paired ratio
``release time / this tree's time`` (above 1: this tree is faster, a regression shows below 1).

Why one process: where a process's buffers lie (which pages, and whether NumPy's huge-page advice
on its freed arrays covers them) moves a 64 MiB kernel's time by up to 20% for that process's whole
life. Two worker processes running one and the same library measured min-max compress at 64 MiB at
CPU-time ratios of 1.17 [1.16, 1.18] in one run and 0.94 [0.94, 0.95] in the next, so a regression
of a few percent between two processes was indistinguishable from their placement. In one process
both sides reuse the same freed buffers. ``PROCESSES`` workers run one after the other; the table
gives, per kernel and size, the median ratio over all rounds with a 95% interval from a two-level
bootstrap (processes, then rounds within each), and the range of the processes' own medians.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BOOTSTRAP_SAMPLES = 2000
PROCESSES = 3
WARMUP_CALLS = 3
RELEASE_PREFIX = "release_"
SIDES = ("this tree", "release")
# The worker keeps freed memory for reuse, as kernels.py does with mallopt (see
# harness.machine.retain_freed_memory): one arena, no mmap for large blocks, no trimming. Its OpenMP
# threads sleep rather than spin between kernels, so the CPU time of a call is its own. NumPy's
# huge-page advice on its large arrays outlives them in the heap, and XLA's buffers landing there or
# not moved the kernels' times by process: without it every buffer has ordinary pages.
WORKER_ENVIRONMENT = {
    "GLIBC_TUNABLES": "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
    "glibc.malloc.trim_threshold=4611686018427387904",
    "OMP_WAIT_POLICY": "PASSIVE",
    "NUMPY_MADVISE_HUGEPAGE": "0",
}


def release_commit(ref: str) -> str:
    """The full commit id of ``ref`` in this repository (a clear error if it names none)."""
    result = subprocess.run(
        ["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if result.returncode:
        raise SystemExit(f"--against {ref}: not a commit of this repository ({result.stderr.strip()})")
    return result.stdout.strip()


def release_home(commit: str) -> Path:
    """Where ``commit``'s build is kept: one folder per commit, Python and jaxlib (the build
    compiles against this environment's jaxlib), shared by every checkout on this machine."""
    from importlib.metadata import version

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "bagua" / "releases" / f"{commit}-{sys.implementation.cache_tag}-jaxlib{version('jaxlib')}"


def build_release(commit: str) -> Path:
    """Build ``commit``'s package (CPU kernels, no CUDA/NCCL/MPI engines) into ``release_home(commit)/site``.

    Reuses a finished build. Needs ``scikit-build-core`` and ``nanobind`` in this environment
    (the build runs without isolation, against this environment's jaxlib).
    """
    home = release_home(commit)
    site = home / "site"
    if any(site.glob("_bagua_ffi*.so")):
        return site
    missing = [m for m in ("scikit_build_core", "nanobind") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"building {commit[:12]} needs {' and '.join(missing)}: pip install '.[benchmarks]'")
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT, capture_output=True, check=True)
    with tempfile.TemporaryDirectory(prefix="bagua-release-") as source:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(source, filter="data")
        env = dict(os.environ, BAGUA_CUDA="OFF", BAGUA_NCCL="OFF", BAGUA_MPI="OFF")
        print(f"building {commit[:12]} into {site} (a few minutes)", flush=True)
        command = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--quiet"]
        command += ["--target", str(site), "-C", f"build-dir={home / 'cmake'}", source]
        subprocess.run(command, env=env, check=True)
    return site


def load_release_library(site: Path) -> ModuleType:
    """Load the release's native library from ``site`` beside this tree's and register its FFI
    targets under ``RELEASE_PREFIX``; return the module."""
    import jax

    path = next(site.glob("_bagua_ffi*.so"))
    loader = importlib.machinery.ExtensionFileLoader("bagua_release._bagua_ffi", str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    for platform, targets in module.registrations().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(RELEASE_PREFIX + name, capsule, platform=platform)
    return module


@contextlib.contextmanager
def release_targets(release: ModuleType) -> Iterator[None]:
    """While tracing in this context, ``bagua_jax.ops`` calls the release's FFI targets and sizes its buffers by
    the release's library (``release``), so that a release of another compressed layout compares too."""
    import jax

    from bagua_jax import ops

    ffi_call, library = jax.ffi.ffi_call, ops.library
    jax.ffi.ffi_call = lambda target, *args, **kwargs: ffi_call(RELEASE_PREFIX + target, *args, **kwargs)
    ops.library = release
    try:
        yield
    finally:
        jax.ffi.ffi_call, ops.library = ffi_call, library


def serve(k: int, site: Path, sizes_mib: Sequence[float], repeats: int, seed: int) -> None:
    """The worker: time every kernel the release has, on both sides at every size, ``repeats`` interleaved
    rounds, and print one JSON object: both libraries' paths and, per size and kernel, each side's rows of
    (wall seconds, CPU seconds of all threads, minor page faults) per call."""
    import resource
    import time
    from types import SimpleNamespace

    import _bagua_ffi
    import jax
    import kernels as bench
    from native_kernels import KERNELS, jitted_native_kernels, kernel_call

    from bagua_jax import ops

    release = load_release_library(site)
    libraries = {SIDES[0]: _bagua_ffi.__file__, SIDES[1]: release.__file__}
    kernels = [kernel for kernel in KERNELS if "bagua_" + kernel in release.registrations()["cpu"]]
    order = random.Random(seed)
    times: dict[str, dict[str, dict[str, list[list[float]]]]] = {}
    for size in sizes_mib:
        n = bench.element_count(size, k)
        rng = np.random.default_rng(seed)
        data = [jax.device_put(rng.standard_normal(n, dtype=np.float32)) for _ in range(3)]
        calls = {}
        for side in SIDES:
            with release_targets(release) if side == SIDES[1] else contextlib.nullcontext():
                impl = SimpleNamespace(**jitted_native_kernels(ops, n, k), sync=jax.block_until_ready)
                calls[side] = {kernel: kernel_call(impl, kernel, data) for kernel in kernels}
                for fn, fn_args in calls[side].values():
                    for _ in range(WARMUP_CALLS):
                        jax.block_until_ready(fn(*fn_args))
        times[str(size)] = {kernel: {side: [] for side in SIDES} for kernel in kernels}
        for kernel in kernels:
            for _ in range(repeats):
                for side in order.sample(SIDES, len(SIDES)):
                    fn, fn_args = calls[side][kernel]
                    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    start, start_cpu = time.perf_counter(), time.process_time()
                    jax.block_until_ready(fn(*fn_args))
                    elapsed = [time.perf_counter() - start, time.process_time() - start_cpu]
                    elapsed.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
                    times[str(size)][kernel][side].append(elapsed)
        del calls, data
    print(json.dumps({"libraries": libraries, "times": times}))


def run_worker(site: Path, sizes_mib: Sequence[float], k: int, repeats: int, seed: int) -> dict[str, Any]:
    """One worker process (see ``serve``); its JSON result."""
    bench_dir = str(Path(__file__).resolve().parent)
    caller_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = {**os.environ, **WORKER_ENVIRONMENT, "PYTHONPATH": os.pathsep.join([bench_dir, str(ROOT), *caller_path])}
    command = [sys.executable, str(Path(__file__)), "--worker", str(k), str(site), str(repeats), str(seed)]
    command += [str(size) for size in sizes_mib]
    result = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"the worker exited with status {result.returncode}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def median_interval(ratios: Sequence[Sequence[float]], rng: np.random.Generator) -> tuple[float, float, float]:
    """The median of all ``ratios`` (one sequence per process) and a 95% interval of it from a
    two-level bootstrap: processes drawn with replacement, then rounds within each drawn one."""
    groups = [np.asarray(g) for g in ratios]
    medians = np.empty(BOOTSTRAP_SAMPLES)
    for b in range(BOOTSTRAP_SAMPLES):
        drawn = [groups[i] for i in rng.integers(len(groups), size=len(groups))]
        medians[b] = np.median(np.concatenate([rng.choice(g, g.size) for g in drawn]))
    low, high = np.quantile(medians, [0.025, 0.975])
    return float(np.median(np.concatenate(groups))), float(low), float(high)


def compare(ref: str, sizes_mib: Sequence[float], k: int, repeats: int, out_dir: Path, argv: Sequence[str]) -> Path:
    """Run the comparison, print the ratio table and write ``kernels-cpu-vs-<ref>.md`` and ``.json``."""
    import kernels as bench
    from harness.results import finish_meta, header_lines, run_meta, write_results

    commit = release_commit(ref)
    site = build_release(commit)
    meta = run_meta(["jax", "jaxlib", "numpy"], argv=argv, release=commit, k=k, processes=PROCESSES)
    meta["uptime_before"] = _uptime()
    results = []
    for p in range(PROCESSES):
        results.append(run_worker(site, sizes_mib, k, repeats, seed=p))
        print(f"worker {p + 1} of {PROCESSES} done", flush=True)
    meta["native_libraries"] = results[0]["libraries"]
    for name, library in meta["native_libraries"].items():
        print(f"{name}: {library}", flush=True)
    compared = list(results[0]["times"][str(sizes_mib[0])])
    meta["not_in_release"] = [kernel for kernel in bench.KERNELS if kernel not in compared]
    if meta["not_in_release"]:
        print(f"not in {ref}, so not compared: {', '.join(meta['not_in_release'])}", flush=True)
    rng = np.random.default_rng(0)
    rows = []
    for size in sizes_mib:
        n = bench.element_count(size, k)
        for kernel in compared:
            current, release = ([np.asarray(r["times"][str(size)][kernel][side]) for r in results] for side in SIDES)
            wall, cpu = (
                median_interval([r[:, column] / c[:, column] for c, r in zip(current, release)], rng)
                for column in (0, 1)
            )
            process_cpu = [float(np.median(r[:, 1] / c[:, 1])) for c, r in zip(current, release)]
            nbytes = bench.logical_bytes(kernel, n, k)
            row = {
                "size_mib": size,
                "kernel": kernel,
                "gbps": nbytes / np.median(np.concatenate(current)[:, 0]) / 1e9,
                "release_gbps": nbytes / np.median(np.concatenate(release)[:, 0]) / 1e9,
                "ratio": wall,
                "cpu_ratio": cpu,
                "process_cpu_ratios": process_cpu,
                "page_faults": float(np.median(np.concatenate(current)[:, 2])),
                "release_page_faults": float(np.median(np.concatenate(release)[:, 2])),
                "repeats": repeats,
            }
            rows.append(row)
            print(
                f"{size:g} MiB {kernel:<30} {row['gbps']:7.2f} vs {row['release_gbps']:7.2f} GB/s  "
                f"wall ratio {_interval(wall)}  CPU-time ratio {_interval(cpu)}  "
                f"processes {min(process_cpu):.2f}-{max(process_cpu):.2f}  "
                f"page faults {row['page_faults']:g} vs {row['release_page_faults']:g}",
                flush=True,
            )
    finish_meta(meta)
    meta["uptime_after"] = _uptime()
    missing = meta["not_in_release"]
    not_compared = [f"- not in the release, so not compared: {', '.join(missing)}"] if missing else []
    lines = [
        f"# Native CPU kernels: this tree against {ref} ({commit[:12]})",
        "",
        *header_lines(meta),
        f"- uptime before: `{meta['uptime_before']}`; after: `{meta['uptime_after']}`",
        f"- chunks k = {k}; {PROCESSES} worker processes one after the other, each timing both libraries "
        f"with {repeats} interleaved calls per kernel and side",
        *(f"- {name}: native library `{library}`" for name, library in meta["native_libraries"].items()),
        *not_compared,
        "",
        "Ratios: the median over all rounds of (release time / this tree's time), with a 95% interval",
        "from a bootstrap over the processes and the rounds within them; above 1 this tree is faster,",
        "below 1 it regressed. Wall: elapsed time of the call; CPU: CPU time of the worker process over",
        "the call (all threads), which the rest of a loaded machine disturbs less. Processes: the lowest",
        "and highest of the processes' own median CPU-time ratios.",
        "",
        "| size (MiB) | kernel | this tree GB/s | release GB/s | wall ratio [95%] | CPU-time ratio [95%] "
        "| processes (CPU) |",
        "|---:|---|---:|---:|---|---|---|",
        *(
            f"| {r['size_mib']:g} | {r['kernel']} | {r['gbps']:.2f} | {r['release_gbps']:.2f} | "
            f"{_interval(r['ratio'])} | {_interval(r['cpu_ratio'])} | "
            f"{min(r['process_cpu_ratios']):.2f}-{max(r['process_cpu_ratios']):.2f} |"
            for r in rows
        ),
        "",
    ]
    stem = f"kernels-cpu-vs-{ref.replace('/', '-')}"
    md, _ = write_results(out_dir, stem, lines, {**meta, "rows": rows})
    print(f"wrote {md}")
    return md


def _interval(ratio: Sequence[float]) -> str:
    return f"{ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}]"


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    serve(int(sys.argv[2]), Path(sys.argv[3]), [float(s) for s in sys.argv[6:]], int(sys.argv[4]), int(sys.argv[5]))

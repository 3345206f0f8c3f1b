"""The native kernels of this tree against those of a release, side by side: ``kernels.py --against REF``.

Builds the git ref ``REF`` (its CPU kernels only) from ``git archive`` into
``~/.cache/bagua/releases/<commit>-<python>-jaxlib<version>/`` (``$XDG_CACHE_HOME`` if set; kept, so
a second run from any checkout of the repository starts at once), then starts two worker
processes: one imports this tree's ``bagua_jax`` and the native library the caller's ``PYTHONPATH``
(then the environment) provides, so a build of this tree installed with ``pip install --target DIR``
is timed with ``PYTHONPATH=DIR``; the other imports the release's package and library only. Each
worker names the native library it loaded, and the results record both. Both time the same
kernels on the same inputs (``kernels.py``'s ``NativeJax``: ``bagua_jax.ops`` under ``jax.jit``,
float32, ``k`` chunks). The driver asks them for one call at a time, alternating in a fresh random
order each round, so both see the same load from the rest of the machine; the idle worker waits on
a pipe meanwhile. Each round gives a paired ratio
``release time / this tree's time`` (above 1: this tree is faster, a regression shows below 1);
the table gives, per kernel and size, the median of those ratios with a 95% bootstrap interval of
the median, and each side's median GB/s.
"""

from __future__ import annotations

import io
import json
import os
import random
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BOOTSTRAP_SAMPLES = 2000
WARMUP_CALLS = 3
# Both workers keep freed memory for reuse, as kernels.py does with mallopt (see
# _common.retain_freed_memory): one arena, no mmap for large blocks, no trimming. Their OpenMP
# threads sleep rather than spin between kernels, so the CPU time of a call is its own.
GLIBC_TUNABLES = "glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=4611686018427387904"


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


class Worker:
    """One side of the comparison: a child process timing single kernel calls on request."""

    def __init__(self, name: str, pythonpath: str, args: Sequence[str]) -> None:
        self.name = name
        env = dict(os.environ, PYTHONPATH=pythonpath, GLIBC_TUNABLES=GLIBC_TUNABLES, OMP_WAIT_POLICY="PASSIVE")
        command = [sys.executable, str(Path(__file__)), "--worker", *args]
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, *request: Any) -> Any:
        """Send one request (a JSON line) and return the reply."""
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        if not reply:
            raise RuntimeError(f"the {self.name} worker exited (status {self.process.wait()})")
        return json.loads(reply)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def serve(k: int) -> None:
    """The worker loop: ``["prepare", n]`` sets up every kernel on ``n`` elements (warmed up);
    ``["time", kernel]`` runs it once and replies with the seconds it took, wall and CPU (all
    threads), and the minor page faults it caused."""
    import resource
    import time
    from types import SimpleNamespace

    import jax
    from native_kernels import KERNELS, jitted_native_kernels, kernel_call

    from bagua_jax import ops

    calls: dict[str, Any] = {}
    for line in sys.stdin:
        request = json.loads(line)
        if request[0] == "library":
            import _bagua_ffi

            reply: Any = _bagua_ffi.__file__
        elif request[0] == "prepare":
            n = request[1]
            impl = SimpleNamespace(**jitted_native_kernels(ops, n, k), sync=jax.block_until_ready)
            rng = np.random.default_rng(0)
            data = [jax.device_put(rng.standard_normal(n, dtype=np.float32)) for _ in range(3)]
            calls = {kernel: kernel_call(impl, kernel, data) for kernel in KERNELS}
            for fn, fn_args in calls.values():
                for _ in range(WARMUP_CALLS):
                    jax.block_until_ready(fn(*fn_args))
            reply = n
        else:
            fn, fn_args = calls[request[1]]
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start, start_cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(fn(*fn_args))
            reply = [time.perf_counter() - start, time.process_time() - start_cpu]
            reply.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
        print(json.dumps(reply), flush=True)


def median_interval(ratios: Sequence[float], rng: np.random.Generator) -> tuple[float, float, float]:
    """The median of ``ratios`` and a 95% bootstrap interval of it."""
    values = np.asarray(ratios)
    resampled = np.median(rng.choice(values, (BOOTSTRAP_SAMPLES, values.size)), axis=1)
    low, high = np.quantile(resampled, [0.025, 0.975])
    return float(np.median(values)), float(low), float(high)


def compare(ref: str, sizes_mib: Sequence[float], k: int, repeats: int, out_dir: Path, argv: Sequence[str]) -> Path:
    """Run the comparison, print the ratio table and write ``kernels-cpu-vs-<ref>.md`` and ``.json``."""
    import _common
    import kernels as bench

    commit = release_commit(ref)
    site = build_release(commit)
    meta = _common.run_meta(argv, _common.device_info("cpu"), ["jax", "jaxlib", "numpy"], release=commit, k=k)
    meta["uptime_before"] = _uptime()
    bench_dir = str(Path(__file__).resolve().parent)
    caller_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    workers = [
        Worker("this tree", os.pathsep.join([bench_dir, str(ROOT), *caller_path]), [str(k)]),
        Worker(f"release {ref}", os.pathsep.join([bench_dir, str(site)]), [str(k)]),
    ]
    meta["native_libraries"] = {w.name: w.ask("library") for w in workers}
    for name, library in meta["native_libraries"].items():
        print(f"{name}: {library}", flush=True)
    order, rng = random.Random(0), np.random.default_rng(0)
    rows = []
    try:
        for size in sizes_mib:
            n = bench.element_count(size, k)
            for w in workers:
                w.ask("prepare", n)
            nbytes = {kernel: bench.logical_bytes(kernel, n, k) for kernel in bench.KERNELS}
            for kernel in bench.KERNELS:
                times: dict[str, list[list[float]]] = {w.name: [] for w in workers}
                for _ in range(repeats):
                    for w in order.sample(workers, len(workers)):
                        times[w.name].append(w.ask("time", kernel))
                current, release = (np.asarray(times[w.name]) for w in workers)
                wall = median_interval(release[:, 0] / current[:, 0], rng)
                cpu = median_interval(release[:, 1] / current[:, 1], rng)
                row = {
                    "size_mib": size,
                    "kernel": kernel,
                    "gbps": nbytes[kernel] / np.median(current[:, 0]) / 1e9,
                    "release_gbps": nbytes[kernel] / np.median(release[:, 0]) / 1e9,
                    "ratio": wall,
                    "cpu_ratio": cpu,
                    "page_faults": float(np.median(current[:, 2])),
                    "release_page_faults": float(np.median(release[:, 2])),
                    "repeats": repeats,
                }
                rows.append(row)
                print(
                    f"{size:g} MiB {kernel:<26} {row['gbps']:7.2f} vs {row['release_gbps']:7.2f} GB/s  "
                    f"wall ratio {_interval(wall)}  CPU-time ratio {_interval(cpu)}  "
                    f"page faults {row['page_faults']:g} vs {row['release_page_faults']:g}",
                    flush=True,
                )
    finally:
        for w in workers:
            w.close()
    _common.finish_meta(meta)
    meta["uptime_after"] = _uptime()
    lines = [
        f"# Native CPU kernels: this tree against {ref} ({commit[:12]})",
        "",
        *_common.header_lines(meta),
        f"- uptime before: `{meta['uptime_before']}`; after: `{meta['uptime_after']}`",
        f"- chunks k = {k}; {repeats} interleaved calls per kernel and side",
        *(f"- {name}: native library `{library}`" for name, library in meta["native_libraries"].items()),
        "",
        "Ratios: the median over rounds of (release time / this tree's time), with a 95% bootstrap",
        "interval of that median; above 1 this tree is faster, below 1 it regressed. Wall: elapsed time",
        "of the call; CPU: CPU time of the worker process over the call (all threads), which the rest of",
        "a loaded machine disturbs less.",
        "",
        "| size (MiB) | kernel | this tree GB/s | release GB/s | wall ratio [95%] | CPU-time ratio [95%] |",
        "|---:|---|---:|---:|---|---|",
        *(
            f"| {r['size_mib']:g} | {r['kernel']} | {r['gbps']:.2f} | {r['release_gbps']:.2f} | "
            f"{_interval(r['ratio'])} | {_interval(r['cpu_ratio'])} |"
            for r in rows
        ),
        "",
    ]
    stem = f"kernels-cpu-vs-{ref.replace('/', '-')}"
    md, _ = _common.write_results(out_dir, stem, lines, {**meta, "rows": rows})
    print(f"wrote {md}")
    return md


def _interval(ratio: Sequence[float]) -> str:
    return f"{ratio[0]:.2f} [{ratio[1]:.2f}, {ratio[2]:.2f}]"


def _uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    serve(int(sys.argv[2]))

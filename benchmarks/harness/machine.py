"""The machine a study runs on: its cores, CPU and GPU in words, the versions of what it runs, its load average,
and glibc's allocator settings for the kernel benchmarks.

It imports neither JAX nor torch (versions are read from the packages' metadata), so a study's parent process,
which only launches workers, stays light.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bagua_common.job.local_launch import mpiexec


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages ([0.0] where unknown)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return [0.0]


def device_info(kind: str = "cpu", gpu: str | None = None) -> dict[str, Any]:
    """The machine a run measured: ``kind`` ("cpu" or "gpu"), the CPU model, its cores, the kernel, the GPU's
    name when there is one, and ``name``, all of it in words."""
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    count = cores()
    info: dict[str, Any] = {
        "kind": kind,
        "cpu_model": model,
        "cores": count,
        "kernel": platform.release(),
        "name": f"{model}, {count} cores",
    }
    if gpu is not None:
        info["gpu"] = gpu
        info["name"] = f"{gpu} (host: {model}, {count} cores)"
    return info


def versions(packages: Sequence[str]) -> dict[str, Any]:
    """Python's version, each of ``packages``' (from its metadata, without importing it; "not installed" when
    absent), mpiexec's when one is found, and the native library's build."""
    out: dict[str, Any] = {"python": sys.version.split()[0]}
    for package in packages:
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = "not installed"
    with contextlib.suppress(RuntimeError, OSError, subprocess.SubprocessError):
        text = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
        found = re.search(r"Version:\s*(\S+)", text)
        out["mpich (hydra)"] = found.group(1) if found else " ".join(text.split())[:80]
    with contextlib.suppress(ImportError):
        import _bagua_ffi  # the native library alone; starts neither JAX nor torch

        out["bagua_build"] = _bagua_ffi.build_info()
    return out


def retain_freed_memory() -> bool:
    """Ask glibc to keep freed memory mapped for reuse; False where that is not possible.

    By default glibc serves large blocks with ``mmap`` and unmaps them on ``free``, so every call's output lands on
    fresh pages that the kernel must fault in and zero (tens of ms for 256 MiB), a cost that swamps what is being
    compared. With one arena (threads' own arenas fall back to ``mmap`` for large blocks whatever the settings),
    ``mmap`` off and trimming off, freed blocks stay in the heap and the next call of the same size reuses them, as
    a GPU caching allocator would. Call it before JAX or torch start their threads.
    """
    m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    settings = ((m_arena_max, 1), (m_mmap_max, 0), (m_trim_threshold, -1))  # -1: never trim
    return all(libc.mallopt(param, value) == 1 for param, value in settings)

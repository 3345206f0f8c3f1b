"""Builds tests/cuda_shim/kernel_suite: the CUDA kernels compiled by g++ under the CPU
execution shim, linked with the CPU kernels of the same tree (kernels_cpu.cc, generic ISA)."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHIM = ROOT / "tests" / "cuda_shim"
KERNELS = ROOT / "xla_ffi"

# As the production build: every float32 step rounded on its own (no FMA contraction).
_FLAGS = [
    "-std=c++17",
    "-O1",
    "-g",
    "-ffp-contract=off",
    "-fno-trapping-math",
    "-Wall",
    "-Werror",
    "-Wno-unknown-pragmas",
    "-Wno-psabi",
    f"-I{SHIM}",
    f"-I{KERNELS}",
]
SANITIZERS = [
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
]


@dataclass(frozen=True)
class ShimPrograms:
    """The programs that run the CUDA kernels under the shim."""

    suite: Path  # tests/cuda_shim/kernel_suite.cc: against the CPU kernels
    audit: Path | None  # tests/cuda_shim/access_audit.cc: the kernels' memory accesses (not in a sanitized build)


def _compile_two_at_a_time(commands: list[list[str]]) -> None:
    """Run the compile commands two at a time, as the 2-core CI machine allows, each starting as soon as a core
    is free (the list's order is the start order: largest first)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda command: subprocess.run(command, text=True, stderr=subprocess.PIPE), commands))
    for result in results:
        if result.returncode != 0:
            raise RuntimeError(f"g++ failed:\n{result.stderr}")


def build_kernel_suite(
    out_dir: Path,
    sanitize: bool = False,
    kernels_cuda: Path = KERNELS / "kernels_cuda.cu",
) -> ShimPrograms:
    """Compile the kernel suite and, unless `sanitize`, the access audit into `out_dir`.

    `kernels_cuda` is the CUDA source to run (a mutated copy in the mutation check); with
    `sanitize`, everything is built with AddressSanitizer and UBSan, and the audit (which checks
    access patterns, not memory safety) is left out.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = _FLAGS + (SANITIZERS if sanitize else [])
    # object -> its sources, largest compile first
    units = {
        "kernels_cuda.o": ["-x", "c++", str(kernels_cuda)],
        "kernels_cpu.o": ["-DBAGUA_CPU_ISA=generic", str(KERNELS / "kernels_cpu.cc")],
        "kernel_suite.o": [str(SHIM / "kernel_suite.cc")],
        "access_audit.o": [str(SHIM / "access_audit.cc")],
        "scheduler.o": [str(SHIM / "scheduler.cc")],
    }
    if sanitize:
        del units["access_audit.o"]
    _compile_two_at_a_time([["g++", *flags, "-c", *src, "-o", str(out_dir / obj)] for obj, src in units.items()])
    programs = ShimPrograms(out_dir / "kernel_suite", None if sanitize else out_dir / "access_audit")
    link = {programs.suite: ["kernels_cuda.o", "kernels_cpu.o", "scheduler.o", "kernel_suite.o"]}
    if programs.audit is not None:
        link[programs.audit] = ["kernels_cuda.o", "scheduler.o", "access_audit.o"]
    for exe, objects in link.items():
        subprocess.run(
            ["g++", *flags, *(str(out_dir / obj) for obj in objects), "-pthread", "-o", str(exe)], check=True
        )
    return programs


def build_geometry_test(out_dir: Path) -> Path:
    """Compile tests/cuda_shim/geometry_test.cc (the 64-bit launch arithmetic) with UBSan."""
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = out_dir / "geometry_test"
    source = SHIM / "geometry_test.cc"
    subprocess.run(
        [
            "g++",
            *_FLAGS,
            "-fsanitize=undefined",
            "-fno-sanitize-recover=all",
            str(source),
            "-o",
            str(exe),
        ],
        check=True,
    )
    return exe


def build_nccl_engine_test(out_dir: Path) -> Path:
    """Compile xla_ffi/nccl_communicator.cc against the fake NCCL (tests/fake_nccl) and the
    shim's host streams, with its test, under ThreadSanitizer."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fake = ROOT / "tests" / "fake_nccl"
    exe = out_dir / "nccl_engine_test"
    sources = [
        KERNELS / "nccl_communicator.cc",
        fake / "fake_nccl.cc",
        SHIM / "host_stream.cc",
        fake / "engine_test.cc",
    ]
    command = ["g++", *_FLAGS, f"-I{fake}", "-fsanitize=thread", *map(str, sources)]
    subprocess.run([*command, "-pthread", "-o", str(exe)], check=True)
    return exe


def build_shim_selftest(out_dir: Path) -> Path:
    """Compile tests/cuda_shim/shim_selftest.cc: kernels that break the rules the shim checks."""
    out_dir.mkdir(parents=True, exist_ok=True)
    exe = out_dir / "shim_selftest"
    sources = [SHIM / "shim_selftest.cc", SHIM / "scheduler.cc"]
    subprocess.run(["g++", *_FLAGS, *map(str, sources), "-pthread", "-o", str(exe)], check=True)
    return exe


SANITIZED_ENV = {"ASAN_OPTIONS": "detect_stack_use_after_return=0:detect_leaks=1"}
"""The sanitized suite's environment: fibers switch stacks with swapcontext, which ASan follows but cannot check
returns across."""


def run_sanitized_suite(out_dir: Path) -> int:
    """Build the kernel suite with AddressSanitizer and UBSan in ``out_dir`` and run its quick case list, its
    output on stdout; the suite's exit status."""
    exe = build_kernel_suite(out_dir / "asan", sanitize=True).suite
    sys.stdout.flush()
    return subprocess.run([str(exe), "--quick"], env={**os.environ, **SANITIZED_ENV}, check=False).returncode


if __name__ == "__main__":
    # python cuda_shim_build.py sanitized-suite FOLDER: tests/background_jobs.py's job of that name.
    if sys.argv[1:2] != ["sanitized-suite"] or len(sys.argv) != 3:
        sys.exit("usage: cuda_shim_build.py sanitized-suite FOLDER")
    sys.exit(run_sanitized_suite(Path(sys.argv[2])))

"""Builds tests/cuda_shim/kernel_suite: the CUDA kernels compiled by g++ under the CPU
execution shim, linked with the CPU kernels of the same tree (kernels_cpu.cc, generic ISA)."""

from __future__ import annotations

import os
import subprocess
import sys
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


def build_kernel_suite(
    out_dir: Path,
    sanitize: bool = False,
    kernels_cuda: Path = KERNELS / "kernels_cuda.cu",
) -> Path:
    """Compile the kernel suite into `out_dir` and return the executable's path.

    `kernels_cuda` is the CUDA source to run (a mutated copy in the mutation check); with
    `sanitize`, everything is built with AddressSanitizer and UBSan. The four translation units
    compile two at a time, as the 2-core CI machine allows.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = _FLAGS + (SANITIZERS if sanitize else [])
    units = [
        (["-x", "c++", str(kernels_cuda)], "kernels_cuda.o"),
        (["-DBAGUA_CPU_ISA=generic", str(KERNELS / "kernels_cpu.cc")], "kernels_cpu.o"),
        ([str(SHIM / "scheduler.cc")], "scheduler.o"),
        ([str(SHIM / "kernel_suite.cc")], "kernel_suite.o"),
    ]
    for pair in (units[:2], units[2:]):
        jobs = [
            subprocess.Popen(
                ["g++", *flags, "-c", *src, "-o", str(out_dir / obj)],
                text=True,
                stderr=subprocess.PIPE,
            )
            for src, obj in pair
        ]
        errors = [job.communicate()[1] for job in jobs]
        for job, err in zip(jobs, errors):
            if job.returncode != 0:
                raise RuntimeError(f"g++ failed:\n{err}")
    exe = out_dir / "kernel_suite"
    objects = [str(out_dir / obj) for _, obj in units]
    subprocess.run(["g++", *flags, *objects, "-pthread", "-o", str(exe)], check=True)
    return exe


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
    exe = build_kernel_suite(out_dir / "asan", sanitize=True)
    sys.stdout.flush()
    return subprocess.run([str(exe), "--quick"], env={**os.environ, **SANITIZED_ENV}, check=False).returncode


if __name__ == "__main__":
    # python cuda_shim_build.py sanitized-suite FOLDER: tests/background_jobs.py's job of that name.
    if sys.argv[1:2] != ["sanitized-suite"] or len(sys.argv) != 3:
        sys.exit("usage: cuda_shim_build.py sanitized-suite FOLDER")
    sys.exit(run_sanitized_suite(Path(sys.argv[2])))

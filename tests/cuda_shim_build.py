"""Builds tests/cuda_shim/kernel_suite: the CUDA kernels compiled by g++ under the CPU
execution shim, linked with the CPU kernels of the same tree (kernels_cpu.cc, generic ISA)."""

from __future__ import annotations

import subprocess
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
    audit: Path  # tests/cuda_shim/access_audit.cc: the kernels' memory accesses


def build_kernel_suite(
    out_dir: Path,
    sanitize: bool = False,
    kernels_cuda: Path = KERNELS / "kernels_cuda.cu",
) -> ShimPrograms:
    """Compile the kernel suite and the access audit into `out_dir`.

    `kernels_cuda` is the CUDA source to run (a mutated copy in the mutation check); with
    `sanitize`, everything is built with AddressSanitizer and UBSan. The translation units
    compile two at a time, as the 2-core CI machine allows.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = _FLAGS + (SANITIZERS if sanitize else [])
    units = [
        (["-x", "c++", str(kernels_cuda)], "kernels_cuda.o"),
        (["-DBAGUA_CPU_ISA=generic", str(KERNELS / "kernels_cpu.cc")], "kernels_cpu.o"),
        ([str(SHIM / "scheduler.cc")], "scheduler.o"),
        ([str(SHIM / "kernel_suite.cc")], "kernel_suite.o"),
        ([str(SHIM / "access_audit.cc")], "access_audit.o"),
    ]
    for pair in (units[:2], units[2:4], units[4:]):
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
    programs = ShimPrograms(out_dir / "kernel_suite", out_dir / "access_audit")
    link = {programs.suite: units[:4], programs.audit: [units[0], units[2], units[4]]}
    for exe, parts in link.items():
        objects = [str(out_dir / obj) for _, obj in parts]
        subprocess.run(["g++", *flags, *objects, "-pthread", "-o", str(exe)], check=True)
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

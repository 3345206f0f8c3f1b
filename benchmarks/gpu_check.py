"""Everything only a GPU machine can check, in one command.

On a machine with an NVIDIA GPU, CUDA (nvcc) and NCCL this:

1. builds the package in place against the machine's jax and NCCL
   (``pip install --no-build-isolation --no-deps -e .``);
2. runs the GPU tests (``pytest -m gpu``), which include the NCCL engine tests
   (tests/test_nccl_engine.py: one rank per process, several processes on one GPU where the
   NCCL version allows it);
3. runs the CUDA kernel tests under compute-sanitizer's memcheck and racecheck tools;
4. runs ``benchmarks/kernels.py --device gpu`` (every kernel against a device-to-device copy
   in the same run).

It writes ``gpu-check.md`` and ``gpu-check.json`` (device, driver, versions, load average, and per
step the command, exit status, time and the tail of its output) to ``--out`` (default
``benchmarks/results/``), and exits
non-zero if any step failed. Without a GPU it says so and exits 2 without running anything.

How to run (from the repository root)::

    python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --skip-build --steps tests sanitizers
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import _common

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def sanitized(tool: str) -> list[str]:
    """The GPU kernel tests under compute-sanitizer's ``tool`` (any finding fails the step)."""
    return [
        "compute-sanitizer",
        "--tool",
        tool,
        "--error-exitcode",
        "1",
        PY,
        "-m",
        "pytest",
        "-q",
        "tests/test_kernels_gpu.py",
    ]


STEPS = {
    "build": [
        PY,
        "-m",
        "pip",
        "install",
        "--no-build-isolation",
        "--no-deps",
        "-e",
        ".",
    ],
    "tests": [PY, "-m", "pytest", "-q", "-m", "gpu"],
    "memcheck": sanitized("memcheck"),
    "racecheck": sanitized("racecheck"),
    "kernels": [PY, "benchmarks/kernels.py", "--device", "gpu"],
}
TAIL_LINES = 40
PACKAGES = ("jax", "jaxlib", "torch", "nvidia-nccl-cu12", "nvidia-nccl-cu13")


def gpu_description() -> str | None:
    """The GPUs as nvidia-smi lists them, or None when there is none to use."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = [
        "nvidia-smi",
        "--query-gpu=name,driver_version,memory.total",
        "--format=csv,noheader",
    ]
    result = subprocess.run(query, check=False, capture_output=True, text=True)
    if result.returncode != 0 or not result.stdout.strip():
        return None
    return result.stdout.strip()


def versions_after_build(before: dict) -> dict:
    """The versions :func:`_common.versions` gives, read in a fresh interpreter (the build step may
    have replaced the native module this process would report); ``before``, those read at the
    start, where that interpreter cannot import the package (a failed build)."""
    probe = f"import _common, json; print(json.dumps(_common.versions({list(PACKAGES)!r})))"
    result = subprocess.run([PY, "-c", probe], check=False, cwd=Path(__file__).parent, capture_output=True, text=True)
    return json.loads(result.stdout.splitlines()[-1]) if result.returncode == 0 else before


def nvcc_version() -> str:
    """nvcc's release line, or "not found"."""
    if shutil.which("nvcc") is None:
        return "not found"
    nvcc = subprocess.run(["nvcc", "--version"], check=False, capture_output=True, text=True)
    return (nvcc.stdout.strip().splitlines() or ["unknown"])[-1]


def run_step(name: str, command: list[str], timeout_s: float) -> dict:
    """Run one step from the repository root; return its outcome for the report."""
    start = time.monotonic()
    try:
        result = subprocess.run(
            command,
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        status, output = result.returncode, result.stdout + result.stderr
    except FileNotFoundError as error:
        status, output = 127, str(error)
    except subprocess.TimeoutExpired as error:
        status, output = (
            "timeout",
            f"did not finish within {timeout_s:g} s\n{error.stdout or ''}",
        )
    seconds = time.monotonic() - start
    print(
        f"{name}: {'ok' if status == 0 else f'FAILED ({status})'} in {seconds:.0f} s",
        flush=True,
    )
    return {
        "name": name,
        "command": " ".join(command),
        "status": status,
        "seconds": seconds,
        "tail": "\n".join(str(output).splitlines()[-TAIL_LINES:]),
    }


def report_lines(meta: dict, outcomes: list[dict]) -> list[str]:
    """The Markdown report of the run."""
    lines = [
        "# GPU check",
        "",
        *_common.header_lines(meta),
        f"- nvcc: {meta['nvcc']}",
        "",
        "| step | status | seconds |",
        "|---|---|---|",
    ]
    lines += [f"| {o['name']} | {'ok' if o['status'] == 0 else o['status']} | {o['seconds']:.0f} |" for o in outcomes]
    for o in outcomes:
        lines += [
            "",
            f"## {o['name']}",
            "",
            f"`{o['command']}`",
            "",
            "```",
            o["tail"],
            "```",
        ]
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _common.add_subset_option(parser, "--steps", list(STEPS), "steps to run (default: all, in order)")
    parser.add_argument("--skip-build", action="store_true", help="use the installed build")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per step")
    _common.add_out_option(parser)
    args = parser.parse_args(argv)
    device = gpu_description()
    if device is None:
        print("gpu_check: no NVIDIA GPU here (nvidia-smi finds none); nothing was run")
        return 2
    steps = [s for s in args.steps if not (args.skip_build and s == "build")]
    gpus = "; ".join(device.splitlines())
    meta = _common.run_meta(sys.argv[1:] if argv is None else argv, _common.device_info("gpu", gpus), PACKAGES)
    outcomes = [run_step(name, STEPS[name], args.timeout) for name in steps]
    _common.finish_meta(meta)
    meta.update(versions=versions_after_build(meta["versions"]), nvcc=nvcc_version())
    report, _ = _common.write_results(args.out, "gpu-check", report_lines(meta, outcomes), {**meta, "steps": outcomes})
    print(f"wrote {report}")
    return 0 if all(o["status"] == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

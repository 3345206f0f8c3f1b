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

It writes ``gpu-check.md`` (device, driver, versions, and per step the command, exit status,
time and the tail of its output) to ``--out`` (default ``benchmarks/results/``), and exits
non-zero if any step failed. Without a GPU it says so and exits 2 without running anything.

How to run (from the repository root)::

    python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --skip-build --steps tests sanitizers
"""

from __future__ import annotations

import argparse
import datetime
import platform
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


def versions() -> str:
    """Python, jax, torch, NCCL and nvcc versions, as far as they can be found."""
    probe = (
        "import importlib.metadata as m\n"
        "for p in ('jax', 'jaxlib', 'torch', 'nvidia-nccl-cu12', 'nvidia-nccl-cu13'):\n"
        "    try: print(p, m.version(p))\n"
        "    except m.PackageNotFoundError: pass\n"
    )
    packages = subprocess.run([PY, "-c", probe], check=False, capture_output=True, text=True)
    lines = [f"python {platform.python_version()}", *packages.stdout.splitlines()]
    if shutil.which("nvcc"):
        nvcc = subprocess.run(["nvcc", "--version"], check=False, capture_output=True, text=True)
        lines += nvcc.stdout.strip().splitlines()[-1:]
    return "\n".join(line for line in lines if line)


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


def write_report(path: Path, device: str, outcomes: list[dict]) -> None:
    """Write the Markdown report of the run."""
    when = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}"
    lines = [
        "# GPU check",
        "",
        f"Run {when} with `python benchmarks/gpu_check.py {' '.join(sys.argv[1:])}`.",
        "",
        f"Device: {device}",
        "",
        "```",
        versions(),
        "```",
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
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _common.add_subset_option(parser, "--steps", list(STEPS), "steps to run (default: all, in order)")
    parser.add_argument("--skip-build", action="store_true", help="use the installed build")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per step")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    device = gpu_description()
    if device is None:
        print("gpu_check: no NVIDIA GPU here (nvidia-smi finds none); nothing was run")
        return 2
    steps = [s for s in args.steps if not (args.skip_build and s == "build")]
    outcomes = [run_step(name, STEPS[name], args.timeout) for name in steps]
    args.out.mkdir(parents=True, exist_ok=True)
    report = args.out / "gpu-check.md"
    write_report(report, device, outcomes)
    print(f"wrote {report}")
    return 0 if all(o["status"] == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

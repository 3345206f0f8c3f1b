"""Everything only a GPU machine can check, in one command.

On a machine with an NVIDIA GPU, CUDA (nvcc) and NCCL this:

1. builds the package against the machine's jax and NCCL, for its GPU's architecture only
   (``BAGUA_CUDA=ON BAGUA_NCCL=ON pip install --no-build-isolation --no-deps .``);
2. times the CUDA kernels alone (``benchmarks/kernel_bandwidth.py``: CUDA events, the L2 cache
   flushed between repeats, bytes read plus written, k = 8, 64 and 512 chunks, float32 and
   bfloat16, against cudaMemcpy, a 16-byte copy kernel, the theoretical peak and the design's
   prediction; Nsight Compute's memory metrics where ``ncu`` is present), into
   ``kernel-bandwidth-<device>.md``; it builds what it needs itself, so ``--steps bandwidth``
   runs it alone (about 2 minutes);
3. runs real NCCL with Bagua-Net as its network in a 2-rank job on the one GPU
   (``tests/bagua_net_nccl_job.py``: NCCL's debug output, the allreduce's result, bandwidth);
4. runs ``benchmarks/kernels.py --device gpu`` (every kernel against a device-to-device copy
   and XLA-fused jnp in the same run);
5. runs the GPU tests (the files that mark tests ``gpu``, and the build's), which include the NCCL engine tests
   (tests/test_nccl_engine.py), and the CUDA kernel tests under compute-sanitizer's memcheck
   and racecheck tools.

The steps that time something (2-4) run alone, one after the other; the steps of 5 time
nothing, so they run side by side to fit a lent machine's minutes. It writes
``gpu-check.md`` and ``gpu-check.json`` (device, driver, versions, load average, and per
step the command, exit status, time and the tail of its output) to ``--out`` (default
``benchmarks/results/``), each step's whole output to ``logs/gpu-check.log`` under it, and
exits non-zero if any step failed. Without a GPU it says so and exits 2 without running
anything.

How to run (from the repository root)::

    python benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --steps bandwidth
    python benchmarks/gpu_check.py --skip-build --steps tests memcheck
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from harness.machine import cores, device_info
from harness.options import add_out_option, add_subset_option
from harness.results import command_line, finish_meta, header_lines, run_meta, write_results

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


def gpu_test_files() -> list[str]:
    """The test files that mark GPU tests, and the build's own tests (collecting only these:
    the rest of the suite imports packages a GPU machine's image may lack)."""
    marked = [p for p in sorted((ROOT / "tests").glob("test_*.py")) if "pytest.mark.gpu" in p.read_text()]
    return ["tests/test_build.py", *(str(p.relative_to(ROOT)) for p in marked)]


STEPS = {
    "build": [PY, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "."],
    "bandwidth": [PY, "benchmarks/kernel_bandwidth.py"],
    "bagua-net": [PY, "tests/bagua_net_nccl_job.py", "--baseline"],
    "kernels": [PY, "benchmarks/kernels.py", "--device", "gpu"],
    "tests": [PY, "-m", "pytest", "-q", *gpu_test_files()],
    "memcheck": sanitized("memcheck"),
    "racecheck": sanitized("racecheck"),
}
# Steps that measure nothing: they may share the machine with each other.
SIDE_BY_SIDE = ("tests", "memcheck", "racecheck")
# Steps that write result files of their own: they get the run's --out.
WRITES_RESULTS = ("bandwidth",)
# JAX would take most of the GPU's memory at start, for each of the processes side by side.
STEP_ENVIRONMENT = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
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
    """The versions :func:`versions` gives, read in a fresh interpreter (the build step may
    have replaced the native module this process would report); ``before``, those read at the
    start, where that interpreter cannot import the package (a failed build)."""
    probe = f"import json; from harness.machine import versions; print(json.dumps(versions({list(PACKAGES)!r})))"
    result = subprocess.run([PY, "-c", probe], check=False, cwd=Path(__file__).parent, capture_output=True, text=True)
    return json.loads(result.stdout.splitlines()[-1]) if result.returncode == 0 else before


def nvcc_version() -> str:
    """nvcc's release line, or "not found"."""
    if shutil.which("nvcc") is None:
        return "not found"
    nvcc = subprocess.run(["nvcc", "--version"], check=False, capture_output=True, text=True)
    return (nvcc.stdout.strip().splitlines() or ["unknown"])[-1]


def gpu_architecture() -> str | None:
    """The GPU's compute capability as CMake spells an architecture ("90"), or None."""
    query = ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]
    result = subprocess.run(query, check=False, capture_output=True, text=True)
    capability = result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else ""
    return capability.replace(".", "") if re.fullmatch(r"\d+\.\d+", capability) else None


def step_environment(name: str) -> dict[str, str]:
    """The environment of one step: the build is for this GPU's architecture, on every core."""
    env = dict(os.environ, **STEP_ENVIRONMENT)
    if name == "build":
        env.update(BAGUA_CUDA="ON", BAGUA_NCCL="ON", CMAKE_BUILD_PARALLEL_LEVEL=str(cores()))
        architecture = gpu_architecture()
        if architecture is not None:
            env["CMAKE_ARGS"] = f"{env.get('CMAKE_ARGS', '')} -DCMAKE_CUDA_ARCHITECTURES={architecture}".strip()
    return env


class Step:
    """One step's process, its output going to a file until it is collected."""

    def __init__(self, name: str, log_dir: Path, out: Path):
        self.name, self.command = name, STEPS[name] + (["--out", str(out)] if name in WRITES_RESULTS else [])
        self.output = tempfile.TemporaryFile("w+", dir=log_dir)
        self.start = time.monotonic()
        try:
            self.process: subprocess.Popen | None = subprocess.Popen(
                self.command,
                cwd=ROOT,
                env=step_environment(name),
                stdout=self.output,
                stderr=subprocess.STDOUT,
                text=True,
            )
        except FileNotFoundError as error:
            self.process, self.failure = None, str(error)

    def collect(self, deadline: float) -> dict:
        """Wait for the step until ``deadline`` (monotonic seconds), then report its outcome."""
        status: int | str = 127
        if self.process is not None:
            try:
                status = self.process.wait(timeout=max(deadline - time.monotonic(), 0))
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                status = "timeout"
        seconds = time.monotonic() - self.start
        self.output.seek(0)
        output = self.output.read() if self.process is not None else self.failure
        if status == "timeout":
            output += f"\n(killed: past its deadline after {seconds:.0f} s)"
        print(f"{self.name}: {'ok' if status == 0 else f'FAILED ({status})'} in {seconds:.0f} s", flush=True)
        return {
            "name": self.name,
            "command": command_line(self.command),
            "status": status,
            "seconds": seconds,
            "tail": "\n".join(output.splitlines()[-TAIL_LINES:]),
            "output": output,
        }


def run_steps(names: list[str], timeout_s: float, log_dir: Path, out: Path) -> list[dict]:
    """Run the steps in order, those of :data:`SIDE_BY_SIDE` together at the end; a failed
    build ends the run, since every later step would test the previous build."""
    alone = [n for n in names if n not in SIDE_BY_SIDE]
    together = [n for n in names if n in SIDE_BY_SIDE]
    outcomes = []
    for name in alone:
        outcomes.append(Step(name, log_dir, out).collect(time.monotonic() + timeout_s))
        if name == "build" and outcomes[-1]["status"] != 0:
            return outcomes
    started = [Step(name, log_dir, out) for name in together]
    deadline = time.monotonic() + timeout_s
    return outcomes + [step.collect(deadline) for step in started]


def report_lines(meta: dict, outcomes: list[dict]) -> list[str]:
    """The Markdown report of the run."""
    lines = [
        "# GPU check",
        "",
        *header_lines(meta),
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
    add_subset_option(parser, "--steps", list(STEPS), "steps to run (default: all, in order)")
    parser.add_argument("--skip-build", action="store_true", help="use the installed build")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per step (side-by-side steps: together)")
    add_out_option(parser)
    args = parser.parse_args(argv)
    device = gpu_description()
    if device is None:
        print("gpu_check: no NVIDIA GPU here (nvidia-smi finds none); nothing was run")
        return 2
    steps = [s for s in args.steps if not (args.skip_build and s == "build")]
    gpus = "; ".join(device.splitlines())
    meta = run_meta(PACKAGES, argv=sys.argv[1:] if argv is None else argv, device=device_info("gpu", gpus))
    log_dir = args.out / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    outcomes = run_steps(steps, args.timeout, log_dir, args.out)
    log = log_dir / "gpu-check.log"
    log.write_text("".join(f"===== {o['name']}: {o['command']}\n{o.pop('output')}\n" for o in outcomes))
    finish_meta(meta)
    meta.update(versions=versions_after_build(meta["versions"]), nvcc=nvcc_version())
    report, _ = write_results(args.out, "gpu-check", report_lines(meta, outcomes), {**meta, "steps": outcomes})
    print(f"wrote {report}")
    return 0 if all(o["status"] == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

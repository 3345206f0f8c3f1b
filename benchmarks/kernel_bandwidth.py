"""The CUDA kernels' bandwidth on this machine's GPU, against a copy, the theoretical peak and the design's prediction.

Builds ``benchmarks/kernel_bandwidth.cu`` with the kernels (one nvcc command, for this GPU's architecture, with
the build's ptxas checks), runs it at 64 MiB and 1 GiB of float32 and bfloat16 input (min-max codecs at k = 8,
64 and 512 chunks), and, where Nsight Compute's ``ncu`` is present, profiles each kernel once at 64 MiB for its
DRAM bytes, DRAM throughput, active warps and instructions. Every kernel is timed alone between CUDA events with
the L2 cache flushed before each repeat; its bandwidth counts the bytes it reads plus those it writes. The
report gives each kernel's bandwidth over ``cudaMemcpy`` device to device, over our 16-byte copy kernel and over
the peak (2 x memory clock x bus width), the fraction of a copy ``cuda_design.py`` predicts from ptxas's
registers, and the targets of issue 43. It writes ``kernel-bandwidth-<device>.md`` and ``.json`` to ``--out``
(default ``benchmarks/results/``). Without a GPU or nvcc it says what is missing and exits 2.

How to run (from the repository root; about 2 minutes)::

    python benchmarks/kernel_bandwidth.py
    python benchmarks/kernel_bandwidth.py --sizes 64 --no-ncu
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import cuda_design
import cuda_resources
from harness.machine import device_info
from harness.options import add_out_option
from harness.results import finish_meta, header_lines, run_meta, write_results

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = ROOT / "benchmarks" / "kernel_bandwidth.cu"
NCU_METRICS = (
    "dram__bytes_read.sum",
    "dram__bytes_write.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "smsp__inst_executed.sum",
)
NCU_MIB = 64
# Issue 43's bars, as fractions of the device-to-device copy at 1 GiB (min-max compress: at the default chunking).
TARGETS = {
    "minmax_uint8_decompress": 0.85,
    "minmax_uint4_decompress": 0.85,
    "sign_compress": 0.85,
    "sign_decompress": 0.85,
    "axpy": 0.85,
    "async_average": 0.85,
    "minmax_uint8_decompress_reduce": 0.75,
    "minmax_uint4_decompress_reduce": 0.75,
    "minmax_uint8_compress": 0.8,
    "minmax_uint4_compress": 0.8,
}
DTYPE_NAMES = {"float32": "float", "bfloat16": "bagua::BFloat16"}
# The kernel instantiations each case runs (vector slots: the inputs are aligned), and what they read per pass.
FORMAT_KERNELS = {
    "minmax_uint8": ("MinMaxCodec<8>", 8),
    "minmax_uint4": ("MinMaxCodec<4>", 4),
    "sign": ("SignCodec", 1),
}


def gpu_architecture() -> str | None:
    """The GPU's compute capability as nvcc spells an architecture ("90"), or None without a GPU."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]
    result = subprocess.run(query, check=False, capture_output=True, text=True)
    capability = result.stdout.strip().splitlines()[0] if result.returncode == 0 and result.stdout.strip() else ""
    return capability.replace(".", "") if re.fullmatch(r"\d+\.\d+", capability) else None


def build(arch: str, out_dir: Path) -> tuple[Path, str]:
    """The benchmark program for ``arch``, and ptxas's resource report of its kernels."""
    exe = out_dir / "kernel_bandwidth"
    command = [
        "nvcc", "-O3", "-std=c++17", f"-arch=sm_{arch}", f"-I{ROOT / 'xla_ffi'}", str(PROGRAM),
        str(ROOT / "xla_ffi" / "kernels_cuda.cu"), "-o", str(exe), "--resource-usage",
        "--ptxas-options=-warn-spills,-warn-lmem-usage,--warning-as-error",
    ]  # fmt: skip
    result = subprocess.run(command, check=False, capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed:\n{result.stdout[-4000:]}{result.stderr[-4000:]}")
    return exe, result.stdout + result.stderr


def run_program(exe: Path, sizes: list[int]) -> tuple[dict, list[dict]]:
    """(the device line, one row per case) of a timed run."""
    result = subprocess.run([str(exe), *map(str, sizes)], check=True, capture_output=True, text=True)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return lines[0], lines[1:]


def profile(exe: Path) -> dict[str, dict[str, float]]:
    """Nsight Compute's metrics of each kernel launched by a ``--once`` run at NCU_MIB: demangled kernel name ->
    metric -> value (summed over launches of the same kernel)."""
    command = [
        "ncu", "--clock-control", "none", "--csv", "--metrics", ",".join(NCU_METRICS),
        "-k", "regex:compress|decompress|elementwise|sign_|copy16", str(exe), "--once", str(NCU_MIB),
    ]  # fmt: skip
    result = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
    text = result.stdout[result.stdout.find('"ID"') :]
    metrics: dict[str, dict[str, float]] = {}
    for row in csv.DictReader(io.StringIO(text)):
        name = re.sub(r"bagua::kernels::\(anonymous namespace\)::", "", row["Kernel Name"])
        value = float(row["Metric Value"].replace(",", "")) if row["Metric Value"] else 0.0
        kernel = metrics.setdefault(f"{row['ID']} {name}", {})
        kernel[row["Metric Name"]] = value
    return metrics


def instantiations(case: dict) -> list[str]:
    """The kernels a case runs (their names as ptxas gives them, up to the parameter list); the inputs are
    aligned, so every kernel has vector slots (U = 16 / element bytes)."""
    t, kernel = DTYPE_NAMES[case["dtype"]], case["kernel"]
    u = 16 // (4 if t == "float" else 2)
    if kernel in ("memcpy", "copy16"):
        return []
    if kernel in ("axpy", "async_average"):
        functor, inputs = ("Axpy", 2) if kernel == "axpy" else ("AsyncAverage", 3)
        return [f"void elementwise_kernel<{t}, {u}, {inputs}, {functor}>"]
    codec, operation = re.fullmatch(r"(minmax_uint8|minmax_uint4|sign)_(.*)", kernel).groups()
    template, bits = FORMAT_KERNELS[codec]
    if operation in ("decompress", "decompress_reduce"):
        return [f"void {operation}_kernel<{template}, {u}, {t}>"]
    feedback = operation == "compress_feedback"
    if codec != "sign":
        return [f"void minmax_compress_kernel<{bits}, {u}, {t}, {str(feedback).lower()}>"]
    stats = f"void sign_stats_kernel<{u}, {t}, {str(feedback).lower()}>"
    return [stats, f"void sign_feedback_kernel<{u}, {t}>"] if feedback else [stats]


def predicted(case: dict, resources: dict[str, dict]) -> float | None:
    """cuda_design's predicted fraction of a copy for the case: for kernels run one after the other, the
    case's bytes over the sum of each kernel's bytes at its own predicted bandwidth."""
    k = case["k"] or 8
    parts = []
    for prefix in instantiations(case):
        row = next((r for name, r in resources.items() if name.startswith(prefix + "(")), None)
        kernel = cuda_design.parse_kernel(row["kernel"]) if row else None
        if kernel is None:
            return None
        read, written = cuda_design.traffic(kernel, k=k)
        parts.append((read + written, cuda_design.predicted_fraction(kernel, row["registers"], row["smem"], k=k)))
    if not parts:
        return None
    return sum(b for b, _ in parts) / sum(b / f for b, f in parts)


def report(meta: dict, device: dict, rows: list[dict], ncu: dict | None) -> list[str]:
    """The Markdown report: per size, every case against the references and the prediction."""
    lines = [
        f"# Kernel bandwidth: {device['device']}",
        "",
        *header_lines(meta),
        f"- GPU: {device['device']}, {device['sms']} SMs, L2 {device['l2_bytes'] >> 20} MiB, theoretical peak "
        f"{device['peak_gbps']:.0f} GB/s (2 x {device['memory_clock_khz'] / 1e6:.3f} GHz x {device['bus_bits']} bits)",
        "",
        "Each kernel alone between CUDA events, L2 flushed before each of 15 repeats (median); GB/s counts bytes "
        "read plus written. `/memcpy`, `/copy16`, `/peak`: over cudaMemcpy device to device, our 16-byte copy "
        "kernel and the theoretical peak on the same input size; `predicted`: cuda_design.py's fraction of a copy "
        "from ptxas's registers; `target`: issue 43's bar at 1 GiB.",
        "",
    ]
    for size in sorted({r["input_bytes"] for r in rows}):
        at = [r for r in rows if r["input_bytes"] == size]
        refs = {(r["kernel"], r["dtype"]): r["gbps"] for r in at if r["kernel"] in ("memcpy", "copy16")}
        lines += [
            f"## {size >> 20} MiB of input",
            "",
            "| kernel | dtype | k | GB/s | /memcpy | /copy16 | /peak | predicted | target |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in at:
            memcpy = refs.get(("memcpy", r["dtype"]), 0)
            target = TARGETS.get(r["kernel"]) if size >= 1 << 30 else None
            prediction = "" if r.get("predicted") is None else f"{r['predicted']:.2f}"
            verdict = "" if target is None else ("met" if r["gbps"] / memcpy >= target else "NOT met") + f" ({target})"
            lines.append(
                f"| {r['kernel']} | {r['dtype']} | {r['k'] or ''} | {r['gbps']:.0f} | "
                f"{r['gbps'] / memcpy:.2f} | {r['gbps'] / refs.get(('copy16', r['dtype']), 1):.2f} | "
                f"{r['gbps'] / device['peak_gbps']:.2f} | {prediction} | {verdict} |"
            )
        lines.append("")
    if ncu:
        lines += [
            f"## Nsight Compute at {NCU_MIB} MiB (`--clock-control none`)",
            "",
            "| launch | DRAM read MB | DRAM write MB | DRAM % of peak | warps active % | instructions (M) |",
            "|---|---|---|---|---|---|",
        ]
        for name, m in ncu.items():
            read, written, dram, warps, instructions = (m.get(metric, 0) for metric in NCU_METRICS)
            megabytes = f"{read / 1e6:.1f} | {written / 1e6:.1f}"
            lines.append(f"| `{name}` | {megabytes} | {dram:.1f} | {warps:.1f} | {instructions / 1e6:.1f} |")
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 1024], help="input MiB (default 64 1024)")
    parser.add_argument("--no-ncu", action="store_true", help="skip Nsight Compute even where it is present")
    add_out_option(parser)
    args = parser.parse_args(argv)
    arch = gpu_architecture()
    missing = [what for what, ok in (("an NVIDIA GPU (nvidia-smi)", arch), ("nvcc", shutil.which("nvcc"))) if not ok]
    if missing:
        print(f"kernel_bandwidth: needs {' and '.join(missing)}; nothing was run")
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        exe, usage = build(arch, Path(tmp))
        resources = {r["kernel"]: r for r in cuda_resources.parse(usage) if r["arch"] == f"sm_{arch}"}
        meta = run_meta([], argv=sys.argv[1:] if argv is None else argv, device=device_info("gpu"), arch=arch)
        device, rows = run_program(exe, args.sizes)
        meta["device"] = device_info("gpu", gpu=device["device"])
        ncu = profile(exe) if shutil.which("ncu") and not args.no_ncu else None
    finish_meta(meta)
    for r in rows:
        r["predicted"] = predicted(r, resources)
    stem = "kernel-bandwidth-" + re.sub(r"[^a-z0-9]+", "-", device["device"].lower()).strip("-")
    lines = report(meta, device, rows, ncu)
    md, _ = write_results(
        args.out, stem, [*lines, ""], {**meta, "device_line": device, "cases": rows, "ncu": ncu, "resources": resources}
    )
    print("\n".join(lines))
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

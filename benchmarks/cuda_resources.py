"""Per-kernel registers, shared memory, spills and occupancy of xla_ffi/kernels_cuda.cu, against each kernel's design.

Compiles the kernels with nvcc (no GPU needed) for each architecture asked, with ``--resource-usage`` and
ptxas's spill and local-memory warnings, and writes the table to ``cuda-resources.md`` and
``cuda-resources.json`` in ``--out`` (default ``benchmarks/results/``), with the machine, versions and nvcc
that made it. For sm_90 each row also gives the warps an H200 multiprocessor holds of the kernel, the warps
its design needs for its loads in flight, and the fraction of a copy that predicts (``cuda_design.py``).
Exits 1 if any kernel spills registers, uses local memory (a stack frame), or holds fewer warps than it needs.

How to run::

    python benchmarks/cuda_resources.py               # sm_80 and sm_90, as CMakeLists.txt
    python benchmarks/cuda_resources.py --archs 90
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import cuda_design
from harness.options import add_out_option
from harness.results import finish_meta, header_lines, run_meta, write_results

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "xla_ffi" / "kernels_cuda.cu"

_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def compile_usage(arch: str, out: Path | None = None) -> str:
    """nvcc's resource report of every kernel for one architecture, with the flags of the build
    (CMakeLists.txt); the object goes to ``out`` if given."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            "nvcc", "-std=c++17", f"-arch=sm_{arch}", f"-I{ROOT / 'xla_ffi'}", "-c", str(SOURCE),
            "-o", str(out or Path(tmp) / "kernels.o"), "--resource-usage",
            "-Xptxas=-warn-spills,-warn-lmem-usage",
        ]  # fmt: skip
        result = subprocess.run(command, check=True, capture_output=True, text=True)
    return result.stdout + result.stderr


def parse(report: str) -> list[dict]:
    """One row per kernel: name, arch, registers, smem, stack and spill bytes."""
    rows: list[dict] = []
    for line in report.splitlines():
        if m := _ENTRY.search(line):
            rows.append({"kernel": m.group(1), "arch": m.group(2)})
        elif rows and (m := _FRAME.search(line)):
            rows[-1].update(
                stack=int(m.group(1)),
                spill_st=int(m.group(2)),
                spill_ld=int(m.group(3)),
            )
        elif rows and (m := _USED.search(line)):
            smem = _SMEM.search(line)
            rows[-1].update(registers=int(m.group(1)), smem=int(smem.group(1)) if smem else 0)
    names = subprocess.run(
        ["c++filt"], input="\n".join(r["kernel"] for r in rows), check=True,
        capture_output=True, text=True,
    ).stdout.splitlines()  # fmt: skip
    for row, name in zip(rows, names):
        row["kernel"] = re.sub(r"bagua::kernels::\(anonymous namespace\)::", "", name)
    return rows


def with_occupancy(rows: list[dict]) -> list[dict]:
    """``rows`` with, for sm_90 kernels that move bulk data, the resident and needed warps and the predicted
    fraction of a copy (cuda_design.py)."""
    for row in rows:
        kernel = cuda_design.parse_kernel(row["kernel"])
        if row["arch"] != "sm_90" or kernel is None:
            continue
        row.update(
            resident_warps=cuda_design.resident_warps(row.get("registers", 0), row.get("smem", 0)),
            needed_warps=cuda_design.needed_warps(kernel),
            loads_per_warp=cuda_design.loads_per_warp(kernel),
            predicted=round(cuda_design.predicted_fraction(kernel, row.get("registers", 0), row.get("smem", 0)), 2),
        )
    return rows


def problems(rows: list[dict]) -> list[str]:
    """What fails the check: spills, a stack frame, too few resident warps."""
    out = []
    for r in rows:
        if r.get("stack") or r.get("spill_st") or r.get("spill_ld"):
            out.append(f"{r['arch']} {r['kernel']}: spills or uses local memory")
        if r.get("resident_warps", 1) < r.get("needed_warps", 0):
            out.append(
                f"{r['arch']} {r['kernel']}: {r['resident_warps']} resident warps (at {r['registers']} registers) "
                f"keep {r['resident_warps'] * r['loads_per_warp'] // 1024} KiB of loads in flight; "
                f"its traffic needs {r['needed_warps']} warps"
            )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", nargs="+", default=["80", "90"])
    add_out_option(parser)
    args = parser.parse_args(argv)
    if shutil.which("nvcc") is None:
        print("cuda_resources: nvcc not found")
        return 2
    version = subprocess.run(["nvcc", "--version"], check=True, capture_output=True, text=True)
    nvcc_version = version.stdout.strip().splitlines()[-1]
    meta = run_meta([], argv=sys.argv[1:] if argv is None else argv, nvcc=nvcc_version)
    rows = with_occupancy([row for arch in args.archs for row in parse(compile_usage(arch))])
    finish_meta(meta)
    bad = problems(rows)
    lines = [
        "# CUDA kernel resources",
        "",
        *header_lines(meta),
        f"- nvcc: {nvcc_version}",
        "",
        f"{len(rows)} kernels; {len(bad)} problems.",
        *(f"- {p}" for p in bad),
        "",
        "For sm_90: the warps an H200 multiprocessor holds at these registers, the warps the kernel's loads in",
        "flight need (`cuda_design.py`), and the fraction of a device-to-device copy that predicts.",
        "",
        "| arch | kernel | registers | smem bytes | stack bytes | spill stores / loads | resident warps | "
        "needed warps | predicted / copy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['arch']} | `{r['kernel']}` | {r.get('registers', '?')} | {r.get('smem', 0)} | "
        f"{r.get('stack', 0)} | {r.get('spill_st', 0)} / {r.get('spill_ld', 0)} | {r.get('resident_warps', '')} | "
        f"{r.get('needed_warps', '')} | {r.get('predicted', '')} |"
        for r in rows
    ]
    md_path, _ = write_results(args.out, "cuda-resources", [*lines, ""], {**meta, "kernels": rows})
    print(f"wrote {md_path}: {len(rows)} kernels, {len(bad)} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

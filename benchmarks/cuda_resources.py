"""Per-kernel register, shared-memory, stack and spill use of xla_ffi/kernels_cuda.cu.

Compiles the kernels with nvcc (no GPU needed) for each architecture the build targets,
with ``--resource-usage`` and ptxas's spill and local-memory warnings, and writes the table
to ``cuda-resources.md`` and ``cuda-resources.json`` in ``--out`` (default ``benchmarks/results/``),
with the machine, versions and nvcc that made it. Exits 1 if any kernel spills
registers or uses local memory (a stack frame), which on these bandwidth-bound kernels means a
register array was not unrolled or the register budget is too tight.

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

from harness.options import add_out_option
from harness.results import finish_meta, header_lines, run_meta, write_results

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "xla_ffi" / "kernels_cuda.cu"

_ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")


def compile_usage(arch: str) -> str:
    """nvcc's resource report of every kernel for one architecture."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            "nvcc", "-std=c++17", f"-arch=sm_{arch}", f"-I{ROOT / 'xla_ffi'}", "-c", str(SOURCE),
            "-o", str(Path(tmp) / "kernels.o"), "--resource-usage",
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
    rows = [row for arch in args.archs for row in parse(compile_usage(arch))]
    finish_meta(meta)
    bad = [r for r in rows if r.get("stack") or r.get("spill_st") or r.get("spill_ld")]
    lines = [
        "# CUDA kernel resources",
        "",
        *header_lines(meta),
        f"- nvcc: {nvcc_version}",
        "",
        f"{len(rows)} kernels; {len(bad)} spill registers or use local memory.",
        "",
        "| arch | kernel | registers | smem bytes | stack bytes | spill stores / loads |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['arch']} | `{r['kernel']}` | {r.get('registers', '?')} | {r.get('smem', 0)} | "
        f"{r.get('stack', 0)} | {r.get('spill_st', 0)} / {r.get('spill_ld', 0)} |"
        for r in rows
    ]
    md_path, _ = write_results(args.out, "cuda-resources", [*lines, ""], {**meta, "kernels": rows})
    print(f"wrote {md_path}: {len(rows)} kernels, {len(bad)} with spills or local memory")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

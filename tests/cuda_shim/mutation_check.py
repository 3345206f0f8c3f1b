"""Proof that the shim suite can fail: applies each known bug to a copy of kernels_cuda.cu,
builds the kernel suite against it and runs the quick subset. Prints a Markdown table; exits
non-zero if a mutation goes unnoticed or no longer applies.

Usage: python tests/cuda_shim/mutation_check.py [--sanitize]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cuda_shim_build import KERNELS, build_kernel_suite

# (what the bug is, text in kernels_cuda.cu, what replaces it)
MUTATIONS = [
    (
        "wrong shuffle offset in block_reduce (starts at 8, not 16)",
        "for (int offset = 16; offset > 0; offset /= 2)",
        "for (int offset = 8; offset > 0; offset /= 2)",
    ),
    (
        "first __syncthreads of block_reduce removed",
        "partial[threadIdx.x / 32] = v;\n  __syncthreads();",
        "partial[threadIdx.x / 32] = v;\n",
    ),
    (
        "SignEncoder shuffle reached only by lanes with elements",
        "byte |= __shfl_xor_sync(kFullMask, byte, offset);",
        "if (count > 0) byte |= __shfl_xor_sync(kFullMask, byte, offset);",
    ),
    (
        "SignEncoder ballot (one element per lane) reached only by lanes with elements",
        "byte = __ballot_sync(kFullMask, byte != 0) >> (lane_id() & ~7);",
        "if (count > 0) byte = __ballot_sync(kFullMask, byte != 0) >> (lane_id() & ~7);",
    ),
    (
        "overlapping tiles (a tile ends one step late)",
        "tile.s_end = min(tile.s_begin + tiles.tile_steps,",
        "tile.s_end = min(tile.s_begin + tiles.tile_steps + 1,",
    ),
    (
        "off-by-one at a chunk end (Step::count one past the end)",
        "min(int64_t{V}, length - at(j))",
        "min(int64_t{V}, length + 1 - at(j))",
    ),
]


def run_mutation(work: Path, index: int, original: str, old: str, new: str, sanitize: bool):
    """Return (caught, how) for one mutation."""
    if original.count(old) != 1:
        return False, "mutation no longer applies (source changed)"
    source = work / f"mutant{index}" / "kernels_cuda.cu"
    source.parent.mkdir(parents=True)
    source.write_text(original.replace(old, new))
    exe = build_kernel_suite(source.parent / "build", sanitize=sanitize, kernels_cuda=source)
    result = subprocess.run([str(exe), "--quick"], check=False, capture_output=True, text=True, timeout=1800)
    if result.returncode == 0:
        return False, "suite passed"
    lines = result.stdout.strip().splitlines() + result.stderr.strip().splitlines()
    shim = [line for line in lines if line.startswith("cuda_shim:")]
    summary = [line for line in lines if line.endswith(" failed")]
    return True, (shim or summary or lines[-1:] or [f"exit {result.returncode}"])[0]


def main() -> int:
    sanitize = "--sanitize" in sys.argv[1:]
    original = (KERNELS / "kernels_cuda.cu").read_text()
    print("| mutation | caught | how |\n|---|---|---|")
    missed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, (what, old, new) in enumerate(MUTATIONS):
            caught, how = run_mutation(Path(tmp), i, original, old, new, sanitize)
            missed += not caught
            print(f"| {what} | {'yes' if caught else 'NO'} | {how} |", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Proof that the shim suite can fail: applies each known bug to a copy of the CUDA sources
(kernels_cuda.cu and the cuda_*.h it includes), builds the kernel suite against it and runs the
quick subset. Prints a Markdown table; exits
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

# The CUDA sources a mutation may change: kernels_cuda.cu includes the headers by quoted names,
# so copies beside a mutated copy of it take precedence over xla_ffi/.
SOURCES = ("kernels_cuda.cu", "cuda_launch.h", "cuda_lanes.h", "cuda_codecs.h")

# (what the bug is, text in one of SOURCES, what replaces it)
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
    (
        "4-bit codes: odd elements read from the low nibble",
        "return count > 0 ? uint32_t{codes[at / 2]} >> (4 * (at % 2)) : 0u;",
        "return count > 0 ? uint32_t{codes[at / 2]} : 0u;",
    ),
    (
        "4-bit code pairs (one element per lane): shuffle reached only by lanes with elements",
        "const uint32_t pair = word | __shfl_xor_sync(kFullMask, word, 1) << 4;",
        "const uint32_t pair = count > 0 ? word | __shfl_xor_sync(kFullMask, word, 1) << 4 : 0;",
    ),
    (
        "4-bit codes past a chunk's end not masked (they share its last byte)",
        "if (kBits == 8 || u < count) word |= uint32_t{code} << (kBits * u);",
        "word |= uint32_t{code} << (kBits * u);",
    ),
]


def run_mutation(work: Path, index: int, originals: dict[str, str], old: str, new: str, sanitize: bool):
    """Return (caught, how) for one mutation."""
    hits = [name for name, text in originals.items() if text.count(old) == 1]
    if len(hits) != 1 or sum(text.count(old) for text in originals.values()) != 1:
        return False, "mutation no longer applies (source changed)"
    folder = work / f"mutant{index}"
    folder.mkdir(parents=True)
    for name, text in originals.items():
        (folder / name).write_text(text.replace(old, new) if name == hits[0] else text)
    exe = build_kernel_suite(folder / "build", sanitize=sanitize, kernels_cuda=folder / "kernels_cuda.cu")
    result = subprocess.run([str(exe), "--quick"], check=False, capture_output=True, text=True, timeout=1800)
    if result.returncode == 0:
        return False, "suite passed"
    lines = result.stdout.strip().splitlines() + result.stderr.strip().splitlines()
    shim = [line for line in lines if line.startswith("cuda_shim:")]
    summary = [line for line in lines if line.endswith(" failed")]
    return True, (shim or summary or lines[-1:] or [f"exit {result.returncode}"])[0]


def main() -> int:
    sanitize = "--sanitize" in sys.argv[1:]
    originals = {name: (KERNELS / name).read_text() for name in SOURCES}
    print("| mutation | caught | how |\n|---|---|---|")
    missed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i, (what, old, new) in enumerate(MUTATIONS):
            caught, how = run_mutation(Path(tmp), i, originals, old, new, sanitize)
            missed += not caught
            print(f"| {what} | {'yes' if caught else 'NO'} | {how} |", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())

"""Proof that the shim's checks can fail: applies each known bug to a copy of the CUDA sources
(kernels_cuda.cu and the cuda_*.h it includes), builds the kernel suite and the access audit
against it, runs the suite's quick subset and, where that passes, the audit against the kernels'
design (benchmarks/cuda_design.py). Prints a Markdown table; exits non-zero if a mutation goes
unnoticed or no longer applies.

Usage: python tests/cuda_shim/mutation_check.py [--sanitize]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import cuda_design
from cuda_shim_build import KERNELS, build_kernel_suite

# The CUDA sources a mutation may change: kernels_cuda.cu includes the headers by quoted names,
# so copies beside a mutated copy of it take precedence over xla_ffi/.
SOURCES = ("kernels_cuda.cu", "cuda_launch.h", "cuda_lanes.h", "cuda_codecs.h")

# (what the bug is, text in one of SOURCES, what replaces it)
MUTATIONS = [
    (
        "wrong shuffle offset in block_reduce (starts at 8, not 16)",
        "for (int offset = 16; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(kFullMask, v, offset));",
        "for (int offset = 8; offset > 0; offset /= 2) v = op(v, __shfl_xor_sync(kFullMask, v, offset));",
    ),
    (
        "first __syncthreads of block_min_max removed (a group's bounds race)",
        "    partial[1][warp_id()] = hi;\n  }\n  __syncthreads();",
        "    partial[1][warp_id()] = hi;\n  }\n",
    ),
    (
        "sign bits gathered by a shuffle reached only by lanes with set bits",
        "        word |= __shfl_xor_sync(kFullMask, word, offset);",
        "        if (bits[j]) word |= __shfl_xor_sync(kFullMask, word, offset);",
    ),
    (
        "sign bits of one element a lane: ballot reached only by lanes with set bits",
        "      word = __ballot_sync(kFullMask, bits[j] != 0);",
        "      word = bits[j] ? __ballot_sync(kFullMask, bits[j] != 0) : 0;",
    ),
    (
        "warp steps of a tile overlap (each starts one element early)",
        "  return {int64_t{warp_id()} * kStep, length};",
        "  return {int64_t{warp_id()} * (kStep - 1), length};",
    ),
    (
        "off-by-one at a chunk end (Step::count one past the end)",
        "min(int64_t{U}, length - at(j))",
        "min(int64_t{U}, length + 1 - at(j))",
    ),
    (
        "4-bit codes: odd elements read from the low nibble",
        "    return load_global(codes + at / 2) >> (4 * (at % 2)) & 0xfu;",
        "    return load_global(codes + at / 2) & 0xfu;",
    ),
    (
        "4-bit code pairs (one element per lane): shuffle reached only by lanes with elements",
        "    const uint32_t pair = word | __shfl_xor_sync(kFullMask, word, 1) << 4;",
        "    const uint32_t pair = count > 0 ? word | __shfl_xor_sync(kFullMask, word, 1) << 4 : 0;",
    ),
    (
        "4-bit codes past a group's end not masked (they share its last byte)",
        "    if (u < count) word |= CodeWord<kBits, U>{code} << (kBits * u);",
        "    word |= CodeWord<kBits, U>{code} << (kBits * u);",
    ),
    (
        "the loads issued ahead never used: every item repeats the first",
        "    if (more) current = next;",
        "",
    ),
    (
        "min-max compress reads its input twice (the audit's catch: the bytes are right)",
        "        compress_group<kBits, U, T, kFeedback>(item.group, item.values, out, residual_out);",
        "        compress_group<kBits, U, T, kFeedback>(\n"
        "            item.group, src.template load<U>(item.group.first, tile_step<U>(item.group.length)), out,\n"
        "            residual_out);",
    ),
    (
        "one element a slot everywhere, never 16-byte vectors (the audit's catch)",
        "  return vector ? 16 / static_cast<int>(sizeof(T)) : 1;",
        "  return vector ? 1 : 1;",
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
    programs = build_kernel_suite(folder / "build", sanitize=sanitize, kernels_cuda=folder / "kernels_cuda.cu")
    result = subprocess.run([str(programs.suite), "--quick"], check=False, capture_output=True, text=True, timeout=1800)
    if result.returncode == 0 and programs.audit is not None:
        audit = subprocess.run([str(programs.audit)], check=False, capture_output=True, text=True, timeout=1800)
        mismatches = cuda_design.audit_mismatches(audit.stdout) if audit.returncode == 0 else [audit.stderr]
        return bool(mismatches), f"suite passed; access audit: {mismatches[0]}" if mismatches else "suite passed"
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

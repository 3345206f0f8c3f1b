"""The CUDA launch arithmetic (xla_ffi/cuda_geometry.h) and the compressed layout (xla_ffi/layout.h: chunks,
groups, tiles) for n >= 2^31, without a GPU or memory."""

import re
import subprocess

from cuda_shim_build import build_geometry_test


def test_launch_arithmetic_holds_for_sizes_beyond_32_bits(tmp_path):
    exe = build_geometry_test(tmp_path)
    result = subprocess.run([str(exe)], check=False, capture_output=True, text=True, timeout=300)
    summary = re.search(r"(\d+) passed, (\d+) failed", result.stdout)
    assert result.returncode == 0 and summary, result.stdout[-4000:] + result.stderr[-4000:]
    assert int(summary.group(2)) == 0 and int(summary.group(1)) >= 540

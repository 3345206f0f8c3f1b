"""The CUDA kernels executed on the CPU under tests/cuda_shim, against the CPU kernels."""

import os
import re
import subprocess

from cuda_shim_build import build_kernel_suite

# Generous: the suite takes about a minute on an idle 2-core machine.
TIMEOUT_S = 900


def _run(exe, *args, env=None):
    result = subprocess.run(
        [str(exe), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )
    summary = re.search(r"(\d+) passed, (\d+) failed", result.stdout)
    assert result.returncode == 0 and summary, (
        result.stdout[-4000:] + result.stderr[-4000:]
    )
    passed, failed = map(int, summary.groups())
    return passed, failed


def test_cuda_kernels_under_the_shim_match_the_cpu_kernels(tmp_path):
    exe = build_kernel_suite(tmp_path / "plain")
    passed, failed = _run(exe)
    # 3 dtypes x 9 sizes: compress + decompress, elementwise and decompress_reduce cases.
    assert failed == 0 and passed >= 2000


def test_cuda_kernels_under_the_shim_with_address_and_ub_sanitizers(tmp_path):
    exe = build_kernel_suite(tmp_path / "asan", sanitize=True)
    # Fibers switch stacks with swapcontext, which ASan follows but cannot check returns across.
    env = dict(
        os.environ, ASAN_OPTIONS="detect_stack_use_after_return=0:detect_leaks=1"
    )
    passed, failed = _run(exe, "--quick", env=env)
    assert failed == 0 and passed >= 900

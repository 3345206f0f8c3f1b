"""The NCCL engine's host logic (watchdog, timeouts, aborts, async errors, split, id hand-over)
against a fake NCCL, under ThreadSanitizer; no GPU or NCCL needed."""

import re
import subprocess

from cuda_shim_build import build_nccl_engine_test


def test_nccl_engine_host_logic_under_thread_sanitizer(tmp_path):
    exe = build_nccl_engine_test(tmp_path)
    result = subprocess.run(
        [str(exe)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env={"TSAN_OPTIONS": "halt_on_error=1"},
    )
    summary = re.search(r"(\d+) passed, (\d+) failed", result.stdout)
    assert result.returncode == 0 and summary, result.stdout[-4000:] + result.stderr[-4000:]
    assert "ThreadSanitizer" not in result.stderr, result.stderr[-4000:]
    assert int(summary.group(2)) == 0 and int(summary.group(1)) >= 30

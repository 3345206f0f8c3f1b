"""Long self-contained jobs that start as soon as the session's tests are collected and run at the lowest CPU
priority while the rest of the suite runs, in the core time its single-process tests and waits leave idle.

A test that reads one is marked ``@pytest.mark.background_job("name")`` with a name of :data:`JOBS` and takes the
``background_job`` fixture; conftest.py starts each marked job once, at collection, and moves the marked tests to
the end of the run, so that by then the job has had the whole suite to finish. A job is one subprocess, with no
peer and no timeout of its own to miss when the foreground starves it; the test waits for it with a timeout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent

JOBS: dict[str, list[str]] = {
    # cuda_shim_build.py's sanitized kernel suite: the ASan/UBSan build (4 translation units) and its quick run.
    "sanitized_kernel_suite": [sys.executable, str(TESTS / "cuda_shim_build.py"), "sanitized-suite"],
}
"""Name -> the command that runs the job (its working folder is appended)."""


@dataclass
class BackgroundJob:
    """A started job: its process and the file its output goes to."""

    name: str
    process: subprocess.Popen
    output_path: Path

    @classmethod
    def start(cls, name: str) -> BackgroundJob:
        folder = Path(tempfile.mkdtemp(prefix=f"bagua-{name}-"))
        output_path = folder / "output.txt"
        with open(output_path, "w") as output:
            process = subprocess.Popen(
                ["nice", "-n", "19", *JOBS[name], str(folder)],
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return cls(name, process, output_path)

    def result(self, timeout: float) -> tuple[int, str]:
        """Wait for the job (at most ``timeout`` seconds more; then it is killed and a TimeoutExpired raised) and
        return its exit status and output."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        return self.process.returncode, self.output_path.read_text()

    def stop(self) -> None:
        """End the job if it still runs (a session that ended before its test did)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)  # its compilers and the suite too
            self.process.wait()

"""bagua_torch's ordered worker thread runs each job with the intra-op thread count of the thread that submitted it.

OpenMP keeps that count per thread, and torch applies its own to a new thread only when one of its parallel loops
first runs there, not before an MKL matmul: a fresh thread ran its matmuls on every core although the process chose
fewer with ``torch.set_num_threads`` (each rank of a multi-process job on a few cores). PowerSGD's job in the GPT
convergence gate spent 5x the CPU time so.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

from bagua_torch.ordered_worker import OrderedWorker


def openmp() -> ctypes.CDLL:
    """The OpenMP runtime torch loaded (its own libgomp, or Intel's), to read a thread's count without torch,
    whose every query first applies torch's count to the calling thread. Other packages load runtimes of their
    own (scikit-learn vendors a libgomp), whose counts torch does not set: torch's is the one in its directory."""
    torch_dir = Path(torch.__file__).parent
    loaded = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if ".so" in line}
    runtimes = [
        path
        for path in loaded
        if Path(path).name.startswith(("libgomp", "libiomp", "libomp")) and Path(path).is_relative_to(torch_dir)
    ]
    if not runtimes:
        pytest.skip("torch runs without an OpenMP runtime here")
    return ctypes.CDLL(runtimes[0])


def test_a_job_runs_with_the_submitters_thread_count():
    runtime, before = openmp(), torch.get_num_threads()
    worker = OrderedWorker("threads", torch.device("cpu"))
    try:
        # 1, then more than a fresh thread's default (the cores): neither is what the worker's thread starts with.
        for threads in (1, (os.cpu_count() or 1) + 1):
            torch.set_num_threads(threads)
            assert worker.submit(lambda stream: runtime.omp_get_max_threads()).wait() == threads
    finally:
        torch.set_num_threads(before)
        worker.close()

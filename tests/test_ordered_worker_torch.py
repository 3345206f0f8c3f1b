"""bagua_torch's ordered worker thread runs each job with the intra-op thread count of the thread that submitted it.

OpenMP keeps that count per thread, and torch applies its own to a new thread only when one of its parallel loops
first runs there, not before an MKL matmul: a fresh thread ran its matmuls on every core although the process chose
fewer with ``torch.set_num_threads`` (each rank of a multi-process job on a few cores). PowerSGD's job in the GPT
convergence gate spent 5x the CPU time so.
"""

from __future__ import annotations

import ctypes
import os

import pytest
import torch

from bagua_torch.ordered_worker import OrderedWorker


def openmp() -> ctypes.CDLL:
    """The OpenMP runtime torch uses, to read a thread's count without torch, whose every query first applies
    torch's count to the calling thread. torch links it by its soname, so that name finds the copy it uses (its
    own, or a system copy of the same name loaded first); scikit-learn vendors a libgomp under a name of its own."""
    for soname in ("libgomp.so.1", "libiomp5.so", "libomp.so"):
        try:
            return ctypes.CDLL(soname, mode=os.RTLD_NOLOAD)
        except OSError:
            continue
    pytest.skip("torch runs without an OpenMP runtime here")


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

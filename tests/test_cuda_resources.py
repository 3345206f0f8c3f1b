"""The CUDA kernels compiled for sm_90 by nvcc (ptxas; no GPU): no kernel spills registers or uses local memory,
and each one's registers leave an H200 multiprocessor enough resident warps for the loads in flight its traffic
needs (``benchmarks/cuda_design.py``: 48 KiB of loads for a copy's traffic, scaled by the kernel's read share)."""

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import cuda_design  # noqa: E402
import cuda_resources  # noqa: E402

pytestmark = [
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc, which compiles without a GPU"),
    # The fixture compiles every kernel: 130 s on 2 quiet cores, and CI machines may take twice that.
    pytest.mark.timeout(1200),
]

# Every kernel template that moves bulk data, by the name cuda_design gives it.
TEMPLATES = {"minmax_compress", "decompress", "decompress_reduce", "sign_stats", "sign_feedback", "elementwise"}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    return cuda_resources.with_occupancy(cuda_resources.parse(cuda_resources.compile_usage("90")))


def test_every_data_moving_kernel_has_a_design(rows):
    kernels = [cuda_design.parse_kernel(r["kernel"]) for r in rows]
    assert {k.template for k in kernels if k} == TEMPLATES
    # Each template in float32 and in the 16-bit types, with and without 16-byte slots.
    assert len([k for k in kernels if k]) >= 2 * 3 * len(TEMPLATES)


def test_no_kernel_spills_or_holds_too_few_warps_for_its_loads_in_flight(rows):
    assert not cuda_resources.problems(rows), "\n".join(cuda_resources.problems(rows))

"""The CUDA kernels executed on the CPU under tests/cuda_shim: against the CPU kernels built from the same tree
(tests/cuda_shim/kernel_suite.cc) on devices of several shapes, against tests/kernels_reference.py, and their
memory accesses against each kernel's design (tests/cuda_shim/access_audit.cc, benchmarks/cuda_design.py)."""

import re
import subprocess
import sys
from pathlib import Path

import kernels_reference as ref
import ml_dtypes
import numpy as np
import pytest
from cuda_shim_build import build_kernel_suite, build_shim_selftest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import cuda_design  # noqa: E402

# Generous: the suite takes about 15 s of CPU time (ASan: about a minute); shared machines are slow.
TIMEOUT_S = 1800
DTYPES = {"f32": np.float32, "f16": np.float16, "bf16": ml_dtypes.bfloat16}
SIGN_SCALE_RTOL = 2e-6  # the GPU sums |x| in another order (SPEC section 2)
PASSED, PASSED_QUICK = 4334, 2864  # the kernel suite's checks, full and --quick


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    return build_kernel_suite(tmp_path_factory.mktemp("cuda_shim"))


def _run(exe, *args):
    result = subprocess.run(
        [str(exe), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    return _summary(result.returncode, result.stdout, result.stderr)


def _summary(returncode, stdout, stderr):
    """(passed, failed) of a kernel suite's run, which must have exited with status 0."""
    summary = re.search(r"(\d+) passed, (\d+) failed", stdout)
    assert returncode == 0 and summary, stdout[-4000:] + stderr[-4000:]
    passed, failed = map(int, summary.groups())
    return passed, failed


@pytest.mark.timeout(TIMEOUT_S)  # the first test of the run to use the shim pays its build (g++, minutes)
def test_cuda_kernels_under_the_shim_match_the_cpu_kernels(shim):
    passed, failed = _run(shim.suite)
    # 3 dtypes x 11 sizes on 4 device shapes, and each dtype's extremes: compress + decompress,
    # elementwise and decompress_reduce cases (kernel_suite.cc lists them).
    assert failed == 0 and passed >= PASSED


def test_cuda_kernels_under_the_shim_match_the_reference(shim, tmp_path):
    subprocess.run([str(shim.suite), "--dump", str(tmp_path)], check=True, timeout=TIMEOUT_S)
    cases = (tmp_path / "cases.txt").read_text().split("\n")
    cases = [line.split() for line in cases if line]
    assert len(cases) == 54
    for prefix, dtype_name, n, k, feedback in cases:
        n, k, dtype = int(n), int(k), DTYPES[dtype_name]

        def load(name, dtype=np.uint8, prefix=prefix):
            return np.fromfile(tmp_path / f"{prefix}.{name}.bin", dtype)

        x = load("x", dtype)
        residual = load("residual", np.float32) if feedback == "1" else None
        for name, bits in (("minmax_uint8", 8), ("minmax_uint4", 4)):
            minmax, expected_residual = ref.minmax_compress(x, k, residual, bits=bits)
            np.testing.assert_array_equal(load(name), minmax, err_msg=prefix)
            if residual is not None:
                np.testing.assert_array_equal(load(f"{name}_residual", np.float32), expected_residual, err_msg=prefix)
            np.testing.assert_array_equal(
                load(f"{name}_decoded", dtype),
                ref.minmax_decompress(minmax, n, k, bits=bits).astype(dtype),
                err_msg=prefix,
            )
        signs = load("sign")
        expected_signs, _ = ref.sign_compress(x, k, residual)
        np.testing.assert_array_equal(
            ref.chunk_bits(signs, n, k),
            ref.chunk_bits(expected_signs, n, k),
            err_msg=prefix,
        )
        np.testing.assert_allclose(
            ref.chunk_scales(signs, n, k),
            ref.chunk_scales(expected_signs, n, k),
            rtol=SIGN_SCALE_RTOL,
            err_msg=prefix,
        )
        decoded = ref.sign_decompress(signs, n, k)
        np.testing.assert_array_equal(load("sign_decoded", dtype), decoded.astype(dtype), err_msg=prefix)
        if residual is not None:
            y = (x.astype(np.float32) + residual).astype(np.float32)
            np.testing.assert_array_equal(load("sign_residual", np.float32), (y - decoded).astype(np.float32))


@pytest.mark.background_job("sanitized_kernel_suite")
def test_cuda_kernels_under_the_shim_with_address_and_ub_sanitizers(background_job):
    # Built and run by cuda_shim_build.run_sanitized_suite while the rest of the suite runs (background_jobs.py).
    returncode, output = background_job.result(timeout=TIMEOUT_S)
    passed, failed = _summary(returncode, output, "")
    assert failed == 0 and passed >= PASSED_QUICK


def test_cuda_kernels_move_each_byte_as_their_design_says(shim):
    """Each input byte read once (twice for the two-pass sign compress with error feedback), each output byte
    written once, tensors in 16-byte accesses, every warp access one contiguous run."""
    audit = subprocess.run([str(shim.audit)], check=True, capture_output=True, text=True, timeout=TIMEOUT_S)
    mismatches = cuda_design.audit_mismatches(audit.stdout)
    assert not mismatches, "\n".join(mismatches)


@pytest.fixture(scope="module")
def selftest(tmp_path_factory):
    return build_shim_selftest(tmp_path_factory.mktemp("shim_selftest"))


@pytest.mark.parametrize(
    ("scenario", "message"),
    [
        ("divergent_barrier", "divergent __syncthreads"),
        ("partial_shuffle", "a shuffle waits for lanes of its mask that have exited"),
        ("deadlock", "deadlock"),
        ("misaligned_vector", "misaligned uint4 access"),
    ],
)
def test_the_shim_reports_broken_cuda_rules(selftest, scenario, message):
    result = subprocess.run(
        [str(selftest), scenario],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0 and message in result.stderr, result.stderr


def test_the_shim_runs_warps_atomics_and_unsigned_indices_as_a_gpu(selftest):
    result = subprocess.run(
        [str(selftest), "faithful"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr

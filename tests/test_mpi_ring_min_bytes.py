"""The MPI engine's ring threshold, a run-time setting of each communicator, in JAX and torch.

MPICH with ``MPIR_CVAR_NOLOCAL=1`` treats every process as its own node, so the engine's ring
(used only between nodes) runs on this one machine. The ring adds rank by rank around the ring
(:func:`ring_sum` reproduces its order bit for bit); MPI's own allreduce adds in another order,
so against NumPy's float32 sum both agree to float32 rounding of the operands only.
"""

import numpy as np
import pytest
from mpi_ring_workers import SMALL
from multiprocess import run_ranks
from native_communicator_workers_jax import rank_data
from test_native_communicator_jax import BETWEEN_NODES, RING_MIN_BYTES, ring_sum

import bagua_jax

pytestmark = pytest.mark.skipif(not bagua_jax.build_info()["mpi"], reason="built without the MPI engine")


def numpy_sum(seed: int, size: int, count: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """Every rank's data, NumPy's sum, and the tolerance of another order of adding them."""
    xs = np.stack([rank_data(r, seed, (count,)) for r in range(size)])
    return xs, xs.sum(0), dict(rtol=1e-6, atol=1e-6 * float(np.abs(xs).max()) * size)


def test_jax_threshold_is_set_at_run_time_and_switches_the_allreduce_without_recompiling(rng):
    size, seed = 3, int(rng.integers(2**31))
    large = RING_MIN_BYTES // 4 + 7  # above the default threshold
    results = [
        r.value
        for r in run_ranks(
            "mpi_ring_workers:jax_threshold", size, seed, large, launcher="mpiexec", timeout=300, env=BETWEEN_NODES
        )
    ]
    small, small_sum, small_close = numpy_sum(seed, size, SMALL)
    big, big_sum, big_close = numpy_sum(seed, size, large)
    for res in results:
        assert res["spans_nodes"] and res["initial"] == RING_MIN_BYTES
        assert res["after_zero"] == 0 and res["split_inherits"] == 0
        # Below the threshold MPI's order; at threshold 0 the ring's, exactly; both are NumPy's sum.
        np.testing.assert_allclose(res["small_default"], small_sum, **small_close)
        np.testing.assert_array_equal(res["small_ring"], ring_sum(small))
        np.testing.assert_allclose(res["small_ring"], small_sum, **small_close)
        assert res["small_default"].tobytes() != res["small_ring"].tobytes()  # the switch took effect
        # A threshold beyond any message: MPI's allreduce, not the ring, even above 1 MiB.
        np.testing.assert_allclose(res["big_never"], big_sum, **big_close)
        assert res["big_never"].tobytes() != ring_sum(big).tobytes()
        assert res["compiles"] == 1
        assert "ValueError" in res["bad -1"] and ">= 0" in res["bad -1"]
        assert "TypeError" in res["bad True"] and "TypeError" in res["bad 1.5"]
        assert res["unchanged"] == 2**62
    for key in ("small_default", "small_ring", "big_never"):
        assert all(r[key].tobytes() == results[0][key].tobytes() for r in results), key


def test_torch_threshold_has_the_same_name_and_effect(rng):
    size, seed = 3, int(rng.integers(2**31))
    results = run_ranks(
        "mpi_ring_workers:torch_threshold", size, seed, launcher="mpiexec", timeout=300, env=BETWEEN_NODES
    )
    small, small_sum, close = numpy_sum(seed, size, SMALL)
    for res in (r.value for r in results):
        assert res["spans_nodes"] and res["initial"] == RING_MIN_BYTES and res["after_zero"] == 0
        np.testing.assert_allclose(res["small_default"], small_sum, **close)
        np.testing.assert_array_equal(res["small_ring"], ring_sum(small))


@pytest.mark.parametrize("value, expected", [("4096", "4096"), ("12k", "whole number"), ("-5", "whole number")])
def test_environment_sets_the_default_and_is_validated(value, expected):
    results = run_ranks(
        "mpi_ring_workers:environment_threshold",
        1,
        launcher="mpiexec",
        timeout=300,
        env={"BAGUA_MPI_RING_MIN_BYTES": value},
    )
    assert expected in results[0].value, results[0].value


def test_one_node_does_not_span_nodes(seed):
    results = run_ranks("mpi_ring_workers:torch_threshold", 2, seed, launcher="mpiexec", timeout=300)
    assert not any(r.value["spans_nodes"] for r in results)


def test_ranks_with_different_environment_values_fail_up_front_on_every_rank():
    per_rank = ["4096", "4096", "65536"]
    results = run_ranks("mpi_ring_workers:environment_threshold", 3, per_rank, launcher="mpiexec", timeout=300)
    for res in results:
        assert res.value.startswith("ValueError") and "differs across ranks (4096 to 65536 bytes)" in res.value

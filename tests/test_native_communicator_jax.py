"""The JAX NativeCommunicator over the MPI engine, on 2 and 4 processes."""

import numpy as np
import pytest
from jax_native_workers import rank_data
from jax_workers import pairing_schedule
from multiprocess import run_ranks

import bagua_jax

pytestmark = pytest.mark.skipif(not bagua_jax.build_info()["mpi"], reason="built without the MPI engine")


@pytest.mark.parametrize("size", [2, 4])
def test_every_primitive_matches_numpy(size):
    seed = int(np.random.default_rng().integers(2**31))
    results = run_ranks("jax_native_workers:every_primitive", size, seed, launcher="mpiexec", timeout=180)
    xs = np.stack([rank_data(r, seed) for r in range(size)])
    rows = np.stack([rank_data(r, seed, (size, 4)) for r in range(size)])
    # Sums may be added in any order by MPI: allow float32 rounding relative to the operands.
    close = dict(rtol=1e-6, atol=1e-6 * float(np.abs(xs).max()) * size)
    for res in (r.value for r in results):
        rank = res["rank"]
        np.testing.assert_allclose(res["allreduce_sum"], xs.sum(0), **close)
        np.testing.assert_allclose(res["allreduce_avg"], xs.mean(0), **close)
        np.testing.assert_array_equal(res["allreduce_min"], xs.min(0))
        np.testing.assert_array_equal(res["allreduce_max"], xs.max(0))
        np.testing.assert_allclose(res["reduce_sum"], xs.sum(0) if rank == 1 else 0 * xs[0], **close)
        np.testing.assert_array_equal(res["broadcast"], xs[size - 1])
        np.testing.assert_allclose(res["reduce_scatter_sum"], rows[:, rank].sum(0), **close)
        np.testing.assert_array_equal(res["allgather"], xs)
        np.testing.assert_array_equal(res["gather"], xs if rank == 0 else 0 * xs)
        np.testing.assert_array_equal(res["scatter"], rows[1, rank])
        np.testing.assert_array_equal(res["alltoall"], rows[:, rank])
        expected_v = np.zeros(size * size + 3, np.float32)
        expected_v[: size * (size + 1) // 2] = np.concatenate(
            [np.arange(size * (j + 1), dtype=np.float32)[rank * (j + 1) : (rank + 1) * (j + 1)] + 100 * j for j in range(size)]
        )
        np.testing.assert_array_equal(res["alltoall_v"], expected_v)
        np.testing.assert_array_equal(res["send_recv"], xs[[(rank + 1) % size, (rank - 1) % size]])
        np.testing.assert_array_equal(res["send_recv_scheduled"], xs[pairing_schedule(size)[seed % 2, rank]])
        np.testing.assert_array_equal(res["barrier"], xs[rank])
        np.testing.assert_array_equal(res["int_allreduce"], np.arange(4) * sum(range(1, size + 1)))
    # Every rank holds the same bits wherever every rank receives the same value.
    for key in ("allreduce_sum", "allreduce_avg", "allreduce_min", "allreduce_max", "allgather", "broadcast", "bf16_allreduce"):
        first = results[0].value[key]
        for other in results[1:]:
            assert first.tobytes() == other.value[key].tobytes(), key


def test_a_dead_peer_raises_on_the_survivors_within_the_timeout():
    results = run_ranks("jax_native_workers:dies_or_waits", 2, 1, launcher="mpiexec", timeout=60, check=False)
    survivor = results[0]
    assert survivor.value is not None, survivor.output
    assert "allreduce" in survivor.value and "'world'" in survivor.value and "rank 0 of 2" in survivor.value
    assert "did not complete within 3" in survivor.value


def test_opposite_send_recv_orders_do_not_deadlock():
    n = 1 << 20
    results = run_ranks("jax_native_workers:opposite_orders", 2, n, launcher="mpiexec", timeout=120)
    np.testing.assert_array_equal(results[0].value, np.full(n, 20.0, np.float32))
    np.testing.assert_array_equal(results[1].value, np.full(n, 1.0, np.float32))

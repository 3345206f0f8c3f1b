"""The JAX NativeCommunicator over the MPI engine, on 2, 3 and 4 processes.

One MPI job per world size and layout (one node; every process a node of its own) runs the scenarios of
``native_communicator_workers_jax`` that the tests below check; the dead-peer tests kill a rank and have jobs of
their own.
"""

import ml_dtypes
import numpy as np
import pytest
from every_primitive import check_every_primitive, rank_data
from multiprocess import run_ranks
from scenarios import Job, JobTable, Scenario, has_mpi

import bagua_jax

pytestmark = pytest.mark.skipif(not bagua_jax.build_info()["mpi"], reason="built without the MPI engine")

# MPICH with MPIR_CVAR_NOLOCAL=1 treats every process as its own node: the engine's ring
# allreduce (between nodes, from 1 MiB) runs on this one machine.
BETWEEN_NODES = {"MPIR_CVAR_NOLOCAL": "1"}
RING_MIN_BYTES = 1 << 20


def large_allreduces(size: int) -> Scenario:
    """Allreduces above the ring's threshold, in chunks of unequal length."""
    return Scenario("large_allreduces", {"count": RING_MIN_BYTES // 4 + 2 * size + 1})


EVERY_PRIMITIVE, OPPOSITE_ORDERS = Scenario("every_primitive"), Scenario("opposite_orders", {"n": 1 << 20})
JOBS = JobTable(
    "native_communicator_workers_jax:job",
    {
        "2-one-node": Job(2, "mpiexec", (EVERY_PRIMITIVE, large_allreduces(2), OPPOSITE_ORDERS)),
        "3-one-node": Job(3, "mpiexec", (large_allreduces(3),)),
        "4-one-node": Job(4, "mpiexec", (EVERY_PRIMITIVE, large_allreduces(4))),
        **{f"{n}-between-nodes": Job(n, "mpiexec", (large_allreduces(n),), env=BETWEEN_NODES) for n in (2, 3, 4)},
    },
    mpi=has_mpi(bagua_jax.build_info()),
)


@pytest.mark.parametrize("name", JOBS.jobs_with(EVERY_PRIMITIVE))
def test_every_primitive_matches_numpy(name):
    seed, ranks = JOBS.run(name)
    check_every_primitive([{"rank": r["rank"], **r[EVERY_PRIMITIVE.label]} for r in ranks], seed)


def ring_sum(xs: np.ndarray) -> np.ndarray:
    """The ring's float32 sum, bit for bit: chunk c (``np.array_split``'s c-th) starts at rank c
    and gains rank c+1's, c+2's, ... values in turn."""
    size = len(xs)
    bounds = np.cumsum([0] + [len(c) for c in np.array_split(xs[0], size)])
    out = np.empty_like(xs[0])
    for c in range(size):
        part = slice(bounds[c], bounds[c + 1])
        acc = xs[c, part].copy()
        for j in range(1, size):
            acc = acc + xs[(c + j) % size, part]
        out[part] = acc
    return out


@pytest.mark.parametrize(("name", "scenario"), JOBS.cases("large_allreduces"))
def test_large_allreduces_match_numpy(name, scenario):
    seed, ranks = JOBS.run(name)
    results = [{"rank": r["rank"], **r[scenario.label]} for r in ranks]
    size, count, between_nodes = len(results), scenario.options["count"], bool(JOBS.jobs[name].env)
    xs = np.stack([rank_data(r, seed, (count,)) for r in range(size)])
    close = dict(rtol=1e-6, atol=1e-6 * float(np.abs(xs).max()) * size)
    for res in results:
        if between_nodes:  # the ring's order of additions, exactly
            np.testing.assert_array_equal(res["float32_sum"], ring_sum(xs))
            np.testing.assert_array_equal(res["float32_avg"], ring_sum(xs) / np.float32(size))
        np.testing.assert_allclose(res["float32_sum"], xs.sum(0), **close)
        np.testing.assert_allclose(res["float32_avg"], xs.mean(0), **close)
        np.testing.assert_array_equal(res["float32_min"], xs.min(0))
        np.testing.assert_array_equal(res["float32_max"], xs.max(0))
        np.testing.assert_array_equal(res["float32_sum_in_place"], res["float32_sum"])
        np.testing.assert_array_equal(res["int32_sum"], (xs * 1000).astype(np.int32).sum(0))
        for dtype, rtol in (("float16", 4e-3), ("bfloat16", 3e-2)):
            exact = xs.astype(ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16).astype(np.float64).sum(0)
            np.testing.assert_allclose(
                res[f"{dtype}_sum"].astype(np.float64), exact, rtol=rtol, atol=rtol * size * float(np.abs(xs).max())
            )
    for key in results[0]:
        if key != "rank":
            assert all(r[key].tobytes() == results[0][key].tobytes() for r in results), key


@pytest.mark.parametrize(
    "count, env", [(1000, None), (RING_MIN_BYTES // 4 * 2, BETWEEN_NODES)], ids=["mpi-allreduce", "ring-allreduce"]
)
def test_a_dead_peer_raises_on_the_survivors_within_the_timeout(count, env):
    results = run_ranks(
        "native_communicator_workers_jax:dies_or_waits",
        2,
        1,
        count,
        launcher="mpiexec",
        timeout=300,
        check=False,
        env=env,
    )
    survivor = results[0]
    assert survivor.value is not None, survivor.output
    assert "allreduce" in survivor.value and "'world'" in survivor.value and "rank 0 of 2" in survivor.value
    assert "did not complete within 3" in survivor.value


def test_opposite_send_recv_orders_do_not_deadlock():
    _, ranks = JOBS.run("2-one-node")
    n = OPPOSITE_ORDERS.options["n"]
    np.testing.assert_array_equal(ranks[0][OPPOSITE_ORDERS.label], np.full(n, 20.0, np.float32))
    np.testing.assert_array_equal(ranks[1][OPPOSITE_ORDERS.label], np.full(n, 1.0, np.float32))


@pytest.mark.parametrize("count", [1000, RING_MIN_BYTES // 4 * 2], ids=["mpi-allreduce", "ring-allreduce"])
def test_an_average_divides_by_the_ranks_set_at_run_time(count):
    # A fault-tolerant joiner sends zeros in the step it is weighed out of: the average is the others'.
    size, seed = 3, 11
    runs = run_ranks(
        "native_communicator_workers_jax:weighed_average",
        size,
        seed,
        count,
        launcher="mpiexec",
        timeout=300,
        env=BETWEEN_NODES,
    )
    results = [r.value for r in runs]
    data = [rank_data(rank, seed, (count,)) for rank in range(size)]
    for res in results:
        np.testing.assert_allclose(res["weighed"], (data[0] + data[1]) / 2, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(res["all"], sum(data) / 3, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(res["weighed"], results[0]["weighed"])
        assert res["compiles"] == 1
        assert "must be 1..3 (the size) or None, got 0" in res["bad 0"] and "got 4" in res["bad 4"]


def test_send_recv_sends_nothing_before_the_peer_is_ready():
    # UCX over TCP, every message eager (as benchmarks/harness/links.py runs MPI): an eager send would push rank 0's
    # data into rank 1's socket while rank 1 is still elsewhere (at a step, or receiving another peer's exchange).
    count, late_seconds = 1 << 20, 1.5
    ranks = run_ranks(
        "native_communicator_workers_jax:late_peer",
        2,
        count,
        late_seconds,
        launcher="mpiexec",
        timeout=300,
        env={"MPIR_CVAR_NOLOCAL": "1", "UCX_TLS": "tcp,self", "UCX_RNDV_THRESH": "inf"},
    )
    for rank, result in enumerate(r.value for r in ranks):
        np.testing.assert_array_equal(result["received"], np.full(count, 2.0 - rank, np.float32))
    assert ranks[1].value["sent_while_late"] < 16384, ranks[1].value

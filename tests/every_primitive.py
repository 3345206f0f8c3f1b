"""Every collective of a NativeCommunicator once, on each rank (:func:`run_every_primitive`), and the check of the
ranks' results against NumPy (:func:`check_every_primitive`): the same test for each engine."""

import numpy as np
from lax_communicator_workers_jax import pairing_schedule

OPS = ("sum", "avg", "min", "max")


def rank_data(rank: int, seed: int, shape=(3, 5)) -> np.ndarray:
    return np.random.default_rng([seed, rank]).standard_normal(shape).astype(np.float32)


def run_every_primitive(comm, seed: int) -> dict:
    """Run each collective of ``comm`` (a NativeCommunicator) once inside one jitted step; return the local
    results."""
    import jax
    import jax.numpy as jnp

    rank, size = int(comm.rank()), comm.size
    x = jnp.asarray(rank_data(rank, seed))
    rows = jnp.asarray(rank_data(rank, seed, (size, 4)))
    # Rank r sends r+1 elements to every rank, so rank r receives j+1 from rank j.
    send_counts = jnp.full(size, rank + 1, jnp.int32)
    recv_counts = jnp.arange(1, size + 1, dtype=jnp.int32)
    flat = jnp.arange(size * (rank + 1), dtype=jnp.float32) + 100 * rank
    peers = jnp.array([(rank + 1) % size, (rank - 1) % size], jnp.int32)

    @jax.jit
    def step(x, rows, flat, send_counts, recv_counts, peers):
        out = {f"allreduce_{op}": comm.allreduce(x, op) for op in OPS}
        out["reduce_sum"] = comm.reduce(x, root=1, op="sum")
        out["broadcast"] = comm.broadcast(x, root=size - 1)
        out["reduce_scatter_sum"] = comm.reduce_scatter(rows, "sum")
        out["allgather"] = comm.allgather(x)
        out["gather"] = comm.gather(x, root=0)
        out["scatter"] = comm.scatter(rows, root=1)
        out["alltoall"] = comm.alltoall(rows)
        out["alltoall_v"] = comm.alltoall_v(flat, send_counts, recv_counts, out_size=size * size + 3)
        out["send_recv"] = comm.send_recv(x, peers)
        out["send_recv_scheduled"] = comm.send_recv_scheduled(x, pairing_schedule(size), seed)
        out["barrier"] = comm.barrier(x)
        out["int_allreduce"] = comm.allreduce(jnp.arange(4, dtype=jnp.int32) * (rank + 1))
        out["bf16_allreduce"] = comm.allreduce(x.astype(jnp.bfloat16), "max")
        return out

    result = step(x, rows, flat, send_counts, recv_counts, peers)
    return {"rank": rank, "size": size, **{k: np.asarray(v) for k, v in result.items()}}


def check_every_primitive(results: list[dict], seed: int) -> None:
    """Assert that the ranks' ``run_every_primitive`` results match NumPy's, and are the same bits on every rank
    wherever every rank receives the same value."""
    size = len(results)
    xs = np.stack([rank_data(r, seed) for r in range(size)])
    rows = np.stack([rank_data(r, seed, (size, 4)) for r in range(size)])
    # Sums may be added in any order by the engine: allow float32 rounding relative to the operands.
    close = dict(rtol=1e-6, atol=1e-6 * float(np.abs(xs).max()) * size)
    for res in results:
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
            [
                np.arange(size * (j + 1), dtype=np.float32)[rank * (j + 1) : (rank + 1) * (j + 1)] + 100 * j
                for j in range(size)
            ]
        )
        np.testing.assert_array_equal(res["alltoall_v"], expected_v)
        np.testing.assert_array_equal(res["send_recv"], xs[[(rank + 1) % size, (rank - 1) % size]])
        np.testing.assert_array_equal(res["send_recv_scheduled"], xs[pairing_schedule(size)[seed % 2, rank]])
        np.testing.assert_array_equal(res["barrier"], xs[rank])
        np.testing.assert_array_equal(res["int_allreduce"], np.arange(4) * sum(range(1, size + 1)))
    # Every rank holds the same bits wherever every rank receives the same value.
    for key in (
        "allreduce_sum",
        "allreduce_avg",
        "allreduce_min",
        "allreduce_max",
        "allgather",
        "broadcast",
        "bf16_allreduce",
    ):
        first = results[0][key]
        for other in results[1:]:
            assert first.tobytes() == other[key].tobytes(), key

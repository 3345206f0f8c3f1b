"""LaxCommunicator on 2 and 4 simulated CPU devices in one process, against NumPy.

conftest.py forces four host devices before jax loads. Each test runs the
collective under ``jax.jit(jax.shard_map(...))`` over a 1-D mesh of the first n
devices; inputs are stacked per rank on a leading axis of size n, and so are the
outputs, so ``out[r]`` is what rank r computed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from lax_communicator_workers_jax import pairing_schedule

from bagua_jax import Communicator, LaxCommunicator
from bagua_jax.communicator import REDUCE_OPS, check_schedule

NS = (2, 4)
BF16 = np.dtype(ml_dtypes.bfloat16)
F32_EPS = float(np.finfo(np.float32).eps)
BF16_EPS = 2.0**-7


def mesh_of(n: int, names: tuple[str, ...] = ("r",), shape: tuple[int, ...] | None = None) -> Mesh:
    devices = jax.devices()[:n]
    assert len(devices) == n, f"need {n} devices, have {len(jax.devices())} (conftest sets XLA_FLAGS)"
    return Mesh(np.array(devices).reshape(shape or (n,)), names)


def per_rank(n: int, fn, *inputs, names: tuple[str, ...] = ("r",), shape: tuple[int, ...] | None = None):
    """Run ``fn(*rank_slices)`` on each of n ranks; return its outputs stacked per rank as NumPy."""
    mesh = mesh_of(n, names, shape)
    axes = names if len(names) > 1 else names[0]

    def body(*xs):
        return jax.tree.map(lambda y: jnp.asarray(y)[None], fn(*[x[0] for x in xs]))

    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
    return jax.tree.map(np.asarray, mapped(*inputs))


def data(rng: np.random.Generator, shape: tuple[int, ...], dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return rng.integers(-1000, 1000, size=shape).astype(dtype)
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 2)).astype(dtype)


def assert_same_on_all_ranks(out: np.ndarray) -> None:
    for r in range(1, out.shape[0]):
        assert out[r].tobytes() == out[0].tobytes(), f"rank {r} differs from rank 0 bit-wise"


def assert_reduced(got: np.ndarray, xs: np.ndarray, op: str) -> None:
    """``got`` (one rank's result) against the NumPy reduction of ``xs`` over its leading axis."""
    n = xs.shape[0]
    if op in ("min", "max"):
        expected = xs.min(axis=0) if op == "min" else xs.max(axis=0)
        assert got.dtype == xs.dtype
        np.testing.assert_array_equal(got, expected)
        return
    if xs.dtype.kind in "iu":
        np.testing.assert_array_equal(got, xs.sum(axis=0, dtype=xs.dtype))
        return
    wide = xs.astype(np.float64)
    expected = wide.sum(axis=0) / (n if op == "avg" else 1)
    # Any summation order in the input dtype is within (n - 1) roundings of sum |x|.
    eps = BF16_EPS if xs.dtype == BF16 else F32_EPS
    bound = n * eps * np.abs(wide).sum(axis=0) / (n if op == "avg" else 1) + 1e-30
    assert got.dtype == xs.dtype
    assert np.all(np.abs(got.astype(np.float64) - expected) <= bound), np.max(np.abs(got - expected) / bound)


def ops_for(dtype) -> list[str]:
    return [op for op in REDUCE_OPS if not (op == "avg" and np.dtype(dtype).kind in "iu")]


CASES = [(n, op, dt) for n in NS for dt in (np.float32, BF16, np.int32) for op in ops_for(dt)]


# ----------------------------------------------------------------- basics


def test_protocol_and_size():
    comm = LaxCommunicator("r", 4)
    assert isinstance(comm, Communicator)
    assert comm.size == 4 and type(comm.size) is int
    assert LaxCommunicator("r", 4) == comm and hash(LaxCommunicator("r", 4)) == hash(comm)
    with pytest.raises(ValueError, match="not bound"):
        _ = LaxCommunicator("r").size  # not derivable outside shard_map


@pytest.mark.parametrize("n", NS)
def test_rank_and_derived_size(n):
    comm = LaxCommunicator("r")  # size read from the mesh while tracing
    sizes = []

    def fn(x):
        sizes.append(comm.size)
        return comm.rank()

    out = per_rank(n, fn, np.zeros((n, 1), np.float32))
    assert sizes == [n] and type(sizes[0]) is int
    assert out.dtype == np.int32
    np.testing.assert_array_equal(out, np.arange(n))


# -------------------------------------------------------------- reductions


@pytest.mark.parametrize("n,op,dtype", CASES)
def test_allreduce(rng, n, op, dtype):
    xs = data(rng, (n, 5, 7), dtype)
    comm = LaxCommunicator("r", n)
    out = per_rank(n, lambda x: comm.allreduce(x, op), xs)
    assert out.shape == xs.shape
    assert_same_on_all_ranks(out)
    assert_reduced(out[0], xs, op)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce(rng, n, op):
    xs = data(rng, (n, 33), np.float32)
    root = int(rng.integers(n))
    comm = LaxCommunicator("r", n)
    out = per_rank(n, lambda x: comm.reduce(x, root, op), xs)
    assert_reduced(out[root], xs, op)
    for r in range(n):
        if r != root:
            assert out[r].tobytes() == np.zeros_like(out[r]).tobytes(), f"rank {r} is not zeros"


@pytest.mark.parametrize("n", NS)
def test_reduce_int32_matches_allreduce_on_root(rng, n):
    xs = data(rng, (n, 4, 3), np.int32)
    comm = LaxCommunicator("r", n)
    reduced, allreduced = per_rank(n, lambda x: (comm.reduce(x, n - 1, "sum"), comm.allreduce(x, "sum")), xs)
    np.testing.assert_array_equal(reduced[n - 1], allreduced[n - 1])
    np.testing.assert_array_equal(reduced[: n - 1], 0)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_scatter(rng, n, op):
    xs = data(rng, (n, n, 3, 2), np.float32)  # rank i's x is xs[i], of shape [n, 3, 2]
    comm = LaxCommunicator("r", n)
    out = per_rank(n, lambda x: comm.reduce_scatter(x, op), xs)
    assert out.shape == (n, 3, 2)
    for r in range(n):
        assert_reduced(out[r], xs[:, r], op)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype,op", [(np.int32, "sum"), (BF16, "max"), (BF16, "sum")])
def test_reduce_scatter_other_dtypes(rng, n, dtype, op):
    xs = data(rng, (n, 2 * n * 5), dtype)  # a flat bucket, reshaped to one row per rank
    comm = LaxCommunicator("r", n)
    out = per_rank(n, lambda x: comm.reduce_scatter(x.reshape(n, -1), op), xs)
    assert out.shape == (n, 10)
    for r in range(n):
        assert_reduced(out[r], xs[:, 10 * r : 10 * r + 10], op)


# ------------------------------------------------------------- data motion


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.int32, np.bool_])
def test_broadcast_is_bit_exact(rng, n, dtype):
    if dtype == np.bool_:
        xs = rng.integers(0, 2, size=(n, 9)).astype(bool)
    else:
        xs = data(rng, (n, 9), dtype)
    if np.dtype(dtype).kind == "f" or dtype == BF16:
        # -0.0, a NaN with a payload and infinities must survive bit for bit.
        special = np.array([-0.0, np.inf, -np.inf], np.float32).astype(dtype)
        xs[:, :3] = special
        xs[:, 3] = np.array(np.uint32(0x7FC0_1234)).view(np.float32).astype(dtype)
    root = int(rng.integers(n))
    comm = LaxCommunicator("r", n)
    out = per_rank(n, lambda x: comm.broadcast(x, root), xs)
    for r in range(n):
        assert out[r].dtype == xs.dtype
        assert out[r].tobytes() == xs[root].tobytes(), f"rank {r} did not get root {root}'s bits"


@pytest.mark.parametrize("n", NS)
def test_allgather_and_gather(rng, n):
    xs = data(rng, (n, 3, 2), np.float32)
    root = int(rng.integers(n))
    comm = LaxCommunicator("r", n)
    gathered, rooted = per_rank(n, lambda x: (comm.allgather(x), comm.gather(x, root)), xs)
    assert gathered.shape == (n, n, 3, 2)
    for r in range(n):
        assert gathered[r].tobytes() == xs.tobytes()
        if r == root:
            assert rooted[r].tobytes() == xs.tobytes()
        else:
            np.testing.assert_array_equal(rooted[r], 0)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_scatter(rng, n, dtype):
    xs = data(rng, (n, n, 4), dtype)  # every rank has an x; only root's is read
    root = int(rng.integers(n))
    comm = LaxCommunicator("r", n)
    out = per_rank(n, lambda x: comm.scatter(x, root), xs)
    assert out.shape == (n, 4)
    for r in range(n):
        assert out[r].tobytes() == xs[root, r].tobytes()


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_alltoall(rng, n, dtype):
    xs = data(rng, (n, n, 3, 2), dtype)
    comm = LaxCommunicator("r", n)
    out = per_rank(n, comm.alltoall, xs)
    # Row j of rank r's result is row r of rank j's input.
    np.testing.assert_array_equal(out, xs.transpose(1, 0, 2, 3))


def alltoall_v_reference(xs: np.ndarray, counts: np.ndarray, out_size: int) -> np.ndarray:
    """counts[i, j]: elements rank i sends to rank j (packed in rank order on the sender)."""
    n = xs.shape[0]
    out = np.zeros((n, out_size), xs.dtype)
    for r in range(n):
        pieces = []
        for j in range(n):
            start = counts[j, :r].sum()
            pieces.append(xs[j, start : start + counts[j, r]])
        packed = np.concatenate(pieces)
        out[r, : packed.size] = packed
    return out


@pytest.mark.parametrize("n", NS)
def test_alltoall_v(rng, n):
    m, out_size = 12, 4 * 12  # random counts below 4 to each of up to 4 ranks always fit in m
    comm = LaxCommunicator("r", n)
    mesh = mesh_of(n)

    def body(x, send, recv):
        return comm.alltoall_v(x[0], send[0], recv[0], out_size)[None]

    # One compiled program, several count patterns: the counts are run-time values.
    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("r"), out_specs=P("r")))
    patterns = [rng.integers(0, 4, size=(n, n)), np.zeros((n, n), int), np.full((n, n), m // n)]
    patterns[1][0, n - 1] = m  # one rank sends everything to the last, nothing else moves
    for counts in patterns:
        counts = counts.astype(np.int64)
        assert counts.sum(axis=1).max() <= m
        xs = data(rng, (n, m), np.float32)
        send, recv = counts, np.ascontiguousarray(counts.T)
        out = np.asarray(mapped(xs, send, recv))
        expected = alltoall_v_reference(xs, counts, out_size)
        assert out.tobytes() == expected.tobytes(), f"counts\n{counts}\ngot\n{out}\nexpected\n{expected}"


@pytest.mark.parametrize("n", NS)
def test_alltoall_v_truncates_to_out_size(rng, n):
    m = 6
    counts = np.full((n, n), 2, np.int64)  # everyone receives 2n elements
    out_size = 2 * n - 1
    xs = data(rng, (n, m), np.int32)
    comm = LaxCommunicator("r", n)
    out = per_rank(n, lambda x, s, r: comm.alltoall_v(x, s, r, out_size), xs, counts, counts.T.copy())
    np.testing.assert_array_equal(out, alltoall_v_reference(xs, counts, 2 * n)[:, :out_size])


def shift_one_peer(r: int, n: int, t: int) -> int:
    half = n // 2
    return (t + r) % half + half if r < half else (r - half - t) % half


@pytest.mark.parametrize("n", NS)
def test_send_recv(rng, n):
    xs = data(rng, (n, 5), np.float32)
    comm = LaxCommunicator("r", n)
    mesh = mesh_of(n)
    mapped = jax.jit(
        jax.shard_map(lambda x, p: comm.send_recv(x[0], p[0])[None], mesh=mesh, in_specs=P("r"), out_specs=P("r"))
    )
    # Decentralized shift_one pairing at a few steps, then a ring (left and right neighbours):
    # the peers are run-time data, so one compiled program serves every step.
    for t in range(3):
        peers = np.array([[shift_one_peer(r, n, t)] for r in range(n)], np.int32)
        out = np.asarray(mapped(xs, peers))
        for r in range(n):
            assert out[r, 0].tobytes() == xs[peers[r, 0]].tobytes()
    ring = np.array([[(r - 1) % n, (r + 1) % n] for r in range(n)], np.int32)
    ring_mapped = jax.jit(
        jax.shard_map(lambda x, p: comm.send_recv(x[0], p[0])[None], mesh=mesh, in_specs=P("r"), out_specs=P("r"))
    )
    out = np.asarray(ring_mapped(xs, ring))
    assert out.shape == (n, 2, 5)
    for r in range(n):
        np.testing.assert_array_equal(out[r], xs[ring[r]])
    # An out-of-range peer gives zeros.
    bad = np.array([[n, 0] for _ in range(n)], np.int32)
    out = np.asarray(ring_mapped(xs, bad))
    np.testing.assert_array_equal(out[:, 0], 0)
    np.testing.assert_array_equal(out[:, 1], np.broadcast_to(xs[0], (n, 5)))


@pytest.mark.parametrize("n", NS)
def test_send_recv_scheduled(rng, n):
    """A run-time round index picks a pairing of a static table; rows come from the listed peers,
    and the compiled program holds point-to-point permutes, not an all-gather."""
    xs = data(rng, (n, 5), np.float32)
    comm = LaxCommunicator("r", n)
    ranks = np.arange(n)
    pairings = pairing_schedule(n)  # two rounds, one peer each
    ring = np.stack([(ranks - 1) % n, (ranks + 1) % n], axis=-1)[None]  # one round, two peers
    body = jax.shard_map(
        lambda x, t: (
            comm.send_recv_scheduled(x[0], pairings, t[0])[None],
            comm.send_recv_scheduled(x[0], ring, 0)[None],
        ),
        mesh=mesh_of(n),
        in_specs=P("r"),
        out_specs=P("r"),
    )
    mapped = jax.jit(body)
    for t in range(5):
        paired, ringed = map(np.asarray, mapped(xs, np.full(n, t, np.int32)))
        for r in range(n):
            np.testing.assert_array_equal(paired[r, 0], xs[pairings[t % 2, r, 0]])
            np.testing.assert_array_equal(ringed[r], xs[ring[0, r]])
    hlo = mapped.lower(xs, np.zeros(n, np.int32)).as_text()
    assert "collective_permute" in hlo and "all_gather" not in hlo


def test_send_recv_scheduled_rejects_bad_tables():
    comm = LaxCommunicator("r", 2)
    call = lambda table: jax.eval_shape(  # noqa: E731
        jax.shard_map(
            lambda x: comm.send_recv_scheduled(x, table, 0), mesh=mesh_of(2), in_specs=P("r"), out_specs=P("r")
        ),
        jnp.zeros((2, 3)),
    )
    with pytest.raises(ValueError, match=r"int table \[rounds, 2, peers\]"):
        call(np.zeros((2, 1), np.int32))
    with pytest.raises(ValueError, match="not a permutation"):
        call(np.zeros((1, 2, 1), np.int32))
    with pytest.raises(ValueError, match="not symmetric"):  # a 3-cycle: 0 lists 1, but 1 lists 2
        check_schedule(np.array([[[1], [2], [0]]]), 3)


@pytest.mark.parametrize("n", NS)
def test_barrier(rng, n):
    xs = data(rng, (n, 7), np.float32)
    xs[:, 0] = -0.0
    xs[:, 1] = np.nan
    ys = data(rng, (n, 3), np.int32)
    comm = LaxCommunicator("r", n)
    mesh = mesh_of(n)

    def body(x, y):
        out = comm.barrier({"x": x[0] * 2, "y": y[0]})  # a pytree passes through bit for bit
        return out["x"][None], out["y"][None]

    mapped = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("r"), out_specs=P("r")))
    x_out, y_out = (np.asarray(a) for a in mapped(xs, ys))
    assert x_out.tobytes() == (xs * 2).tobytes()
    assert y_out.tobytes() == ys.tobytes()
    # The barrier's all-reduce survives XLA's optimizations (CPU drops optimization barriers).
    assert "all-reduce(" in mapped.lower(xs, ys).compile().as_text()


# ------------------------------------------------------------ hierarchical


def test_hierarchical_2x2(rng):
    """On an ("inter", "intra") mesh, reducing over intra then inter equals the full allreduce."""
    names, shape = ("inter", "intra"), (2, 2)
    intra, inter, world = LaxCommunicator("intra", 2), LaxCommunicator("inter", 2), LaxCommunicator(names)
    xf = data(rng, (4, 6), np.float32)
    xi = data(rng, (4, 6), np.int32)

    def fn(f, i):
        two_level = inter.allreduce(intra.allreduce(i))
        # reduce to the node's local root, allreduce between the roots, broadcast inside the node
        rooted = intra.broadcast(inter.allreduce(intra.reduce(f, 0)), 0)
        return (
            world.rank(),
            intra.rank(),
            inter.rank(),
            world.size + 0 * world.rank(),
            two_level,
            world.allreduce(i),
            rooted,
            world.allgather(f),
            inter.allreduce(intra.allreduce(f, "max"), "max"),
            world.allreduce(f, "max"),
        )

    (w_rank, intra_rank, inter_rank, w_size, two_level, full, rooted, gathered, hmax, fmax) = per_rank(
        4, fn, xf, xi, names=names, shape=shape
    )
    np.testing.assert_array_equal(w_rank, np.arange(4))  # major to minor: inter * 2 + intra
    np.testing.assert_array_equal(intra_rank, [0, 1, 0, 1])
    np.testing.assert_array_equal(inter_rank, [0, 0, 1, 1])
    np.testing.assert_array_equal(w_size, 4)
    np.testing.assert_array_equal(two_level, full)
    assert_reduced(full[0], xi, "sum")
    assert_same_on_all_ranks(rooted)
    assert_reduced(rooted[0], xf, "sum")
    for r in range(4):
        assert gathered[r].tobytes() == xf.tobytes()  # row j is world rank j's x
    assert hmax.tobytes() == fmax.tobytes()
    assert_reduced(fmax[0], xf, "max")


# ----------------------------------------------------------------- errors


def trace(n: int, fn, shape=(4,), dtype=np.float32) -> None:
    mesh = mesh_of(n)
    x = np.zeros((n, *shape), dtype)
    jax.jit(jax.shard_map(lambda x: fn(x[0])[None], mesh=mesh, in_specs=P("r"), out_specs=P("r"))).trace(x)


def test_constructor_errors():
    with pytest.raises(ValueError, match="positive int"):
        LaxCommunicator("r", 0)
    with pytest.raises(ValueError, match="non-empty tuple"):
        LaxCommunicator(())
    with pytest.raises(ValueError, match="repeats"):
        LaxCommunicator(("a", "a"))
    with pytest.raises(TypeError, match="str or a tuple"):
        LaxCommunicator(3)


def test_argument_errors():
    comm = LaxCommunicator("r", 2)
    with pytest.raises(ValueError, match="unknown reduce op 'mean'"):
        trace(2, lambda x: comm.allreduce(x, "mean"))
    with pytest.raises(ValueError, match="unknown reduce op"):
        trace(2, lambda x: comm.reduce_scatter(x, "prod"))
    with pytest.raises(TypeError, match="'avg' needs a floating dtype"):
        trace(2, lambda x: comm.allreduce(x, "avg"), dtype=np.int32)
    for method in ("reduce", "broadcast", "gather"):
        for root in (2, -1):
            with pytest.raises(ValueError, match=f"root {root} is out of range for 2 ranks"):
                trace(2, lambda x: getattr(comm, method)(x, root))
    with pytest.raises(TypeError, match="root must be a Python int"):
        trace(2, lambda x: comm.broadcast(x, jnp.int32(0)))
    with pytest.raises(ValueError, match=r"\[size, ...\] with size=2 rows, got shape \(4,\)"):
        trace(2, comm.reduce_scatter, shape=(4,))
    with pytest.raises(ValueError, match="size=2 rows"):
        trace(2, comm.reduce_scatter, shape=())
    with pytest.raises(ValueError, match="size=2 rows"):
        trace(2, comm.alltoall, shape=(4,))
    with pytest.raises(ValueError, match="size=2 rows"):
        trace(2, lambda x: comm.scatter(x, 0), shape=(3, 2))
    with pytest.raises(ValueError, match="x must be 1-D"):
        trace(2, lambda x: comm.alltoall_v(x, jnp.ones(2, int), jnp.ones(2, int), 4), shape=(2, 2))
    with pytest.raises(ValueError, match="send_counts must be an integer array of 2 entries"):
        trace(2, lambda x: comm.alltoall_v(x, jnp.ones(3, int), jnp.ones(2, int), 4))
    with pytest.raises(ValueError, match="recv_counts must be an integer array"):
        trace(2, lambda x: comm.alltoall_v(x, jnp.ones(2, int), jnp.ones(2), 4))
    with pytest.raises(ValueError, match="out_size must be a non-negative int"):
        trace(2, lambda x: comm.alltoall_v(x, jnp.ones(2, int), jnp.ones(2, int), -1))
    with pytest.raises(TypeError, match="peers must be a 1-D integer array"):
        trace(2, lambda x: comm.send_recv(x, jnp.zeros(1)))
    with pytest.raises(ValueError, match="size=4 but mesh axis 'r' has 2 devices"):
        trace(2, LaxCommunicator("r", 4).allgather)
    with pytest.raises(ValueError, match="not bound"):
        trace(2, LaxCommunicator("nope", 2).allgather)

"""GradientAllReduce and ByteGrad against plain-NumPy simulations of all ranks, and the bytes they send.

conftest.py forces four simulated CPU devices. Each algorithm runs inside
``jax.jit(jax.shard_map(...))`` over the first n devices (flat: a 1-D ``("ranks",)``
mesh; hierarchical: a 2x2 ``("inter", "intra")`` mesh, world rank ``2 * inter +
intra``); every per-rank input and output carries a leading rank axis, so ``out[r]`` is
rank r's value. The references simulate every rank in one process with NumPy and the
kernel references of ``tests/kernels_reference.py`` only. Gradients are precomputed fresh
random arrays per step and rank (a different scale per rank), so the algorithms'
numerics can be compared exactly where they are deterministic.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import kernels_reference as ref
import numpy as np
import optax
import pytest
from algorithms_reference import bytegrad_bucket, node_average_slices, unflatten
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from multiprocess import ONE_CPU_DEVICE, run_ranks

import bagua_jax
from bagua_jax import LaxCommunicator
from bagua_jax.algorithms.base import Communicators
from bagua_jax.algorithms.bytegrad import ByteGrad, ByteGradState, bytegrad
from bagua_jax.algorithms.gradient_allreduce import (
    GradientAllReduce,
    gradient_allreduce,
)
from bagua_jax.counting import CountingCommunicator

F32 = np.float32
EPS = float(np.finfo(np.float32).eps)
STEPS = 5
SHAPES = {"a": (3,), "b": (5,), "w": (7, 5)}
# 48 bytes: "a" and "b" (12 + 20 bytes) share a bucket, "w" (140 bytes) gets its own; leaves in tree order.
BUCKET_BYTES = 48
BUCKETS = (("a", "b"), ("w",))

# ----------------------------------------------------------------------------- data


def make_grads(seed: int, steps: int, n: int) -> dict[str, np.ndarray]:
    """Gradients ``[steps, n, *shape]`` per leaf: normal values with a random scale per step, rank and leaf."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in SHAPES.items():
        scale = 10.0 ** rng.uniform(-2, 2, size=(steps, n) + (1,) * len(shape))
        out[name] = (rng.standard_normal((steps, n) + shape) * scale).astype(F32)
    return out


def make_params(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([seed, 1])
    return {name: rng.standard_normal(shape).astype(F32) for name, shape in SHAPES.items()}


def at(tree: dict, *index) -> dict:
    return {k: v[index] for k, v in tree.items()}


def replicate(tree: dict, n: int) -> dict:
    return {k: np.broadcast_to(v, (n,) + v.shape).copy() for k, v in tree.items()}


# ------------------------------------------------------------------ NumPy references


def np_flatten(g: dict[str, np.ndarray], pad_to: int) -> list[np.ndarray]:
    """The leaves of each bucket in ``BUCKETS`` concatenated and zero-padded to a multiple of ``pad_to``."""
    out = []
    for names in BUCKETS:
        flat = np.concatenate([g[k].astype(F32).reshape(-1) for k in names])
        out.append(np.concatenate([flat, np.zeros(-flat.size % pad_to, F32)]))
    return out


def np_bytegrad(grads: list[dict], residuals: list | None, *, hierarchical: bool, average: bool):
    """One ByteGrad step of all ranks. ``grads[r]`` is rank r's gradient dict, ``residuals[r][bucket]`` its
    error-feedback residuals (None: no error feedback). Returns (per-rank results, new residuals)."""
    n = len(grads)
    per_rank = [np_flatten(g, n) for g in grads]
    results: list[list[np.ndarray]] = [[] for _ in range(n)]
    new_res = None if residuals is None else [[] for _ in range(n)]
    for idx in range(len(BUCKETS)):
        buckets = [per_rank[r][idx] for r in range(n)]
        res = None if residuals is None else [residuals[r][idx] for r in range(n)]
        out, res = bytegrad_bucket(buckets, res, local=2 if hierarchical else None, average=average)
        outs = [out] * n
        for r in range(n):
            results[r].append(outs[r])
            if new_res is not None:
                new_res[r].append(res[r])
    return [unflatten(bs, BUCKETS, SHAPES) for bs in results], new_res


def bytegrad_error_bound(xs: list[np.ndarray]) -> np.ndarray:
    """Per-element bound on |pipeline result - float64 mean of ``xs``| for one group of k senders without error
    feedback: each sender's chunk decodes within (hi-lo)/508 of it, so their average is within the mean e1 of those;
    the averaged chunk (range at most its true range + 2 e1) is compressed again, adding (range)/508; plus float32
    rounding of the decode and average steps, a few ulps of the largest magnitude."""
    k = len(xs)
    m = xs[0].size // k
    stacked = np.stack(xs).astype(np.float64).reshape(k, k, m)  # [sender, chunk, element]
    e1 = (stacked.max(2) - stacked.min(2)).mean(0) / 508
    mean = stacked.mean(0)
    e2 = (mean.max(1) - mean.min(1) + 2 * e1) / 508
    rounding = 16 * EPS * np.abs(stacked).max()
    return np.repeat(e1 + e2, m) + rounding


def np_adam(params: dict, grads: list[dict], lr: float, b1=0.9, b2=0.999, eps=1e-8) -> list[dict]:
    """Adam (optax's defaults) in float64 on the given gradients; the params after each step.

    Only the bias corrections ``1 - b**t`` are formed as optax forms them, in float32: the
    subtraction cancels most digits (``1 - 0.999`` is off by 1.3e-5 relative), which moves the
    early steps by up to about 1e-6, more than the float32 rounding this test bounds."""
    p = {k: v.astype(np.float64) for k, v in params.items()}
    mu = {k: np.zeros_like(v) for k, v in p.items()}
    nu = {k: np.zeros_like(v) for k, v in p.items()}
    history = []
    for t, g in enumerate(grads, start=1):
        bc1, bc2 = (float(1 - jnp.float32(b) ** jnp.int32(t)) for b in (b1, b2))
        for k in SHAPES:
            mu[k] = b1 * mu[k] + (1 - b1) * g[k]
            nu[k] = b2 * nu[k] + (1 - b2) * g[k] ** 2
            p[k] = p[k] - lr * (mu[k] / bc1) / (np.sqrt(nu[k] / bc2) + eps)
        history.append({k: v.copy() for k, v in p.items()})
    return history


# ------------------------------------------------------------------ running on a mesh


def layout(n: int, hierarchical: bool) -> tuple[Mesh, str | tuple[str, str], Communicators]:
    devices = jax.devices()[:n]
    assert len(devices) == n, f"need {n} devices (conftest sets XLA_FLAGS)"
    if hierarchical:
        assert n == 4
        axes = ("inter", "intra")
        comms = Communicators(
            world=LaxCommunicator(axes), intra=LaxCommunicator("intra"), inter=LaxCommunicator("inter")
        )
        return Mesh(np.array(devices).reshape(2, 2), axes), axes, comms
    return Mesh(np.array(devices), ("ranks",)), "ranks", Communicators(world=LaxCommunicator("ranks"))


def wrap_comms(comms: Communicators) -> Communicators:
    return Communicators(*(None if c is None else CountingCommunicator(c) for c in comms))


class Ranks:
    """``init`` and one training ``step`` of ``make_tx(comms)`` on every rank, jitted once; NumPy in and out."""

    def __init__(self, n: int, hierarchical: bool, make_tx) -> None:
        mesh, axes, comms = layout(n, hierarchical)
        tx = make_tx(comms)
        spec = P(axes)

        def squeeze(tree):
            return jax.tree.map(lambda x: x[0], tree)

        def expand(tree):
            return jax.tree.map(lambda x: jnp.asarray(x)[None], tree)

        def init(params):
            return expand(tx.init(squeeze(params)))

        def step(params, state, grads):
            params, state, grads = squeeze(params), squeeze(state), squeeze(grads)
            updates, state = tx.update(grads, state, params)
            return expand((optax.apply_updates(params, updates), state, updates))

        self.n = n
        self._init = jax.jit(jax.shard_map(init, mesh=mesh, in_specs=spec, out_specs=spec))
        self._step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec))

    def init(self, params: dict):
        return jax.device_get(self._init(replicate(params, self.n)))

    def run(self, params, state, grads: dict, steps: range):
        """Steps ``steps`` from per-rank ``params`` and ``state``; returns the (params, state, updates) after each."""
        history = []
        for t in steps:
            params, state, updates = jax.device_get(self._step(params, state, at(grads, t)))
            history.append((params, state, updates))
        return history


def assert_same_on_all_ranks(tree) -> None:
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        leaf = np.asarray(leaf)
        for r in range(1, leaf.shape[0]):
            assert leaf[r].tobytes() == leaf[0].tobytes(), f"{jax.tree_util.keystr(path)}: rank {r} differs from rank 0"


def assert_close_to_mean(got: dict, grads_t: dict, average: bool = True) -> None:
    """``got`` (one rank's reduced gradients) against the float64 mean (or sum) over ranks: float32 sums of n terms in
    any order (XLA's and MPI's orders are unspecified) differ by at most (n-1) ulps of the sum of magnitudes."""
    for k, g in grads_t.items():
        n = g.shape[0]
        exact = g.astype(np.float64).sum(0) / (n if average else 1)
        bound = n * EPS * np.abs(g.astype(np.float64)).sum(0) / (n if average else 1)
        assert np.all(np.abs(got[k].astype(np.float64) - exact) <= bound), k


# ------------------------------------------------------------------ GradientAllReduce


@pytest.mark.parametrize(
    "n, hierarchical, average",
    [(2, False, True), (4, False, True), (4, False, False), (4, True, True), (4, True, False)],
    ids=["n2", "n4", "n4-sum", "2x2-hier", "2x2-hier-sum"],
)
def test_gradient_allreduce_is_the_mean_bit_identical_on_every_rank(rng, n, hierarchical, average):
    seed = int(rng.integers(2**31))
    grads = make_grads(seed, STEPS, n)
    params = make_params(seed)
    ranks = Ranks(
        n,
        hierarchical,
        lambda c: gradient_allreduce(c, average=average, hierarchical=hierarchical, bucket_bytes=BUCKET_BYTES),
    )
    p = replicate(params, n)
    for t, (_, _, updates) in enumerate(ranks.run(p, ranks.init(params), grads, range(STEPS))):
        assert_same_on_all_ranks(updates)
        assert_close_to_mean(at(updates, 0), at(grads, t), average)


@pytest.mark.parametrize("n, optimizer", [(2, "sgd"), (4, "adam")])
def test_gradient_allreduce_then_optimizer_matches_numpy(rng, n, optimizer):
    seed = int(rng.integers(2**31))
    grads = make_grads(seed, STEPS, n)
    params = make_params(seed)
    lr = 0.05
    opt = optax.sgd(lr) if optimizer == "sgd" else optax.adam(lr)
    ranks = Ranks(n, False, lambda c: GradientAllReduce(bucket_bytes=BUCKET_BYTES).transformation(opt, c))
    history = ranks.run(replicate(params, n), ranks.init(params), grads, range(STEPS))
    mean_grads = [{k: v[t].astype(np.float64).mean(0) for k, v in grads.items()} for t in range(STEPS)]
    if optimizer == "sgd":
        expected, p = [], {k: v.astype(np.float64) for k, v in params.items()}
        for g in mean_grads:
            p = {k: p[k] - lr * g[k] for k in p}
            expected.append(p)
    else:
        expected = np_adam(params, mean_grads, lr)
    for t, ((got, _, _), want) in enumerate(zip(history, expected), start=1):
        assert_same_on_all_ranks(got)
        for k in SHAPES:
            # Per step: float32 rounding of the parameter (an ulp of |p|) and of the update, whose size is at most
            # lr * |g| (SGD) or about lr (Adam), computed to a few ulps; it accumulates over t steps.
            scale = lr * (np.abs(grads[k]).max() if optimizer == "sgd" else 10.0)
            tol = t * 4 * EPS * (np.abs(want[k]).max() + scale)
            np.testing.assert_allclose(got[k][0], want[k], rtol=0, atol=tol, err_msg=f"{k} after step {t}")


# ----------------------------------------------------------------------------- ByteGrad


BYTEGRAD_CASES = [
    # n, hierarchical (2x2 mesh with both levels), error feedback, average
    (2, False, False, True),
    (2, False, True, True),
    (4, False, False, True),
    (4, False, True, False),
    (4, True, False, True),
    (4, True, True, True),
    (4, True, False, False),
]


@pytest.mark.parametrize(
    "n, hierarchical, error_feedback, average",
    BYTEGRAD_CASES,
    ids=["n2", "n2-ef", "n4", "n4-ef-sum", "2x2-hier", "2x2-hier-ef", "2x2-hier-sum"],
)
def test_bytegrad_matches_numpy_pipeline_exactly(rng, n, hierarchical, error_feedback, average):
    seed = int(rng.integers(2**31))
    grads = make_grads(seed, STEPS, n)
    params = make_params(seed)
    # hierarchical=True (the default) on flat communicators falls back to the flat pipeline: the n=2 cases use it.
    ranks = Ranks(
        n,
        hierarchical,
        lambda c: bytegrad(
            c, average=average, hierarchical=True, error_feedback=error_feedback, bucket_bytes=BUCKET_BYTES
        ),
    )
    state = ranks.init(params)
    residuals = [[np.zeros(s.shape[1:], F32) for s in state.residuals] for _ in range(n)] if error_feedback else None
    history = ranks.run(replicate(params, n), state, grads, range(STEPS))
    for t, (_, state, updates) in enumerate(history):
        expected, residuals = np_bytegrad(
            [at(grads, t, r) for r in range(n)], residuals, hierarchical=hierarchical, average=average
        )
        # Compression, all-to-all, decode-reduce in buffer order and allgather are deterministic: exact.
        for r in range(n):
            for k in SHAPES:
                np.testing.assert_array_equal(updates[k][r], expected[r][k], err_msg=f"{k}, rank {r}, step {t}")
        assert_same_on_all_ranks(updates)
        if error_feedback:
            for r in range(n):
                for i, got in enumerate(state.residuals):
                    np.testing.assert_array_equal(got[r], residuals[r][i], err_msg=f"residual {i}, rank {r}, step {t}")
        else:
            assert state == ByteGradState(residuals=())
            # Within the analytic bound of the true mean (or sum).
            per_rank = [np_flatten(at(grads, t, r), n) for r in range(n)]
            for idx in range(len(BUCKETS)):
                buckets = [b[idx] for b in per_rank]
                truth = np.stack(buckets).astype(np.float64).mean(0)
                if hierarchical:
                    slices = node_average_slices(buckets, 2)
                    bound = np.concatenate([bytegrad_error_bound([row[j] for row in slices]) for j in range(2)])
                    bound += 4 * EPS * np.abs(truth).max()  # the float32 intra-node average
                else:
                    bound = bytegrad_error_bound(buckets)
                got = np_flatten({k: updates[k][0] for k in SHAPES}, n)[idx].astype(np.float64)
                scale = 1 if average else n
                assert np.all(np.abs(got - scale * truth) <= scale * bound), f"bucket {idx}, step {t}"


def test_bytegrad_error_feedback_state_restored_from_a_checkpoint_continues_identically(rng):
    seed = int(rng.integers(2**31))
    n, split = 4, 2
    grads = make_grads(seed, STEPS, n)
    params = make_params(seed)
    algo = ByteGrad(hierarchical=True, error_feedback=True, bucket_bytes=BUCKET_BYTES)
    ranks = Ranks(n, True, lambda c: algo.transformation(optax.adam(1e-2), c))
    p0, s0 = replicate(params, n), ranks.init(params)
    straight = ranks.run(p0, s0, grads, range(STEPS))
    first = ranks.run(p0, s0, grads, range(split))
    p, s, _ = first[-1]
    # The checkpoint: plain NumPy arrays (copied, as if written to disk and read back) in the same tree structure.
    leaves, treedef = jax.tree.flatten((p, s))
    saved = [np.array(leaf, copy=True) for leaf in leaves]
    p, s = jax.tree.unflatten(treedef, saved)
    assert any(np.any(r != 0) for r in s[0].residuals), "the residuals should be non-zero by now"
    resumed = first + ranks.run(p, s, grads, range(split, STEPS))
    for t, (a, b) in enumerate(zip(straight, resumed)):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes(), f"step {t}"


# ----------------------------------------------------------------------- bytes on the wire


def traced_bytes(n: int, hierarchical: bool, make_tx, grads: dict) -> Communicators:
    """Trace one step (no compilation) with counting communicators; return them."""
    mesh, axes, comms = layout(n, hierarchical)
    counted = wrap_comms(comms)
    tx = make_tx(counted)

    def step(g):
        g = jax.tree.map(lambda x: x[0], g)
        updates, _ = tx.update(g, tx.init(g))
        return jax.tree.map(lambda x: x[None], updates)

    jax.eval_shape(jax.shard_map(step, mesh=mesh, in_specs=P(axes), out_specs=P(axes)), grads)
    return counted


def total(comms: Communicators) -> float:
    return sum(c.bytes_sent for c in comms if c is not None)


# About 1 MB of float32 gradient in two leaves (262,143 elements: not a multiple of 4, so the bucket is padded).
BIG = {"w": (512, 511), "b": (511,)}
MEASURED_RATIOS: dict[str, float] = {}


@pytest.mark.parametrize("n", [2, 4])
def test_bytegrad_sends_a_quarter_of_gradient_allreduce_bytes(n):
    grads = {k: jax.ShapeDtypeStruct((n,) + s, jnp.float32) for k, s in BIG.items()}
    full = traced_bytes(n, False, lambda c: gradient_allreduce(c), grads)
    small = traced_bytes(n, False, lambda c: bytegrad(c), grads)
    elements = sum(int(np.prod(s)) for s in BIG.values())
    assert full.world.bytes_by_op == {"allreduce": 2 * (n - 1) / n * 4 * elements}
    # ByteGrad: the bucket padded to a multiple of n, compressed in n chunks (one byte per element, a 16-byte header
    # and 16-byte alignment per chunk), all-to-all'd; one chunk compressed and allgathered.
    padded = -(-elements // n) * n
    expected = {
        "alltoall": (n - 1) / n * ref.compressed_size(padded, n, "minmax_uint8"),
        "allgather": (n - 1) * ref.compressed_size(padded // n, 1, "minmax_uint8"),
    }
    assert small.world.bytes_by_op == pytest.approx(expected, rel=1e-12)
    ratio = total(small) / total(full)
    MEASURED_RATIOS[f"flat n={n}"] = ratio
    # A quarter, plus overhead: per chunk at most 16 header + 15 alignment bytes, and at most n - 1 padding elements;
    # relative to the quarter that is (31 n + n - 1) / elements (both legs move each of them once per rank); and a
    # 16-byte header per group of a chunk's MINMAX_GROUP_ELEMENTS elements.
    overhead = (31 * n + n - 1) / elements + 16 / ref.MINMAX_GROUP_ELEMENTS
    assert 0.25 <= ratio <= 0.25 * (1 + overhead), ratio
    print(f"ByteGrad / GradientAllReduce bytes, flat n={n}: {ratio:.6f}")


def test_hierarchical_bytegrad_compresses_only_between_nodes():
    grads = {k: jax.ShapeDtypeStruct((4,) + s, jnp.float32) for k, s in BIG.items()}
    full = traced_bytes(4, True, lambda c: gradient_allreduce(c, hierarchical=True), grads)
    small = traced_bytes(4, True, lambda c: bytegrad(c, hierarchical=True), grads)
    assert full.world.bytes_sent == small.world.bytes_sent == 0
    # Intra-node traffic is full precision in both: the same reduce-scatter and allgather bytes.
    assert small.intra.bytes_by_op == full.intra.bytes_by_op
    assert set(full.intra.bytes_by_op) == {"reduce_scatter", "allgather"}
    inter = small.inter.bytes_sent / full.inter.bytes_sent
    overall = total(small) / total(full)
    MEASURED_RATIOS["2x2 inter-node"] = inter
    MEASURED_RATIOS["2x2 overall"] = overall
    assert 0.25 <= inter <= 0.25 * (1.0004 + 16 / ref.MINMAX_GROUP_ELEMENTS), inter
    # a = b = 2: intra 2 (a-1)/a B = B either way; inter 2 (b-1)/b B/a = B/2 full, about B/8 compressed.
    assert overall == pytest.approx((1 + 1 / 8) / (1 + 1 / 2), rel=1e-3)
    print(f"hierarchical 2x2: inter-node bytes ratio {inter:.6f}, all bytes ratio {overall:.6f}")


def test_counting_communicator_records_the_cost_model_and_delegates():
    n = 4
    mesh = Mesh(np.array(jax.devices()[:n]), ("r",))
    counter = CountingCommunicator(LaxCommunicator("r", size=n))
    inner = LaxCommunicator("r", size=n)

    def body(x, rows, flat):
        x, rows, flat = x[0], rows[0], flat[0]
        counts = jnp.full(n, 2, jnp.int32)
        out = {
            "allreduce": counter.allreduce(x, "avg"),
            "reduce": counter.reduce(x, root=1),
            "broadcast": counter.broadcast(x, root=2),
            "reduce_scatter": counter.reduce_scatter(rows),
            "allgather": counter.allgather(x),
            "gather": counter.gather(x, root=0),
            "scatter": counter.scatter(rows, root=3),
            "alltoall": counter.alltoall(rows),
            "alltoall_v": counter.alltoall_v(flat, counts, counts, 8),
            "send_recv": counter.send_recv(x, jnp.array([0, 1, 2], jnp.int32)),
            "barrier": counter.barrier(x),
            "rank": counter.rank(),
        }
        plain = {"allreduce": inner.allreduce(x, "avg"), "alltoall": inner.alltoall(rows), "rank": inner.rank()}
        return jax.tree.map(lambda y: y[None], (out, plain))

    x = np.arange(n * 6, dtype=F32).reshape(n, 6)  # B = 24 bytes per rank
    rows = np.arange(n * n * 3, dtype=F32).reshape(n, n, 3)  # 48 bytes
    flat = np.arange(n * 8, dtype=F32).reshape(n, 8)  # 32 bytes
    out, plain = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("r"), out_specs=P("r")))(x, rows, flat)
    expected = {
        "allreduce": 2 * 3 / 4 * 24,
        "reduce": 24,
        "broadcast": 24,
        "reduce_scatter": 3 / 4 * 48,
        "allgather": 3 * 24,
        "gather": 3 * 24,
        "scatter": 3 / 4 * 48,
        "alltoall": 3 / 4 * 48,
        "alltoall_v": 32,
        "send_recv": 3 * 24,
        "barrier": 0,
    }
    assert counter.bytes_by_op == pytest.approx(expected)
    assert counter.calls_by_op == {k: 1 for k in expected}
    assert counter.bytes_sent == pytest.approx(sum(expected.values()))
    assert counter.size == n
    for k in plain:
        np.testing.assert_array_equal(out[k], plain[k])
    counter.reset()
    assert counter.bytes_sent == 0 and counter.bytes_by_op == {} and counter.calls_by_op == {}


# ------------------------------------------------------------------- native MPI, 2 processes


def native_worker(seed: int, steps: int, lr: float) -> dict:
    """One MPI rank: GradientAllReduce and ByteGrad (error feedback) with SGD over the native communicator."""
    from bagua_jax.native_communicator import NativeCommunicator

    comm = NativeCommunicator.mpi_world(timeout=60)
    rank, n = int(comm.rank()), comm.size
    comms = Communicators(world=comm)
    grads = make_grads(seed, steps, n)
    out = {"rank": rank}
    algorithms = {
        "allreduce": GradientAllReduce(bucket_bytes=BUCKET_BYTES),
        "bytegrad": ByteGrad(error_feedback=True, bucket_bytes=BUCKET_BYTES),
    }
    for name, algo in algorithms.items():
        tx = algo.transformation(optax.sgd(lr), comms)

        @jax.jit
        def step(params, state, g, tx=tx):
            updates, state = tx.update(g, state, params)
            return optax.apply_updates(params, updates), state, updates

        params = {k: jnp.asarray(v) for k, v in make_params(seed).items()}
        state = tx.init(params)
        history = []
        for t in range(steps):
            params, state, updates = step(params, state, at(grads, t, rank))
            history.append(jax.device_get((params, updates)))
        out[name] = history
        out[name + "_state"] = jax.device_get(state)
    return out


@pytest.mark.skipif(not bagua_jax.build_info()["mpi"], reason="built without the MPI engine")
def test_both_algorithms_on_two_mpi_processes_match_numpy(rng):
    seed, steps, lr, n = int(rng.integers(2**31)), 3, 0.1, 2
    results = run_ranks(
        "test_gradient_allreduce_bytegrad_jax:native_worker",
        n,
        seed,
        steps,
        lr,
        launcher="mpiexec",
        timeout=300,
        env=ONE_CPU_DEVICE,
    )
    values = sorted((r.value for r in results), key=lambda v: v["rank"])
    grads, params = make_grads(seed, steps, n), make_params(seed)
    # GradientAllReduce + SGD: the float64 mean within float32 rounding (as in the shard_map test).
    p = {k: v.astype(np.float64) for k, v in params.items()}
    for t in range(steps):
        p = {k: p[k] - lr * grads[k][t].astype(np.float64).mean(0) for k in p}
        for k in SHAPES:
            tol = (t + 1) * 4 * EPS * (np.abs(p[k]).max() + lr * np.abs(grads[k]).max())
            for v in values:
                np.testing.assert_allclose(v["allreduce"][t][0][k], p[k], rtol=0, atol=tol)
        assert_same_on_all_ranks(jax.tree.map(lambda *xs: np.stack(xs), *(v["allreduce"][t] for v in values)))
    # ByteGrad + SGD: the SGD updates -lr * g (one float32 multiply) equal the pipeline simulation's exactly; the
    # parameters within one rounding per step (XLA may fuse p + (-lr) * g into a fused multiply-add).
    p = {k: v.astype(np.float64) for k, v in params.items()}
    residuals = [[np.zeros(s.shape, F32) for s in values[0]["bytegrad_state"][0].residuals] for _ in range(n)]
    for t in range(steps):
        reduced, residuals = np_bytegrad(
            [at(grads, t, r) for r in range(n)], residuals, hierarchical=False, average=True
        )
        p = {k: p[k] - lr * reduced[0][k] for k in p}
        for v in values:
            for k in SHAPES:
                got_params, got_updates = v["bytegrad"][t]
                np.testing.assert_array_equal(got_updates[k], F32(-lr) * reduced[0][k], err_msg=f"{k}, step {t}")
                tol = (t + 1) * 2 * EPS * (np.abs(p[k]).max() + lr * np.abs(reduced[0][k]).max())
                np.testing.assert_allclose(got_params[k], p[k], rtol=0, atol=tol, err_msg=f"{k}, step {t}")
    for v in values:
        for got, want in zip(v["bytegrad_state"][0].residuals, residuals[v["rank"]]):
            np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------- configuration errors


def test_configuration_errors_are_clear():
    comms = Communicators(world=LaxCommunicator("ranks", size=2))
    with pytest.raises(TypeError, match="comms must be a communicator"):
        gradient_allreduce("ranks")
    with pytest.raises(TypeError, match="comms must be a communicator"):
        ByteGrad().transformation(optax.sgd(0.1), "ranks")
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="bucket_bytes"):
            bytegrad(comms, bucket_bytes=bad)
        with pytest.raises(ValueError, match="bucket_bytes"):
            GradientAllReduce(bucket_bytes=bad).transformation(optax.sgd(0.1), comms)
    with pytest.raises(TypeError, match="average"):
        gradient_allreduce(comms, average="sum")
    with pytest.raises(TypeError, match="error_feedback"):
        bytegrad(comms, error_feedback=1)
    int_params = {"w": jnp.zeros(3, jnp.int32)}
    with pytest.raises(TypeError, match="floating"):
        gradient_allreduce(comms).init(int_params)
    with pytest.raises(TypeError, match="floating"):
        ByteGrad(error_feedback=True).transformation(optax.sgd(0.1), comms).init(int_params)
    with pytest.raises(TypeError, match="gradients must be floating"):
        gradient_allreduce(comms).update({"w": jnp.zeros(3, jnp.int32)}, optax.EmptyState())
    # Error feedback needs the world size at init: a LaxCommunicator without size, outside shard_map, says so.
    with pytest.raises(ValueError, match="size"):
        bytegrad(Communicators(world=LaxCommunicator("ranks")), error_feedback=True).init({"w": jnp.zeros(3)})


def test_mismatched_levels_and_state_are_reported_when_tracing():
    mesh, axes, comms = layout(4, True)
    # world = the intra axis only (2 ranks) while intra x inter covers 4.
    wrong = Communicators(world=LaxCommunicator("intra"), intra=comms.intra, inter=comms.inter)
    params = {"w": np.zeros((4, 8), F32)}

    def body(g):
        g = jax.tree.map(lambda x: x[0], g)
        return jax.tree.map(
            lambda x: x[None], gradient_allreduce(wrong, hierarchical=True).update(g, optax.EmptyState())[0]
        )

    with pytest.raises(ValueError, match=r"intra \(2 ranks\) x inter \(2 ranks\) must equal world \(2 ranks\)"):
        jax.eval_shape(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes)), params)

    tx = bytegrad(comms, error_feedback=True)

    def mismatched(g):
        g = jax.tree.map(lambda x: x[0], g)
        state = tx.init({"w": jnp.zeros(3)})  # initialised for other parameters
        return jax.tree.map(lambda x: x[None], tx.update(g, state)[0])

    with pytest.raises(ValueError, match="residuals of sizes"):
        jax.eval_shape(jax.shard_map(mismatched, mesh=mesh, in_specs=P(axes), out_specs=P(axes)), params)


def test_a_single_communicator_stands_for_the_world():
    tx = gradient_allreduce(LaxCommunicator("ranks", size=2))
    assert tx.init({"w": jnp.zeros(3)}) == optax.EmptyState()

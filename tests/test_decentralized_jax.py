"""Decentralized and LowPrecisionDecentralized against NumPy simulations of all ranks.

The model is linear regression ``y = x @ w + b`` with a hand-written NumPy gradient. Each step
every rank draws a fresh batch, the test computes that rank's gradient in NumPy from the weights
the JAX run holds and feeds it to one jitted per-rank step (``jax.shard_map`` over simulated
devices, or one process per rank with the native MPI communicator). The references below
simulate every rank in one process from the SPEC's definition (section 3), computing their own
gradients from their own weights, with only ``tests/kernels_reference.py`` for the kernels' numerics.
Float32 operations are written in the order the optax composition performs them (the
optimizer's ``-g``, then the transform's ``(avg - x) + u`` or ``x_new - x``, then
``x + update``), so wherever the averaging itself is deterministic the comparison is exact.

The learning rate is folded into the gradient fed to the step and the optimizer is
``optax.sgd(1.0)``: XLA's CPU backend contracts a multiply followed by an add into a fused
multiply-add (one rounding where NumPy rounds twice), and a product by -1 is exact either way.
"""

from __future__ import annotations

import pickle

import jax
import jax.numpy as jnp
import kernels_reference as ref
import numpy as np
import optax
import pytest
from algorithms_reference import low_precision_ring_round, unflatten
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from multiprocess import run_ranks

import bagua_jax
from bagua_jax import ops
from bagua_jax.algorithms.base import Communicators
from bagua_jax.algorithms.decentralized import (
    Decentralized,
    decentralized,
    decentralized_average,
    shift_one_peer,
)
from bagua_jax.algorithms.low_precision_decentralized import (
    LowPrecisionDecentralized,
    low_precision_decentralized,
)
from bagua_jax.lax_communicator import LaxCommunicator

F32 = np.float32
LR = 0.1
FEATURES, OUTPUTS, BATCH = 5, 3, 8
# Leaves in JAX's tree order (dict keys sorted), which is the order buckets are filled in.
LEAVES = {"b": (OUTPUTS,), "w": (FEATURES, OUTPUTS)}
ONE_BUCKET = [["b", "w"]]  # the default 10 MiB bucket holds both leaves
SMALL_BUCKET_BYTES = 16  # every leaf gets a bucket of its own
LEAF_BUCKETS = [["b"], ["w"]]


# ------------------------------------------------------------------ model and data


def initial_params(seed: int) -> dict[str, np.ndarray]:
    """The same starting weights on every rank (low-precision decentralized requires it)."""
    rng = np.random.default_rng([seed, 1_000_000])
    return {k: rng.standard_normal(shape).astype(F32) for k, shape in LEAVES.items()}


def gradient(params: dict[str, np.ndarray], seed: int, step: int, rank: int) -> dict[str, np.ndarray]:
    """``LR`` times rank ``rank``'s gradient of the mean squared error on its fresh batch of step
    ``step`` (see the module docstring for why the learning rate is applied here).

    Computed in float64 with einsum's own loops (no BLAS) and rounded to float32, so the same
    weights give the same bits in every process.
    """
    rng = np.random.default_rng([seed, step, rank])
    x = rng.standard_normal((BATCH, FEATURES))
    y = rng.standard_normal((BATCH, OUTPUTS)) + rank  # ranks see different data
    w, b = params["w"].astype(np.float64), params["b"].astype(np.float64)
    residual = np.einsum("bi,io->bo", x, w, optimize=False) + b - y
    return {
        "b": (LR * residual.mean(axis=0)).astype(F32),
        "w": (LR * np.einsum("bi,bo->io", x, residual, optimize=False) / BATCH).astype(F32),
    }


def sgd_update(grad: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """optax.sgd(1.0)'s update: the negated (already scaled) gradient, exact."""
    return {k: -g for k, g in grad.items()}


# ------------------------------------------------------------------ NumPy references


def spec_peer(rank: int, t: int, n: int) -> int:
    """The SPEC's shift_one pairing, in plain Python integers."""
    half = n // 2
    return (t + rank) % half + half if rank < half else (rank - half - t) % half


def reference_decentralized(
    n: int, steps: int, seed: int, mode: str, interval: int = 1, nodes: int = 1
) -> list[list[dict[str, np.ndarray]]]:
    """Weights of every rank after every step. ``nodes > 1``: ``n / nodes`` ranks per node,
    world rank ``node * per_node + local``, averaged inside the node first."""
    xs = [initial_params(seed) for _ in range(n)]
    per_node = n // nodes
    history = []
    for t in range(steps):
        updates = [sgd_update(gradient(xs[r], seed, t, r)) for r in range(n)]
        if t % interval == 0:
            round_index = t // interval
            avg = [{} for _ in range(n)]
            for k in LEAVES:
                vals = [x[k] for x in xs]
                if nodes > 1:  # intra-node average (2 ranks per node here: a pairwise mean)
                    node_avg = [
                        np.mean(vals[i * per_node : (i + 1) * per_node], axis=0, dtype=F32) for i in range(nodes)
                    ]
                    vals = [node_avg[r // per_node] for r in range(n)]
                    group = [[node * per_node + r % per_node for node in range(nodes)] for r in range(n)]
                else:
                    group = [list(range(n)) for _ in range(n)]
                for r in range(n):
                    members = group[r]
                    if mode == "all":
                        # float64 mean rounded once: equal to the psum's float32 result for 2
                        # members, within an ulp or two of it for 4 (see the tests' tolerance).
                        avg[r][k] = np.mean([vals[m].astype(np.float64) for m in members], axis=0).astype(F32)
                    else:
                        me = members.index(r)
                        peer = members[spec_peer(me, round_index, len(members))]
                        avg[r][k] = ref.average2(vals[r], vals[peer])
        else:
            avg = xs
        xs = [
            {
                k: (xs[r][k] + ((avg[r][k] - xs[r][k]).astype(F32) + updates[r][k]).astype(F32)).astype(F32)
                for k in LEAVES
            }
            for r in range(n)
        ]
        history.append(xs)
    return history


def _flatten(x: dict[str, np.ndarray], buckets: list[list[str]]) -> list[np.ndarray]:
    return [np.concatenate([x[k].ravel() for k in names]).astype(F32) for names in buckets]


def reference_low_precision(
    n: int, steps: int, seed: int, interval: int = 1, buckets: list[list[str]] = ONE_BUCKET, nodes: int = 1
) -> list[list[dict[str, np.ndarray]]]:
    """Weights of every rank after every step, from the SPEC's ring algorithm.

    ``nodes > 1`` (two ranks per node, world rank ``node * 2 + local``): the local step's
    weights are averaged inside each node, each bucket is zero-padded to an even size and split
    in two slices, and local rank ``j`` runs the ring over the nodes on slice ``j`` (one
    quantization chunk per slice) with the ranks of local index ``j``; the node's weights are
    the two slices put back together.
    """
    per_node = n // nodes
    slices = per_node if nodes > 1 else 1
    stride = per_node if nodes > 1 else 1  # ring neighbours are this many world ranks apart
    if nodes > 1:
        assert per_node == 2, "the intra-node mean below is written for two ranks per node"

    def padded(x: dict[str, np.ndarray]) -> list[np.ndarray]:
        return [np.concatenate([b, np.zeros(-b.size % slices, F32)]) for b in _flatten(x, buckets)]

    xs = [initial_params(seed) for _ in range(n)]
    w = [padded(initial_params(seed)) for _ in range(n)]
    left = [padded(initial_params(seed)) for _ in range(n)]
    right = [padded(initial_params(seed)) for _ in range(n)]
    sizes = [b.size for b in _flatten(xs[0], buckets)]
    history = []
    for t in range(steps):
        updates = [sgd_update(gradient(xs[r], seed, t, r)) for r in range(n)]
        local = [{k: (xs[r][k] + updates[r][k]).astype(F32) for k in LEAVES} for r in range(n)]
        if t % interval:
            xs = local
            history.append(xs)
            continue
        flat = [padded(x) for x in local]
        if nodes > 1:  # the mean of two ranks, (a + b) / 2, is the same bits in any order
            flat = [
                [((flat[r - r % 2][i] + flat[r - r % 2 + 1][i]) / F32(2)).astype(F32) for i in range(len(buckets))]
                for r in range(n)
            ]
        new_flat = [[np.empty_like(b) for b in f] for f in flat]
        for i in range(len(buckets)):
            length = flat[0][i].size // slices
            own = [slice((r % slices) * length, (r % slices + 1) * length) for r in range(n)]
            for j in range(slices):  # local rank j of every node: a ring over the nodes on slice j
                ring = list(range(j, n, stride))
                new = low_precision_ring_round(*([c[r][i][own[r]] for r in ring] for c in (flat, w, left, right)))
                for copies, values in zip((w, left, right), new):
                    for r, value in zip(ring, values):
                        copies[r][i][own[r]] = value
            for r in range(n):  # the node's weights: every local rank's slice
                for j in range(slices):
                    owner = r - r % slices + j
                    new_flat[r][i][own[owner]] = w[owner][i][own[owner]]
        averaged = [unflatten([b[:size] for b, size in zip(f, sizes)], buckets, LEAVES) for f in new_flat]
        # The transform returns x_new - x and optax adds it to x.
        xs = [{k: (xs[r][k] + (averaged[r][k] - xs[r][k]).astype(F32)).astype(F32) for k in LEAVES} for r in range(n)]
        history.append(xs)
    return history


# ------------------------------------------------------------------ the JAX side


def flat_setup(n: int) -> tuple[Mesh, tuple[str, ...], Communicators]:
    mesh = Mesh(np.array(jax.devices()[:n]), ("ranks",))
    return mesh, ("ranks",), Communicators(LaxCommunicator("ranks"))


def hierarchical_setup() -> tuple[Mesh, tuple[str, ...], Communicators]:
    """Two nodes of two ranks: world rank = node * 2 + local, as LaxCommunicator ranks a tuple."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("inter", "intra"))
    comms = Communicators(LaxCommunicator(("inter", "intra")), LaxCommunicator("intra"), LaxCommunicator("inter"))
    return mesh, ("inter", "intra"), comms


class Run:
    """One jitted per-rank step over the mesh; arrays carry a leading rank axis."""

    def __init__(self, tx: optax.GradientTransformationExtraArgs, mesh: Mesh, axes: tuple[str, ...]):
        self.n = mesh.devices.size
        self.sharding = NamedSharding(mesh, P(axes))

        def step(params, state, grads):
            params, state, grads = jax.tree.map(lambda a: a[0], (params, state, grads))
            updates, state = tx.update(grads, state, params)
            return jax.tree.map(lambda a: a[None], (optax.apply_updates(params, updates), state))

        self.step = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
        self.tx = tx

    def start(self, seed: int) -> tuple[dict, object]:
        params = initial_params(seed)
        stacked = lambda tree: jax.tree.map(
            lambda a: jax.device_put(np.stack([np.asarray(a)] * self.n), self.sharding), tree
        )
        return stacked(params), stacked(self.tx.init(params))

    def steps(self, params, state, seed: int, first: int, last: int, history: list | None = None):
        for t in range(first, last):
            host = jax.tree.map(np.asarray, params)
            grads = [gradient({k: host[k][r] for k in LEAVES}, seed, t, r) for r in range(self.n)]
            stacked = {k: jax.device_put(np.stack([g[k] for g in grads]), self.sharding) for k in LEAVES}
            params, state = self.step(params, state, stacked)
            if history is not None:
                host = jax.tree.map(np.asarray, params)
                history.append([{k: host[k][r] for k in LEAVES} for r in range(self.n)])
        return params, state


def run_history(alg, n: int, steps: int, seed: int, setup=None) -> tuple[list, Run]:
    mesh, axes, comms = setup() if setup else flat_setup(n)
    run = Run(alg.transformation(optax.sgd(1.0), comms), mesh, axes)
    params, state = run.start(seed)
    history: list = []
    run.steps(params, state, seed, 0, steps, history)
    return history, run


# A last-bit difference in the weights (XLA may fuse the optimizer's update differently from
# NumPy's one rounding per operation) can move a value across an 8-bit rounding boundary,
# which shifts that element by one quantization step, (hi - lo) / 254 of z: about 0.02 here.
ONE_CODE = 0.02


def assert_histories(got: list, expected: list, exact: bool = True, atol: float = 1e-5) -> None:
    for t, (got_t, exp_t) in enumerate(zip(got, expected, strict=True)):
        for r, (g, e) in enumerate(zip(got_t, exp_t, strict=True)):
            for k in LEAVES:
                where = f"step {t}, rank {r}, leaf {k}"
                if exact:
                    np.testing.assert_array_equal(g[k], e[k], err_msg=where)
                else:
                    # psum over 4 ranks adds in an order XLA picks: each average is within ~2
                    # ulps of the float64 mean, and the few steps of this contractive update
                    # (lr 0.1) keep the accumulated difference around 1e-6 for weights of order 1.
                    np.testing.assert_allclose(g[k], e[k], rtol=1e-5, atol=atol, err_msg=where)


# ------------------------------------------------------------------ Decentralized


@pytest.mark.parametrize("n", [2, 4])
def test_all_matches_reference(n, rng):
    seed = int(rng.integers(2**31))
    got, run = run_history(Decentralized("all"), n, 5, seed)
    # Two ranks: the psum is a + b (commutative), so the average is deterministic and exact.
    assert_histories(got, reference_decentralized(n, 5, seed, "all"), exact=n == 2)
    assert run.step._cache_size() == 1


@pytest.mark.parametrize("hierarchical_comms", [False, True])
def test_all_averages_are_bit_identical_across_ranks(rng, hierarchical_comms):
    mesh, axes, comms = hierarchical_setup() if hierarchical_comms else flat_setup(4)
    scale = F32(10.0 ** rng.uniform(-3, 3))
    xs = {k: rng.standard_normal((4, *shape)).astype(F32) * scale for k, shape in LEAVES.items()}

    def average(params):
        one = jax.tree.map(lambda a: a[0], params)
        out = decentralized_average(one, comms, jnp.int32(0), bucket_bytes=SMALL_BUCKET_BYTES)
        return jax.tree.map(lambda a: a[None], out)

    out = jax.jit(jax.shard_map(average, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))(xs)
    for k in LEAVES:
        got = np.asarray(out[k])
        for r in range(1, 4):
            np.testing.assert_array_equal(got[r].view(np.uint32), got[0].view(np.uint32))
        # The mean itself: float32 sums of 4 terms, within a few ulps of the largest magnitude.
        np.testing.assert_allclose(got[0], xs[k].astype(np.float64).mean(0), rtol=1e-6, atol=1e-6 * np.abs(xs[k]).max())


def test_shift_one_peer_follows_the_spec_formula():
    for n in (2, 4, 6, 8):
        ranks = jnp.arange(n, dtype=jnp.int32)
        for t in range(2 * n + 1):
            peers = np.asarray(jax.jit(shift_one_peer, static_argnums=2)(ranks, jnp.int32(t), n))
            assert peers.tolist() == [spec_peer(r, t, n) for r in range(n)]
            # A perfect matching: everyone paired with someone else, who is paired back.
            assert all(peers[peers[r]] == r != peers[r] for r in range(n))
    # The peer changes every round, cycling through the other half of the ranks.
    assert {spec_peer(0, t, 8) for t in range(4)} == {4, 5, 6, 7}


def test_shift_one_peers_are_chosen_at_run_time():
    """Each rank's weights are its one-hot rank vector, so the average names the peer."""
    n = 4
    mesh, axes, comms = flat_setup(n)

    def average(params, round_index):
        out = decentralized_average(params[0], comms, round_index[0], peer_selection_mode="shift_one")
        return out[None]

    f = jax.jit(jax.shard_map(average, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))
    one_hot = jax.device_put(np.eye(n, dtype=F32), NamedSharding(mesh, P(axes)))
    for t in range(6):
        out = np.asarray(f(one_hot, jnp.full(n, t, jnp.int32)))
        for r in range(n):
            expected = np.zeros(n, F32)
            expected[[r, spec_peer(r, t, n)]] = 0.5
            np.testing.assert_array_equal(out[r], expected, err_msg=f"round {t}, rank {r}")
    assert f._cache_size() == 1  # one compiled step served every round


@pytest.mark.parametrize("n", [2, 4])
def test_shift_one_matches_reference(n, rng):
    seed = int(rng.integers(2**31))
    got, run = run_history(Decentralized("shift_one", bucket_bytes=SMALL_BUCKET_BYTES), n, 6, seed)
    # The pair average is the float32 kernel (a + b) / 2, the same bits on both ranks: exact.
    assert_histories(got, reference_decentralized(n, 6, seed, "shift_one"))
    assert run.step._cache_size() == 1


def test_communication_interval_2_communicates_on_even_steps_only(rng):
    seed = int(rng.integers(2**31))
    got, _ = run_history(Decentralized("shift_one", communication_interval=2), 4, 7, seed)
    expected = reference_decentralized(4, 7, seed, "shift_one", interval=2)
    assert_histories(got, expected)
    # The reference communicates on steps 0, 2, 4, 6 as rounds 0, 1, 2, 3 (pairs 0-2, 0-3, 0-2,
    # 0-3 for rank 0); had step 1 communicated too, the weights would already differ there.
    every_step = reference_decentralized(4, 7, seed, "shift_one", interval=1)
    assert not np.array_equal(got[1][0]["w"], every_step[1][0]["w"])


@pytest.mark.parametrize("bucket_bytes", [10 << 20, SMALL_BUCKET_BYTES], ids=["one_bucket", "per_leaf"])
@pytest.mark.parametrize("mode", ["all", "shift_one"])
def test_hierarchical_on_two_nodes_of_two(rng, mode, bucket_bytes):
    seed = int(rng.integers(2**31))
    alg = Decentralized(mode, hierarchical=True, bucket_bytes=bucket_bytes)
    got, _ = run_history(alg, 4, 5, seed, hierarchical_setup)
    # Pairwise means inside the node, then pairwise across the 2 nodes: deterministic, exact
    # (per leaf, the 3 and 15 elements are padded to split between the node's 2 ranks).
    assert_histories(got, reference_decentralized(4, 5, seed, mode, nodes=2))


def one_node_of_four() -> tuple[Mesh, tuple[str, ...], Communicators]:
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("inter", "intra"))
    comms = Communicators(LaxCommunicator(("inter", "intra")), LaxCommunicator("intra"), LaxCommunicator("inter"))
    return mesh, ("inter", "intra"), comms


def test_a_single_node_only_averages_inside_it(rng):
    """One node: no inter-node exchange, even for shift_one (a group of one is not odd)."""
    seed = int(rng.integers(2**31))
    got, _ = run_history(Decentralized("shift_one"), 4, 4, seed, one_node_of_four)
    # The node average is the "all" average over the 4 ranks (4-way psum: tolerance).
    assert_histories(got, reference_decentralized(4, 4, seed, "all"), exact=False)
    got, _ = run_history(LowPrecisionDecentralized(), 4, 4, seed, one_node_of_four)
    # After the local steps the node's weights are averaged and the ring is skipped: every rank
    # holds the mean of the local steps, x + mean(u), as with gradient averaging.
    x = initial_params(seed)
    for t in range(4):
        local = [{k: x[k] + u[k] for k in LEAVES} for u in (sgd_update(gradient(x, seed, t, r)) for r in range(4))]
        x = {k: np.mean([loc[k].astype(np.float64) for loc in local], axis=0).astype(F32) for k in LEAVES}
        assert_histories([got[t]], [[x] * 4], exact=False)


def test_hierarchical_false_ignores_the_node_communicators(rng):
    seed = int(rng.integers(2**31))
    got, _ = run_history(Decentralized("shift_one", hierarchical=False), 4, 4, seed, hierarchical_setup)
    assert_histories(got, reference_decentralized(4, 4, seed, "shift_one"))


def test_shift_one_with_an_odd_rank_count_is_an_error():
    mesh = Mesh(np.array(jax.devices()[:3]), ("ranks",))
    tx = Decentralized("shift_one").transformation(optax.sgd(1.0), Communicators(LaxCommunicator("ranks")))
    run = Run(tx, mesh, ("ranks",))
    params, state = run.start(0)
    with pytest.raises(ValueError, match="even number"):
        run.steps(params, state, 0, 0, 1)
    with pytest.raises(ValueError, match="even"):
        shift_one_peer(jnp.int32(0), jnp.int32(0), 5)


def test_shift_one_averaging_all_when_odd_averages_over_every_rank_of_an_odd_count(rng):
    # A fault-tolerant job's copy (a lost member may leave an odd number of ranks): those rounds are "all"'s, on 3
    # ranks as on 4 shift_one's own pairs; the copy's copies keep the rule.
    seed = int(rng.integers(2**31))
    tolerant = Decentralized("shift_one", communication_interval=2).averaging_all_when_odd()
    assert tolerant.replace(bucket_bytes=SMALL_BUCKET_BYTES).average_all_when_odd
    assert not Decentralized("shift_one").average_all_when_odd
    got, _ = run_history(tolerant, 3, 4, seed)
    assert_histories(got, reference_decentralized(3, 4, seed, "all", interval=2), exact=False)
    got, _ = run_history(tolerant, 4, 4, seed)
    assert_histories(got, reference_decentralized(4, 4, seed, "shift_one", interval=2))


def test_configuration_errors():
    # The shared options' values are checked for both front ends in test_algorithm_configs.py.
    comms = Communicators(LaxCommunicator("ranks"))
    with pytest.raises(ValueError, match="bucket_bytes"):
        decentralized(comms, bucket_bytes=0)
    with pytest.raises(TypeError, match="comms must be a communicator"):
        decentralized("ranks")
    with pytest.raises(TypeError, match="comms must be a communicator"):
        low_precision_decentralized("ranks")
    params = {"w": jnp.ones(3)}
    for tx in (decentralized(comms), low_precision_decentralized(comms)):
        with pytest.raises(TypeError, match="floating-point"):
            tx.init({"steps": jnp.zeros(3, jnp.int32)})
        with pytest.raises(ValueError, match="params"):
            tx.update(params, tx.init(params))
    tx = low_precision_decentralized(comms)
    with pytest.raises(ValueError, match="call init"):
        tx.update({"w": jnp.ones(4)}, tx.init(params), {"w": jnp.ones(4)})
    with pytest.raises(ValueError, match="at least 2"):
        shift_one_peer(jnp.int32(0), jnp.int32(0), 1)


# ------------------------------------------------------------------ LowPrecisionDecentralized


@pytest.mark.parametrize("n", [2, 4])
def test_low_precision_matches_reference(n, rng):
    seed = int(rng.integers(2**31))
    got, run = run_history(LowPrecisionDecentralized(), n, 5, seed)
    # Compression, decoding and the diff kernel are bit-exact to tests/kernels_reference.py on the CPU,
    # and the rest is float32 arithmetic in the same order: exact.
    assert_histories(got, reference_low_precision(n, 5, seed), exact=False, atol=ONE_CODE)
    assert run.step._cache_size() == 1


def test_low_precision_with_one_bucket_per_leaf_and_interval_2(rng):
    seed = int(rng.integers(2**31))
    alg = LowPrecisionDecentralized(communication_interval=2, bucket_bytes=SMALL_BUCKET_BYTES)
    got, _ = run_history(alg, 4, 6, seed)
    assert_histories(
        got, reference_low_precision(4, 6, seed, interval=2, buckets=LEAF_BUCKETS), exact=False, atol=ONE_CODE
    )


def test_low_precision_neighbour_copies_track_the_neighbours_weights(rng):
    seed = int(rng.integers(2**31))
    mesh, axes, comms = flat_setup(4)
    run = Run(
        LowPrecisionDecentralized(bucket_bytes=SMALL_BUCKET_BYTES).transformation(optax.sgd(1.0), comms), mesh, axes
    )
    params, state = run.start(seed)
    _, state = run.steps(params, state, seed, 0, 4)
    lowprec = jax.tree.map(np.asarray, state[1])
    for i in range(len(lowprec.weights)):
        w = lowprec.weights[i]
        np.testing.assert_array_equal(lowprec.left[i], np.roll(w, 1, axis=0))  # rank r-1's w
        np.testing.assert_array_equal(lowprec.right[i], np.roll(w, -1, axis=0))  # rank r+1's w
    assert lowprec.step.tolist() == [4] * 4


@pytest.mark.parametrize("buckets", ["one", "per_leaf"])
def test_low_precision_hierarchical_on_two_nodes_of_two(rng, buckets):
    seed = int(rng.integers(2**31))
    # One bucket of 18 elements splits evenly; per leaf, 3 and 15 are padded to 4 and 16.
    bucket_bytes, layout = (10 << 20, ONE_BUCKET) if buckets == "one" else (SMALL_BUCKET_BYTES, LEAF_BUCKETS)
    got, _ = run_history(LowPrecisionDecentralized(bucket_bytes=bucket_bytes), 4, 5, seed, hierarchical_setup)
    assert_histories(got, reference_low_precision(4, 5, seed, buckets=layout, nodes=2), exact=False, atol=ONE_CODE)


# ------------------------------------------------------------------ bytes on the wire


def traced_bytes(alg, mesh: Mesh, axes: tuple[str, ...], comms: Communicators, elements: int) -> list[float]:
    """Bytes each communicator of ``comms`` records while one step is traced (cost model of
    :class:`~bagua_jax.counting.CountingCommunicator`: ring allreduce ``2(n-1)/n B``,
    ``send_recv`` ``B`` per peer, ...). The off-step branch of the ``cond`` sends nothing."""
    params = {"w": np.zeros(elements, F32)}
    tx = alg.transformation(optax.sgd(1.0), comms)
    run = Run(tx, mesh, axes)
    stacked = jax.tree.map(lambda a: np.stack([np.asarray(a)] * run.n), (params, tx.init(params), params))
    run.step.lower(*stacked)
    return [c.bytes_sent for c in comms if c is not None]


def test_bytes_on_the_wire_per_communication_step():
    from bagua_jax.counting import CountingCommunicator

    m = 4096
    fp32 = 4 * m
    codes = ops.compressed_size(m, 1)  # one MinMaxUInt8 chunk: 16-byte header + m codes
    for n in (2, 4):
        mesh, axes, _ = flat_setup(n)
        allreduce = 2 * (n - 1) / n * fp32  # what a ring allreduce of the fp32 weights sends

        for alg, expected in [
            (Decentralized("all"), allreduce),
            (Decentralized("shift_one"), fp32),  # n / (2(n-1)) of an allreduce
            # Both ring neighbours get the codes; with n == 2 they are one rank, sent to once.
            (LowPrecisionDecentralized(), (2 if n > 2 else 1) * codes),
        ]:
            counting = Communicators(CountingCommunicator(LaxCommunicator("ranks")))
            assert traced_bytes(alg, mesh, axes, counting, m) == [expected], (n, alg)
    # Two nodes of two: an intra-node allreduce (reduce-scatter + allgather of the fp32 weights),
    # and across nodes each rank exchanges only its half: one fp32 bucket per node in all.
    mesh, axes, _ = hierarchical_setup()
    world, intra, inter = (CountingCommunicator(LaxCommunicator(a)) for a in (("inter", "intra"), "intra", "inter"))
    comms = Communicators(world, intra, inter)
    for alg, across in [
        (Decentralized("all"), 2 * (2 - 1) / 2 * fp32 / 2),
        (Decentralized("shift_one"), fp32 / 2),
        (LowPrecisionDecentralized(), ops.compressed_size(m // 2, 1)),
    ]:
        for c in comms:
            c.reset()
        assert traced_bytes(alg, mesh, axes, comms, m) == [0, fp32, across]


# ------------------------------------------------------------------ checkpoint and restore


@pytest.mark.parametrize(
    "alg",
    [
        Decentralized("shift_one", communication_interval=2),
        LowPrecisionDecentralized(communication_interval=2, bucket_bytes=SMALL_BUCKET_BYTES),
    ],
    ids=["decentralized", "low_precision"],
)
def test_checkpoint_restore_continues_the_same_run(alg, rng):
    seed = int(rng.integers(2**31))
    mesh, axes, comms = flat_setup(4)
    run = Run(alg.transformation(optax.sgd(1.0), comms), mesh, axes)
    params, state = run.start(seed)
    uninterrupted, _ = run.steps(params, state, seed, 0, 6)

    params, state = run.steps(params, state, seed, 0, 3)
    saved = pickle.dumps(jax.tree.map(np.asarray, (params, state)))
    # A fresh transform and compiled step, as after a restart.
    restarted = Run(alg.transformation(optax.sgd(1.0), comms), mesh, axes)
    params, state = jax.tree.map(lambda a: jax.device_put(a, restarted.sharding), pickle.loads(saved))
    resumed, _ = restarted.steps(params, state, seed, 3, 6)
    for k in LEAVES:
        np.testing.assert_array_equal(np.asarray(resumed[k]), np.asarray(uninterrupted[k]))


# ------------------------------------------------------------------ 2 processes, native MPI


def _local_step(tx, params, state, grads):
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def native_worker(seed: int, steps: int) -> dict[str, list[dict[str, np.ndarray]]]:
    """One rank under mpiexec: run each algorithm with the native MPI communicator."""
    from bagua_jax.native_communicator import NativeCommunicator

    comm = NativeCommunicator.mpi_world(timeout=60)
    rank = int(comm.rank())
    comms = Communicators(comm)
    algorithms = {
        "all": Decentralized("all"),
        "shift_one_interval_2": Decentralized("shift_one", communication_interval=2),
        "low_precision": LowPrecisionDecentralized(bucket_bytes=SMALL_BUCKET_BYTES),
    }
    out = {}
    for name, alg in algorithms.items():
        tx = alg.transformation(optax.sgd(1.0), comms)
        step = jax.jit(lambda params, state, grads, tx=tx: _local_step(tx, params, state, grads))
        params = {k: jnp.asarray(v) for k, v in initial_params(seed).items()}
        state = tx.init(params)
        history = []
        for t in range(steps):
            grads = gradient(jax.tree.map(np.asarray, params), seed, t, rank)
            params, state = step(params, state, grads)
            history.append(jax.tree.map(np.asarray, params))
        out[name] = history
    return out


@pytest.mark.skipif(not bagua_jax.build_info()["mpi"], reason="built without the MPI engine")
def test_two_processes_with_the_native_mpi_communicator(rng):
    seed = int(rng.integers(2**31))
    steps = 5
    results = run_ranks("test_decentralized_jax:native_worker", 2, seed, steps, launcher="mpiexec", timeout=300)
    expected = {
        "all": reference_decentralized(2, steps, seed, "all"),
        "shift_one_interval_2": reference_decentralized(2, steps, seed, "shift_one", interval=2),
        "low_precision": reference_low_precision(2, steps, seed, buckets=LEAF_BUCKETS),
    }
    for name, reference_history in expected.items():
        got = [[results[r].value[name][t] for r in range(2)] for t in range(steps)]
        # Two ranks: the sum a + b and the pair average are order-independent: exact, but for
        # an 8-bit code a last-bit difference may move (see ONE_CODE).
        if name == "low_precision":
            assert_histories(got, reference_history, exact=False, atol=ONE_CODE)
        else:
            assert_histories(got, reference_history)

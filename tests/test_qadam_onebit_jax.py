"""QAdam and 1-bit Adam (SPEC section 3) against optax.adam and a NumPy simulation of all ranks.

Every rank's gradients are precomputed random arrays, so the reference needs no model:
``Simulation`` replays the SPEC's steps for all n ranks in NumPy float32, one operation
per rounding, with the compression steps from ``tests/kernels_reference.py``. The JAX side runs
the algorithms inside ``jax.jit(jax.shard_map(...))`` on 2 and 4 simulated devices (and a
2x2 mesh for the hierarchical variants), and on 2 MPI processes with the native
communicator.

Exact comparisons run in a child process with ``--xla_cpu_max_isa=SSE4_2``. On a CPU with
FMA, XLA contracts ``a * b + c`` (optax's moment updates) into one fused multiply-add
where its fusion decisions allow, and those differ from one compiled program to another:
``optax.adam`` jitted alone and the same arithmetic inside the algorithm's ``lax.cond``
then differ in the last bit of some elements, and a momentum off by a bit may move an
8-bit code. Without FMA instructions the warm-up is ``optax.adam`` bit for bit, and the
momentum, second moment and compressions match NumPy's one rounding per operation bit for
bit; only the parameters are compared within a few ulps, because XLA's fused code for the
step direction may round differently from NumPy there (see ``arithmetic_tolerance``). One
test checks that with the default flags the difference is only rounding.
"""

from __future__ import annotations

import copy
import functools
import pickle

import jax
import jax.numpy as jnp
import kernels_reference as ref
import numpy as np
import optax
import pytest
from algorithms_reference import unflatten
from frozen_variance_reference import STEP_BOUND, negligible, variance_floors
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from multiprocess import run_ranks

import bagua_jax
from bagua_jax import LaxCommunicator
from bagua_jax.algorithms.base import Communicators
from bagua_jax.algorithms.onebit_adam import OneBitAdam, OneBitAdamState, onebit_adam
from bagua_jax.algorithms.qadam import QAdam, QAdamState, qadam

F32 = np.float32
LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8
WARMUP, STEPS = 3, 7  # three Adam steps, then four with compressed momentum
SHAPES = {"a": (7, 5), "b": (3,), "c": (40,)}
BUCKET_BYTES = 200
# What plan_buckets must make of SHAPES with 200-byte buckets, leaves in tree (sorted-key) order: a (140 bytes)
# and b (12) share a bucket; c (160) would overflow it and opens the next. Each is padded to a multiple of n.
BUCKETS = (("a", "b"), ("c",))
ALGORITHMS = {"qadam": QAdam, "onebit": OneBitAdam}
SCHEDULE = optax.exponential_decay(LR, transition_steps=1, decay_rate=0.5)


# ----------------------------------------------------------------------------- data


def make_data(seed: int, n: int) -> tuple[dict, list[dict]]:
    """Initial parameters (the same on every rank) and STEPS steps of per-rank gradients, ``[n, *shape]`` per leaf."""
    rng = np.random.default_rng([seed, n])
    params = {k: rng.standard_normal(s).astype(F32) for k, s in SHAPES.items()}
    scales = {k: 10.0 ** rng.uniform(-2, 1) for k in SHAPES}
    grads = [
        {k: (rng.standard_normal((n, *s)) * scales[k]).astype(F32) for k, s in SHAPES.items()} for _ in range(STEPS)
    ]
    # Coordinates whose v freezes at zero and whose momentum then moves (bagua_common.algorithms.frozen_variance):
    # a row of "a" (floored at 1% of a's mean v) and all of "b" (its mean is 0: the model's is used). 1-bit Adam
    # holds the momentum of "b", a leaf with no gradient in the whole warm-up, at zero: there it must not move.
    for g in grads[:WARMUP]:
        g["a"][:, 0] = 0.0
        g["b"][:] = 0.0
    return params, grads


def numpy_tree(tree):
    return jax.tree.map(np.asarray, tree)


# ------------------------------------------------------------------------ NumPy reference


def sequential_mean(rows: list[np.ndarray]) -> np.ndarray:
    """Sum in rank order in float32, then divide: how the allreduce averages (checked bit for bit below)."""
    acc = rows[0]
    for row in rows[1:]:
        acc = (acc + row).astype(F32)
    return (acc / F32(len(rows))).astype(F32)


def averaged_gradients(grads: dict, nodes: int) -> dict:
    """The warm-up's full-precision average: flat (nodes=1), or per node first and then over nodes."""
    out = {}
    for k, g in grads.items():
        per_node = g.reshape(nodes, -1, *g.shape[1:])
        out[k] = sequential_mean([sequential_mean(list(node)) for node in per_node])
    return out


def bias_correction(decay: float, t: int) -> np.float32:
    return F32(F32(1) - F32(decay) ** F32(t))


class Simulation:
    """All n ranks of QAdam or 1-bit Adam in NumPy float32 (SPEC section 3), ``nodes`` nodes of ``n / nodes``
    ranks each (rank = node * local_size + local index); ``nodes=1`` is the flat algorithm. ``bagua_formula``:
    after the warm-up the frozen v is bias-corrected by the running count and the step is not bounded."""

    def __init__(self, algorithm: str, n: int, params: dict, nodes: int = 1, bagua_formula: bool = False):
        self.sign = algorithm == "onebit"
        self.bagua_formula = bagua_formula
        self.n, self.nodes, self.local = n, nodes, n // nodes
        self.p = {k: v.copy() for k, v in params.items()}
        self.m = {k: np.zeros_like(v) for k, v in params.items()}
        self.v = {k: np.zeros_like(v) for k, v in params.items()}
        self.t = 0
        self.sizes = [-(-sum(int(np.prod(SHAPES[k])) for k in keys) // n) * n for keys in BUCKETS]
        # 1-bit residuals, per rank and bucket: the worker's covers what the rank sends between nodes (the bucket,
        # or its node slice), the server's the chunk it reduces.
        self.workers = [[np.zeros(s // self.local if nodes > 1 else s, F32) for s in self.sizes] for _ in range(n)]
        self.servers = [[np.zeros(s // n, F32) for s in self.sizes] for _ in range(n)]

    def flatten(self, tree: dict) -> list[np.ndarray]:
        out = []
        for keys, size in zip(BUCKETS, self.sizes):
            flat = np.concatenate([tree[k].reshape(-1) for k in keys])
            out.append(np.concatenate([flat, np.zeros(size - flat.size, F32)]))
        return out

    def compressed_average(self, inputs: list[np.ndarray], ranks: list[int], bucket: int) -> np.ndarray:
        """One bucket through the ByteGrad / 1-bit pipeline among ``ranks`` (member j reduces chunk j)."""
        k = len(inputs)
        m = inputs[0].size // k
        fmt = "sign" if self.sign else "minmax_uint8"
        packed = []
        for x, r in zip(inputs, ranks):
            if self.sign:
                c, self.workers[r][bucket] = ref.sign_compress(x, k, self.workers[r][bucket])
            else:
                c, _ = ref.minmax_compress(x, k)
            packed.append(c)
        slot = ref.compressed_size(m, 1, fmt)
        out = []
        for j, r in enumerate(ranks):  # the all-to-all hands member j chunk j of every member
            mine = ref.decompress_reduce(
                np.concatenate([c[j * slot : (j + 1) * slot] for c in packed]), m, k, fmt, True
            )
            if self.sign:
                c, self.servers[r][bucket] = ref.sign_compress(mine, 1, self.servers[r][bucket])
                out.append(ref.sign_decompress(c, m, 1))
            else:
                out.append(ref.minmax_decompress(ref.minmax_compress(mine, 1)[0], m, 1))
        return np.concatenate(out)

    def average_bucket(self, rows: list[np.ndarray], bucket: int) -> np.ndarray:
        if self.nodes == 1:
            return self.compressed_average(rows, list(range(self.n)), bucket)
        L = self.local
        # Intra-node reduce-scatter in full precision: rank (a, l) keeps slice l of its node's average ...
        mine = [
            [sequential_mean([np.split(rows[a * L + q], L)[l] for q in range(L)]) for l in range(L)]
            for a in range(self.nodes)
        ]
        # ... the slices with the same l are exchanged compressed between nodes, then allgathered in the node.
        return np.concatenate(
            [
                self.compressed_average(
                    [mine[a][l] for a in range(self.nodes)], [a * L + l for a in range(self.nodes)], bucket
                )
                for l in range(L)
            ]
        )

    def step(self, grads: dict) -> None:
        if self.t < WARMUP:  # plain Adam on the averaged gradients, with optax's arithmetic
            g = averaged_gradients(grads, self.nodes)
            self.m = {k: F32(1 - B1) * g[k] + F32(B1) * self.m[k] for k in g}
            self.v = {k: F32(1 - B2) * (g[k] * g[k]) + F32(B2) * self.v[k] for k in g}
        else:  # frozen v; each rank's momentum is averaged through compression
            # 1-bit Adam holds the momentum of a leaf whose v froze negligible (zero throughout included) at zero
            # (sign codes cannot send a zero).
            held = {k: self.sign and h for k, h in negligible(self.v).items()}
            local = [
                self.flatten(
                    {k: np.where(held[k], F32(0), F32(1 - B1) * grads[k][r] + F32(B1) * self.m[k]) for k in grads}
                )
                for r in range(self.n)
            ]
            averaged = unflatten(
                [self.average_bucket([x[i] for x in local], i) for i in range(len(BUCKETS))], BUCKETS, SHAPES
            )
            self.m = {k: np.where(held[k], F32(0), averaged[k]) for k in averaged}
        self.t += 1
        # optax divides by the scalar bias corrections; XLA's algebraic simplifier turns a division by a broadcast
        # scalar into a multiplication by its float32 reciprocal, so that is the arithmetic to replay.
        # v stops at the warm-up's last step, and so does its bias correction (bagua_common.algorithms.frozen_variance),
        # except in Bagua's formula.
        variance_count = self.t if self.bagua_formula else min(self.t, WARMUP)
        inv1, inv2 = F32(1) / bias_correction(B1, self.t), F32(1) / bias_correction(B2, variance_count)
        # After the warm-up the frozen v is floored (bagua_common.algorithms.frozen_variance); the warm-up never floors.
        floors = variance_floors(self.v) if self.t > WARMUP else {k: F32(0) for k in self.v}
        for k in self.p:
            v = np.maximum(self.v[k], floors[k])
            direction = (self.m[k] * inv1) / (np.sqrt(v * inv2) + F32(EPS))
            if self.t > WARMUP and not self.bagua_formula:  # the bound (bagua_common.algorithms.frozen_variance)
                direction = np.clip(direction, -STEP_BOUND, STEP_BOUND)
            self.p[k] = self.p[k] + F32(-LR) * direction


def simulate(algorithm: str, n: int, seed: int, nodes: int = 1, bagua_formula: bool = False) -> list[Simulation]:
    """Snapshots of the simulation after every step (index t: after t steps)."""
    params, grads = make_data(seed, n)
    sim = Simulation(algorithm, n, params, nodes, bagua_formula)
    history = [copy.deepcopy(sim)]
    for g in grads:
        sim.step(g)
        history.append(copy.deepcopy(sim))
    return history


# ----------------------------------------------------------------------------- JAX runs


def communicators(n: int, two_level: bool) -> tuple[Mesh, Communicators, object]:
    if two_level:  # 2 nodes x 2 ranks; the leading rank axis runs node-major over both mesh axes
        mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("inter", "intra"))
        axes = ("inter", "intra")
        comms = Communicators(LaxCommunicator(axes, 4), LaxCommunicator("intra", 2), LaxCommunicator("inter", 2))
        return mesh, comms, axes
    return Mesh(np.array(jax.devices()[:n]), ("ranks",)), Communicators(LaxCommunicator("ranks", n)), "ranks"


def stepper(
    algorithm: str,
    n: int,
    two_level: bool = False,
    hierarchical: bool = True,
    schedule: bool = False,
    bare: bool = False,
    bagua_formula: bool = False,
):
    """``(tx, step)``: the algorithm's transform and one jitted shard_map step over all ranks (``bare``: built on
    the world communicator alone, as the README shows, instead of :class:`Communicators`; ``bagua_formula``:
    ``step_bound=None``). Compiled once per process and variant, however the flags are spelled."""
    return _stepper(algorithm, n, two_level, hierarchical, schedule, bare, bagua_formula)


@functools.cache
def _stepper(
    algorithm: str, n: int, two_level: bool, hierarchical: bool, schedule: bool, bare: bool, bagua_formula: bool
):
    mesh, comms, axes = communicators(n, two_level)
    options = {"step_bound": None} if bagua_formula else {}
    tx = ALGORITHMS[algorithm](
        SCHEDULE if schedule else LR,
        warmup_steps=WARMUP,
        hierarchical=hierarchical,
        bucket_bytes=BUCKET_BYTES,
        **options,
    ).transformation(None, comms.world if bare else comms)

    def step(params, state, grads):
        mine = jax.tree.map(lambda x: x[0], (params, state, grads))  # this rank's slice of the leading axis
        params, state, grads = mine
        updates, state = tx.update(grads, state, params)
        return jax.tree.map(lambda x: x[None], (optax.apply_updates(params, updates), state))

    return tx, jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))


def replicate(tree, n: int):
    return jax.tree.map(lambda x: jnp.broadcast_to(jnp.asarray(x), (n, *np.shape(x))), tree)


@functools.cache
def run(algorithm: str, n: int, seed: int, **variant: bool) -> list:
    """``[(params, state)]`` as NumPy trees with a leading rank axis, after 0, 1, ..., STEPS steps (``variant``:
    :func:`stepper`'s flags)."""
    tx, step = stepper(algorithm, n, **variant)
    params, grads = make_data(seed, n)
    carry = (replicate(params, n), replicate(tx.init(params), n))
    history = [numpy_tree(carry)]
    for g in grads:
        carry = step(*carry, g)
        history.append(numpy_tree(carry))
    return history


def adam_history(seed: int, n: int, two_level: bool, schedule: bool = False) -> list:
    """``optax.adam`` jitted on its own, fed the NumPy averages of the gradients: ``[(params, state)]`` per step."""
    params, grads = make_data(seed, n)
    adam = optax.adam(SCHEDULE if schedule else LR, b1=B1, b2=B2, eps=EPS)
    update = jax.jit(adam.update)
    carry = (jax.tree.map(jnp.asarray, params), adam.init(params))
    history = []
    for g in grads[:WARMUP]:
        updates, state = update(averaged_gradients(g, nodes=2 if two_level else 1), carry[1], carry[0])
        carry = (optax.apply_updates(carry[0], updates), state)
        history.append(numpy_tree(carry))
    return history


def restored_run(algorithm: str, n: int, seed: int) -> tuple:
    """Stop before the end of the warm-up, checkpoint to NumPy and pickle, restore, run to the end."""
    tx, step = stepper(algorithm, n)
    params, grads = make_data(seed, n)
    stop = WARMUP - 1
    carry = (replicate(params, n), replicate(tx.init(params), n))
    for g in grads[:stop]:
        carry = step(*carry, g)
    saved = pickle.dumps(numpy_tree(carry))  # what a checkpoint holds: plain NumPy arrays in the state's pytree
    carry = jax.tree.map(jnp.asarray, pickle.loads(saved))
    for g in grads[stop:]:
        carry = step(*carry, g)
    return numpy_tree(carry)


LAYOUTS = [(2, False), (4, False), (4, True)]  # (ranks, two-level 2x2 mesh)
LAYOUT_IDS = ["2", "4", "2x2"]
EXACT_XLA_FLAGS = "--xla_force_host_platform_device_count=4 --xla_cpu_max_isa=SSE4_2"


def exact_worker(seed: int, layouts: list[tuple[int, bool]]) -> dict:
    """Every JAX run the exact tests inspect, for ``layouts``, in one process started with EXACT_XLA_FLAGS (module
    docstring)."""
    return {
        "runs": {(a, n, two): run(a, n, seed, two_level=two) for a in ALGORITHMS for n, two in layouts},
        "flat": run("qadam", 2, seed, hierarchical=False),
        "bagua_formula": run("qadam", 2, seed, bagua_formula=True),
        "adam": {(n, two): adam_history(seed, n, two) for n, two in layouts},
        "restored": {a: restored_run(a, 2, seed) for a in ALGORITHMS},
        "bare": {a: run(a, 2, seed, bare=True) for a in ALGORITHMS},
        "schedule": run("qadam", 2, seed, schedule=True),
        "adam_schedule": adam_history(seed, 2, False, True),
    }


def selected_layouts(request: pytest.FixtureRequest) -> list[tuple[int, bool]]:
    """The layouts this module's selected tests read: the 2-rank one (the tests without a layout parameter read
    it) and those of the parametrized tests (the quick suite leaves the flat 4-rank one to the extended run)."""
    layouts = {(2, False)}
    for item in request.session.items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if item.module is request.module and "n" in params:
            layouts.add((params["n"], params.get("two_level", False)))
    return sorted(layouts)


@pytest.fixture(scope="module")
def exact(request, seed) -> dict:
    env = {"XLA_FLAGS": EXACT_XLA_FLAGS}
    [result] = run_ranks("test_qadam_onebit_jax:exact_worker", 1, seed, selected_layouts(request), env=env, timeout=300)
    return result.value


def assert_same_on_every_rank(tree) -> None:
    for leaf in jax.tree.leaves(tree):
        for r in range(1, leaf.shape[0]):
            assert leaf[r].tobytes() == leaf[0].tobytes()


def assert_bitwise(actual, expected) -> None:
    jax.tree.map(
        lambda a, e: np.testing.assert_array_equal(np.asarray(a), np.asarray(e), strict=True), actual, expected
    )


# ---------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("n,two_level", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_warmup_is_optax_adam_on_averaged_gradients_bit_for_bit(exact, algorithm, n, two_level):
    history = exact["runs"][algorithm, n, two_level]
    for t, (expected_params, expected_state) in enumerate(exact["adam"][n, two_level], start=1):
        got_params, got_state = history[t]
        assert_same_on_every_rank((got_params, got_state.adam))
        assert_bitwise(jax.tree.map(lambda x: x[0], got_params), expected_params)
        assert_bitwise(jax.tree.map(lambda x: x[0], got_state.adam), expected_state[0])


def arithmetic_tolerance(sim: list, t: int, key: str) -> np.ndarray:
    """How far the parameters may be from the simulation after t steps from the Adam arithmetic alone, per element.

    The momentum and second moment (multiply-adds) come out bit for bit, but the code XLA generates for the step
    direction (the bias corrections, taken as reciprocals, the square root, the division, the scaling by -lr) may
    round a fused expression differently from NumPy's one rounding per operation, by a few ulps of the update
    (observed: 2). The parameters feed nothing back (the gradients are given), so those errors add up: allow 8
    ulps of each step's update plus one ulp of the parameter per step."""
    return sum(
        8.0 * np.spacing(np.abs(sim[s + 1].p[key] - sim[s].p[key])) + np.spacing(np.abs(sim[s + 1].p[key]))
        for s in range(t)
    )


def onebit_tolerance(sim: list, t: int, key: str) -> np.ndarray:
    """:func:`arithmetic_tolerance` plus what 1-bit Adam's sign scales may add after t steps, per element.

    Each scale is mean|x| of a chunk: the kernel sums |x| in float32 partial sums, the reference in float64, so a
    scale's last bits may differ (rtol 2e-6 in the kernel tests). A scale error feeds linearly into the averaged
    momentum (two compressions per step) and through the residuals into later steps, and v is frozen, so each
    update is off by at most ~2 * steps * 2e-6 of itself; 1e-4 of the summed update magnitudes leaves a margin."""
    moved = sum(np.abs(sim[s + 1].p[key] - sim[s].p[key]) for s in range(WARMUP, t))
    return arithmetic_tolerance(sim, t, key) + 1e-4 * moved


def assert_params_close(params: dict, sim: list, t: int, tolerance) -> None:
    for k in SHAPES:
        err = np.abs(params[k].astype(np.float64) - sim[t].p[k])
        assert np.all(err <= tolerance(sim, t, k)), (k, t, float(err.max()))


def replayed_steps(exact: dict, seed: int, name: str, n: int, two_level: bool, state_type: type):
    """``(t, params, state, sim)`` for each recorded step of ``name``'s run, with its NumPy simulation ``sim``;
    checks first that the state is a ``state_type`` and that every rank holds the same parameters and moments."""
    history = exact["runs"][name, n, two_level]
    sim = simulate(name, n, seed, nodes=2 if two_level else 1)
    for t in range(1, STEPS + 1):
        params, state = history[t]
        assert isinstance(state, state_type)
        assert_same_on_every_rank((params, state.adam))
        yield t, params, state, sim


@pytest.mark.parametrize("n,two_level", LAYOUTS, ids=LAYOUT_IDS)
def test_qadam_matches_the_numpy_simulation(exact, seed, n, two_level):
    history = exact["runs"]["qadam", n, two_level]
    for t, params, state, sim in replayed_steps(exact, seed, "qadam", n, two_level, QAdamState):
        # The min-max codes involve no order-dependent sum, so every compression is the reference's bit for bit,
        # and so are the moment updates around them: the momentum and v are exact.
        assert_bitwise(jax.tree.map(lambda x: x[0], state.adam.mu), sim[t].m)
        assert_bitwise(jax.tree.map(lambda x: x[0], state.adam.nu), sim[t].v)
        assert int(state.adam.count[0]) == t
        assert_params_close(jax.tree.map(lambda x: x[0], params), sim, t, arithmetic_tolerance)
    # After the warm-up the second moment no longer moves.
    assert_bitwise(history[STEPS][1].adam.nu, history[WARMUP][1].adam.nu)


def test_bagua_formula_corrects_the_frozen_v_by_the_running_count_unbounded(exact, seed):
    """``step_bound=None``: after the warm-up the frozen v's bias correction follows the running count and no step is
    bounded, as Bagua's QAdam computes it; the default's numbers differ from it."""
    history = exact["bagua_formula"]
    sim = simulate("qadam", 2, seed, bagua_formula=True)
    for t in range(1, STEPS + 1):
        assert_params_close(jax.tree.map(lambda x: x[0], history[t][0]), sim, t, arithmetic_tolerance)
    ours = jax.tree.map(lambda x: x[0], exact["runs"]["qadam", 2, False][STEPS][0])
    assert any(not np.allclose(ours[k], sim[STEPS].p[k], rtol=1e-3, atol=0) for k in SHAPES)


@pytest.mark.parametrize("n,two_level", LAYOUTS, ids=LAYOUT_IDS)
def test_onebit_adam_matches_the_numpy_simulation(exact, seed, n, two_level):
    history = exact["runs"]["onebit", n, two_level]
    for t, params, state, sim in replayed_steps(exact, seed, "onebit", n, two_level, OneBitAdamState):
        assert_params_close(jax.tree.map(lambda x: x[0], params), sim, t, onebit_tolerance)
        if t <= WARMUP:  # no sign scale involved yet: the moments are exact, the residuals untouched zeros
            assert_bitwise(jax.tree.map(lambda x: x[0], state.adam.mu), sim[t].m)
            assert all(not r.any() for r in state.worker_residuals + state.server_residuals)
            continue
        for k in SHAPES:
            # The momentum is the decoded allgather: exact up to the scales' relative error.
            np.testing.assert_allclose(state.adam.mu[k][0], sim[t].m[k], rtol=1e-4, atol=0)
        for i, keys in enumerate(BUCKETS):
            # A residual is the difference of an input and its code, values of the momentum's magnitude: compare
            # it against that magnitude (it may be exactly 0 in one and an ulp of the scale in the other).
            magnitude = max(float(np.abs(sim[t].m[k]).max()) for k in keys)
            for r in range(n):
                for got, want in (
                    (state.worker_residuals[i][r], sim[t].workers[r][i]),
                    (state.server_residuals[i][r], sim[t].servers[r][i]),
                ):
                    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * (float(np.abs(want).max()) + magnitude))
    assert_bitwise(history[STEPS][1].adam.nu, history[WARMUP][1].adam.nu)


def local_momenta(before, grads: dict, n: int) -> list[list[np.ndarray]]:
    """Each rank's momentum before the exchange of a compressed step, as buckets (from the JAX state before it;
    1-bit Adam's held coordinates are zero)."""
    mu = jax.tree.map(lambda x: x[0], before.adam.mu)
    keep = {k: np.ones(s, bool) for k, s in SHAPES.items()}
    if isinstance(before, OneBitAdamState):
        keep = {k: np.full(SHAPES[k], np.asarray(before.adam.nu[k][0]).any()) for k in SHAPES}
    return [
        buckets_of({k: np.where(keep[k], F32(1 - B1) * grads[k][r] + F32(B1) * mu[k], F32(0)) for k in SHAPES}, n)
        for r in range(n)
    ]


def buckets_of(tree: dict, n: int) -> list[np.ndarray]:
    return Simulation("qadam", n, {k: np.zeros(s, F32) for k, s in SHAPES.items()}).flatten(tree)


def averaged_momentum(after, n: int) -> list[np.ndarray]:
    """The exchanged momentum (the state after a compressed step) as buckets; padding, which the algorithm drops
    after decoding, and 1-bit Adam's held coordinates (see :func:`held`), which it zeroes, are NaN so that
    comparisons skip them."""
    used = [sum(int(np.prod(SHAPES[k])) for k in keys) for keys in BUCKETS]
    buckets = buckets_of(jax.tree.map(lambda x: x[0], after.adam.mu), n)
    dropped = held(after, n) if isinstance(after, OneBitAdamState) else [np.zeros(b.size, bool) for b in buckets]
    return [np.where((np.arange(b.size) < u) & ~d, b, np.nan) for b, u, d in zip(buckets, used, dropped)]


def held(state, n: int) -> list[np.ndarray]:
    """Per bucket, where 1-bit Adam holds the momentum at zero: the leaves whose frozen v is negligible."""
    nu = negligible({k: np.asarray(x[0]) for k, x in state.adam.nu.items()})
    return [b > 0 for b in buckets_of({k: np.full(SHAPES[k], nu[k], F32) for k in SHAPES}, n)]


def sign_decoded(y: np.ndarray, residual: np.ndarray, k: int) -> np.ndarray:
    """Check ``y == decoded + residual`` up to one rounding with ``decoded`` a valid 1-bit code (``+-s`` per
    chunk, ``s`` ~ mean|chunk|, sign of y), and return the decoded values (float64)."""
    decoded = y.astype(np.float64) - residual  # exact in float64
    for b, e in ref.chunk_bounds(y.size, k):
        scale = float(np.median(np.abs(decoded[b:e])))
        code = np.where(y[b:e] >= 0, scale, -scale)
        # The kernel rounded y - code once into the residual: half an ulp of it, twice for the median's own.
        assert np.all(np.abs(decoded[b:e] - code) <= np.spacing(np.abs(residual[b:e])) + np.spacing(F32(scale)))
        np.testing.assert_allclose(scale, ref.sign_scale(y[b:e]), rtol=2e-6)
        decoded[b:e] = code
    return decoded


@pytest.mark.parametrize("n", [2, 4])
def test_onebit_error_feedback_identity_on_both_sides(exact, seed, n):
    history = exact["runs"]["onebit", n, False]
    _, grads = make_data(seed, n)
    for t in range(WARMUP, STEPS):
        before, after = history[t][1], history[t + 1][1]
        local = local_momenta(before, grads[t], n)
        averaged = averaged_momentum(after, n)
        for i in range(len(BUCKETS)):
            # Worker side, before the all-to-all: momentum + residual == code + new residual.
            decoded = []
            for r in range(n):
                y = (local[r][i] + before.worker_residuals[i][r]).astype(F32)
                decoded.append(sign_decoded(y, after.worker_residuals[i][r], n))
            m = averaged[i].size // n
            for j in range(n):  # server side on rank j, before the allgather
                mine = np.mean([d[j * m : (j + 1) * m] for d in decoded], axis=0)
                z = mine + before.server_residuals[i][j]
                result = averaged[i][j * m : (j + 1) * m]
                used = ~np.isnan(result)
                result, z, residual = result[used], z[used], after.server_residuals[i][j][used]
                # The allgathered result is this chunk's 1-bit code: one magnitude, the signs of z.
                assert np.all(np.abs(result) == np.abs(result[0]))
                clear = np.abs(z) > 1e-5 * np.abs(result[0])  # signs of z within rounding of 0 are not determined
                assert np.array_equal((result >= 0)[clear], (z >= 0)[clear])
                # code + new residual == input, up to the roundings of the float32 reduction and the residual.
                slack = 8 * np.spacing(F32(np.abs(z).max() + np.abs(result[0])))
                np.testing.assert_allclose(result + residual.astype(np.float64), z, rtol=0, atol=slack)


@pytest.mark.parametrize("n", [2, 4])
def test_bytegrad_error_of_the_averaged_momentum_is_bounded(exact, seed, n):
    history = exact["runs"]["qadam", n, False]
    _, grads = make_data(seed, n)
    errors = []
    for t in range(WARMUP, STEPS):
        local = local_momenta(history[t][1], grads[t], n)
        averaged = averaged_momentum(history[t + 1][1], n)
        for i in range(len(BUCKETS)):
            exact = np.mean([x[i].astype(np.float64) for x in local], axis=0)
            for b, e in ref.chunk_bounds(exact.size, n):
                # Each rank's 8-bit code errs by at most span/508 of its chunk; their average by the mean of those.
                first = np.mean([np.ptp(x[i][b:e]) for x in local]) / 508
                # The reduced chunk (within `first` of the exact average) is coded once more.
                second = (np.ptp(exact[b:e]) + 2 * first) / 508
                rounding = 16 * np.finfo(F32).eps * max(np.abs(x[i][b:e]).max() for x in local)
                err = np.abs(averaged[i][b:e] - exact[b:e])
                assert np.all((err <= first + second + rounding) | np.isnan(err))
                errors.append(np.nanmax(err, initial=0) / (first + second))
    assert max(errors) > 0.1  # the bound is not vacuous: the compression does err


@pytest.mark.parametrize("n", [2, 4])
def test_onebit_error_is_carried_not_lost(exact, seed, n):
    """Summed over the compressed steps, the averaged momentum differs from the exact average of the local momenta
    by exactly the current residuals (they start at zero): out_t = avg_r(x_r + w_r - w_r') + s - s', telescoped."""
    history = exact["runs"]["onebit", n, False]
    _, grads = make_data(seed, n)
    drift = [0.0] * len(BUCKETS)
    magnitude = [0.0] * len(BUCKETS)
    for t in range(WARMUP, STEPS):
        local = local_momenta(history[t][1], grads[t], n)
        averaged = averaged_momentum(history[t + 1][1], n)
        for i in range(len(BUCKETS)):
            drift[i] = drift[i] + averaged[i] - np.mean([x[i].astype(np.float64) for x in local], axis=0)
            magnitude[i] = max(magnitude[i], *(float(np.abs(x[i]).max()) for x in local))
    final = history[STEPS][1]
    for i, d in enumerate(drift):
        workers = np.mean([final.worker_residuals[i][r].astype(np.float64) for r in range(n)], axis=0)
        servers = np.concatenate([final.server_residuals[i][r] for r in range(n)])
        used = ~np.isnan(d)
        # Each step rounds a handful of float32 values of the magnitude of the momenta and the residuals.
        scale = magnitude[i] + float(np.abs(workers).max() + np.abs(servers).max())
        slack = 32 * np.finfo(F32).eps * (STEPS - WARMUP) * scale
        np.testing.assert_allclose(d[used], -(workers + servers)[used], rtol=0, atol=slack)


def test_a_learning_rate_schedule_is_optax_adams_in_the_warmup_and_applies_after_it(exact):
    history = exact["schedule"]
    for t, (expected_params, expected_state) in enumerate(exact["adam_schedule"], start=1):
        assert_bitwise(jax.tree.map(lambda x: x[0], history[t][0]), expected_params)
        assert_bitwise(jax.tree.map(lambda x: x[0], history[t][1].schedule), expected_state[1])
    assert [int(state.schedule.count[0]) for _, state in history] == list(range(STEPS + 1))
    # The gradients do not depend on the parameters, so both runs take the same directions: step t of this one is
    # the constant-rate step scaled by the schedule at t - 1, up to the roundings of the parameters.
    constant = exact["runs"]["qadam", 2, False]
    for t in range(1, STEPS + 1):
        for k in SHAPES:
            moved = history[t][0][k][0].astype(np.float64) - history[t - 1][0][k][0]
            expected = (constant[t][0][k][0].astype(np.float64) - constant[t - 1][0][k][0]) * 0.5 ** (t - 1)
            slack = 4 * np.spacing(np.abs(history[t][0][k][0])) + 4 * np.spacing(np.abs(constant[t][0][k][0]))
            np.testing.assert_allclose(moved, expected, rtol=1e-5, atol=float(slack.max()))


def test_hierarchical_falls_back_to_the_flat_exchange_without_two_levels(exact):
    assert_bitwise(exact["flat"], exact["runs"]["qadam", 2, False])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_checkpoint_restore_across_the_warmup_boundary(exact, algorithm):
    assert_bitwise(exact["restored"][algorithm], exact["runs"][algorithm, 2, False][STEPS])


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_with_default_compiler_flags_fused_multiply_adds_only_round_differently(seed, algorithm):
    """In this process (FMA allowed) the ranks still agree bit for bit throughout, and the warm-up stays within a
    rounding per multiply-add of the simulation. (After the warm-up a last-bit change may move an 8-bit code or a
    sign, so the comparisons above, without FMA, are the ones that pin the algorithm down.)"""
    n = 2
    history = run(algorithm, n, seed)
    sim = simulate(algorithm, n, seed)
    for t in range(1, STEPS + 1):
        assert_same_on_every_rank((history[t][0], history[t][1].adam))
    for t in range(1, WARMUP + 1):
        for k in SHAPES:
            # A moment off by an ulp moves the update by ~1e-7 of itself; allow 1e-5 of the summed updates.
            moved = sum(np.abs(sim[s + 1].p[k] - sim[s].p[k]) for s in range(t))
            err = np.abs(history[t][0][k][0].astype(np.float64) - sim[t].p[k])
            assert np.all(err <= arithmetic_tolerance(sim, t, k) + 1e-5 * moved), (k, t)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_bare_communicator_stands_for_the_world_past_the_warmup(exact, algorithm):
    """``.transformation(None, comm)`` with one communicator (the README's form) crashed on reading ``comms.world``
    once the compressed exchange began; it must run every step exactly as ``Communicators(world=comm)`` does."""
    assert_bitwise(exact["bare"][algorithm], exact["runs"][algorithm, 2, False])


def test_an_optimizer_is_refused(seed):
    comms = Communicators(LaxCommunicator("ranks", 2))
    for algorithm in (QAdam(1e-3), OneBitAdam(1e-3)):
        with pytest.raises(ValueError, match="optimizer itself.*learning rate, betas"):
            algorithm.transformation(optax.adam(1e-3), comms)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"warmup_steps": 0}, ValueError, "warmup_steps must be an int >= 1"),
        ({"warmup_steps": 2.5}, ValueError, "warmup_steps"),
        ({"b1": 1.0}, ValueError, r"b1 \(betas\[0\]\) must be a float in \[0, 1\)"),
        ({"b2": -0.1}, ValueError, "b2"),
        ({"eps": 0.0}, ValueError, "eps must be a float > 0"),
        ({"hierarchical": "yes"}, TypeError, "hierarchical must be a bool"),
        ({"bucket_bytes": 0}, ValueError, "bucket_bytes must be a positive int"),
    ],
)
@pytest.mark.parametrize("factory", [qadam, onebit_adam, QAdam, OneBitAdam], ids=lambda f: f.__name__)
def test_bad_configurations_are_refused(factory, kwargs, error, match):
    with pytest.raises(error, match=match):
        if isinstance(factory, type):
            factory(1e-3, **kwargs)
        else:
            factory(Communicators(LaxCommunicator("ranks", 2)), 1e-3, **kwargs)


@pytest.mark.parametrize("factory", [qadam, onebit_adam])
def test_bad_inputs_are_refused(factory):
    comms = Communicators(LaxCommunicator("ranks", 2))
    with pytest.raises(TypeError, match="floating"):
        factory(comms, 1e-3).init({"w": jnp.zeros(3, jnp.int32)})
    with pytest.raises(TypeError, match="comms must be a communicator"):
        factory("ranks", 1e-3)
    # Two levels that do not tile the world are caught when the residuals are sized.
    tiled_wrong = Communicators(LaxCommunicator("ranks", 4), LaxCommunicator("intra", 2), LaxCommunicator("inter", 3))
    with pytest.raises(ValueError, match="must equal world"):
        onebit_adam(tiled_wrong, 1e-3).init({"w": jnp.zeros(8)})


# -------------------------------------------------------------------- 2 MPI processes


def mpi_worker(seed: int) -> dict:
    """One rank: both algorithms with NativeCommunicator.mpi_world() in a per-process jit; after each step the
    parameters and the momentum."""
    from bagua_jax.native_communicator import NativeCommunicator

    comm = NativeCommunicator.mpi_world(timeout=60)
    rank, n = int(comm.rank()), comm.size
    params, grads = make_data(seed, n)
    out = {}
    for name, algorithm in ALGORITHMS.items():
        tx = algorithm(LR, warmup_steps=WARMUP, bucket_bytes=BUCKET_BYTES).transformation(None, Communicators(comm))

        @jax.jit
        def step(params, state, grads, tx=tx):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        carry = (jax.tree.map(jnp.asarray, params), tx.init(params))
        out[name] = []
        for g in grads:
            carry = step(*carry, {k: v[rank] for k, v in g.items()})
            out[name].append(numpy_tree((carry[0], carry[1].adam.mu)))
    return out


@pytest.mark.skipif(not bagua_jax.build_info()["mpi"], reason="built without the MPI engine")
def test_two_mpi_processes_match_the_numpy_simulation(seed):
    results = run_ranks(
        "test_qadam_onebit_jax:mpi_worker",
        2,
        seed,
        launcher="mpiexec",
        timeout=300,
        env={"XLA_FLAGS": "--xla_cpu_max_isa=SSE4_2"},
    )
    for algorithm in ALGORITHMS:
        sim = simulate(algorithm, 2, seed)
        for t in range(1, STEPS + 1):
            (params, mu), (other_params, other_mu) = (r.value[algorithm][t - 1] for r in results)
            assert_bitwise((other_params, other_mu), (params, mu))  # the ranks agree bit for bit
            if algorithm == "qadam" or t <= WARMUP:
                # Two-rank sums are order-free, so MPI's allreduce gives the reference's bits.
                assert_bitwise(mu, sim[t].m)
                assert_params_close(params, sim, t, arithmetic_tolerance)
            else:
                assert_params_close(params, sim, t, onebit_tolerance)

"""Decentralized and LowPrecisionDecentralized on PyTorch (bagua_torch.algorithms.decentralized).

Multi-process jobs (one per configuration, several scenarios each; see
decentralized_workers_torch.py) run over gloo on 2 ranks, over gloo on 4 ranks laid out as
2 nodes x 2 (``local_world_size=2``, so hierarchical runs really use two levels), and under
``mpiexec`` through the native MPI communicator (4 ranks, 2 nodes x 2). Every rank trains
the MLP of gradient_allreduce_bytegrad_workers_torch.py with momentum SGD on its own data; the test process
simulates all ranks in one process (plain torch for the gradients and the optimizer, NumPy
for the averaging, tests/kernels_reference.py for the compression kernels) and compares:

* the weights each optimizer step starts from and ends with, at every step, exactly,
  except for the flat ``"all"`` average of 4 ranks (the order in which the allreduce adds
  four addends is the backend's: see test_decentralized_matches_simulation);
* ``"all"``: the averaged weights are bit-identical across ranks; ``shift_one``: the pairing
  formula over several rounds, with ``communication_interval`` 1 and 2;
* LowPrecisionDecentralized: the neighbours' copies ``L``/``R`` equal the neighbours' ``w``;
* checkpoints continue identically; configuration errors (odd rank counts, missing
  optimizer, float64 with the 8-bit codes, bad options, bad checkpoints).
"""

from __future__ import annotations

import kernels_reference as ref
import numpy as np
import pytest
import torch
from algorithms_reference import assert_params_equal, low_precision_ring_round, max_diff
from gradient_allreduce_bytegrad_workers_torch import SMALL_BUCKET, STEPS, batch, loss_fn, make_mlp, make_optimizer
from scenarios import Job, JobTable, Scenario, has_mpi

import bagua_torch
from bagua_torch import algorithms
from bagua_torch.algorithms.base import AlgorithmContext, Communicators
from bagua_torch.algorithms.decentralized import (
    DecentralizedAlgorithm,
    shift_one_peer,
)
from bagua_torch.algorithms.low_precision_decentralized import LowPrecisionDecentralizedAlgorithm
from bagua_torch.bucketing import make_buckets

F32 = np.float32


def dec(**options) -> Scenario:
    return Scenario("decentralized", options)


def lowprec(**options) -> Scenario:
    return Scenario("low_precision_decentralized", options)


ALL, SHIFT_ONE = {"peer_selection_mode": "all"}, {"peer_selection_mode": "shift_one"}
FLAT, EVERY_2 = {"hierarchical": False}, {"communication_interval": 2}
PEERS, CHECKPOINT, ERRORS = Scenario("peers"), Scenario("checkpoint"), Scenario("errors")
JOBS = JobTable(
    "decentralized_workers_torch:job",
    {
        "gloo-2ranks": Job(
            2,
            "python",
            (
                dec(**ALL),
                dec(**SHIFT_ONE),
                dec(**ALL, **EVERY_2),
                lowprec(),
                lowprec(**EVERY_2),
                PEERS,
                CHECKPOINT,
                ERRORS,
            ),
        ),
        "gloo-4ranks-2nodes": Job(
            4,
            "python",
            (
                dec(**ALL),
                dec(**ALL, **FLAT),
                dec(**SHIFT_ONE),
                dec(**SHIFT_ONE, **FLAT),
                dec(**SHIFT_ONE, **FLAT, **EVERY_2),
                lowprec(),
                lowprec(**FLAT),
                lowprec(**FLAT, **EVERY_2),
                PEERS,
            ),
            2,
        ),
        "mpi-4ranks-2nodes": Job(4, "mpiexec", (dec(**ALL), dec(**SHIFT_ONE, **FLAT), lowprec(), lowprec(**FLAT)), 2),
    },
    mpi=has_mpi(bagua_torch.build_info()),
)


# ============================================================================ single-process simulations


class Replicas:
    """n copies of the MLP with their own momentum SGD, all starting from make_mlp(seed) (rank 0's, broadcast)."""

    def __init__(self, seed: int, n: int):
        self.seed, self.n = seed, n
        self.models = [make_mlp(seed) for _ in range(n)]
        self.opts = [make_optimizer(m) for m in self.models]

    def backward(self, step: int) -> None:
        for r, (model, opt) in enumerate(zip(self.models, self.opts)):
            opt.zero_grad()
            loss_fn(model, *batch(self.seed, step, r)).backward()

    def params(self, r: int) -> dict[str, np.ndarray]:
        return {k: p.detach().numpy().copy() for k, p in self.models[r].named_parameters()}

    def set_params(self, r: int, values: dict[str, np.ndarray]) -> None:
        with torch.no_grad():
            for k, p in self.models[r].named_parameters():
                p.copy_(torch.from_numpy(np.ascontiguousarray(values[k])).view(p.shape))


def single_threaded(fn):
    def run(*args, **kwargs):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as in the workers: the same float32 gradients bit for bit
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return run


def np_mean(values: list[np.ndarray]) -> np.ndarray:
    """Sum in rank order, then divide: gloo's sum-then-divide (exact for two addends, see the tests for four)."""
    acc = values[0].astype(F32)
    for v in values[1:]:
        acc = (acc + v).astype(F32)
    return (acc / F32(len(values))).astype(F32)


def decentralized_average(xs: list[np.ndarray], mode: str, round_index: int, local: int | None) -> list[np.ndarray]:
    """One array per rank -> the averaged array per rank (SPEC section 3, hierarchical as in the JAX version)."""
    n = len(xs)
    k = local or 1
    groups = [np_mean(xs[i * k : (i + 1) * k]) for i in range(n // k)] if local else xs
    g = len(groups)
    if mode == "all":
        mixed = [np_mean(groups)] * g
    else:
        mixed = [ref.average2(groups[i], groups[shift_one_peer(i, round_index, g)]) for i in range(g)]
    return [mixed[r // k] for r in range(n)]


@single_threaded
def decentralized_reference(seed: int, n: int, mode: str, interval: int, local: int | None):
    """Per rank: the weights each optimizer step starts from and those it ends with, at every step."""
    sim = Replicas(seed, n)
    before, after = [[] for _ in range(n)], [[] for _ in range(n)]
    for step in range(STEPS):
        sim.backward(step)  # gradients at the pre-average weights
        if step % interval == 0:
            xs = [sim.params(r) for r in range(n)]
            averaged = {
                key: decentralized_average([x[key] for x in xs], mode, step // interval, local) for key in xs[0]
            }
            for r in range(n):
                sim.set_params(r, {key: averaged[key][r] for key in averaged})
        for r in range(n):
            before[r].append(sim.params(r))
            sim.opts[r].step()
            after[r].append(sim.params(r))
    return before, after


def pad_rows(x: np.ndarray, k: int) -> np.ndarray:
    return np.concatenate([x, np.zeros(-x.size % k, F32)]).reshape(k, -1)


@single_threaded
def lowprec_reference(seed: int, n: int, interval: int, layout, local: int | None):
    sim = Replicas(seed, n)
    initial = sim.params(0)

    def flats(params, names):
        return np.concatenate([params[name].reshape(-1) for name in names]).astype(F32)

    # copies[c][r][b]: c in (w, L, R), rank r, bucket b; all start as the initial weights.
    copies = [[[flats(initial, names) for names, _, _ in layout] for _ in range(n)] for _ in range(3)]
    after = [[] for _ in range(n)]
    for step in range(STEPS):
        sim.backward(step)
        for opt in sim.opts:
            opt.step()
        if step % interval == 0:
            params = [sim.params(r) for r in range(n)]
            for b, (names, numel, _) in enumerate(layout):
                xs = [flats(params[r], names) for r in range(n)]
                if local is None:
                    new = low_precision_ring_round(xs, *([copies[c][r][b] for r in range(n)] for c in range(3)))
                    for c in range(3):
                        for r in range(n):
                            copies[c][r][b] = new[c][r]
                    new_x = new[0]
                else:
                    k, nodes = local, n // local
                    rows = [pad_rows(x, k) for x in xs]
                    node_rows = [
                        [np_mean([rows[i * k + jj][j] for jj in range(k)]) for j in range(k)] for i in range(nodes)
                    ]
                    if nodes > 1:
                        for j in range(k):
                            members = [i * k + j for i in range(nodes)]
                            own = [[pad_rows(copies[c][r][b], k)[j] for r in members] for c in range(3)]
                            new = low_precision_ring_round([node_rows[i][j] for i in range(nodes)], *own)
                            for c in range(3):
                                for i, r in enumerate(members):
                                    full = pad_rows(copies[c][r][b], k)
                                    full[j] = new[c][i]
                                    copies[c][r][b] = full.reshape(-1)[:numel].copy()
                                    if c == 0:
                                        node_rows[i][j] = new[0][i]
                    new_x = [np.concatenate(node_rows[r // k])[:numel] for r in range(n)]
                for r in range(n):
                    offset = 0
                    for name in names:
                        size = params[r][name].size
                        params[r][name] = new_x[r][offset : offset + size].reshape(params[r][name].shape)
                        offset += size
            for r in range(n):
                sim.set_params(r, params[r])
        for r in range(n):
            after[r].append(sim.params(r))
    return after, copies


# ============================================================================ single process


class StubComm:
    """Just enough of a communicator for reify's checks (which must not communicate)."""

    def __init__(self, size: int, rank: int = 0):
        self.size, self.rank = size, rank


def stub_context(world: int, intra: int | None = None, dtype=torch.float32, optimizer: bool = True):
    model = make_mlp(0, dtype)
    named = tuple(model.named_parameters())
    comms = Communicators(
        StubComm(world), StubComm(intra) if intra else None, StubComm(world // intra) if intra else None
    )
    return AlgorithmContext(
        module=model,
        optimizers=(make_optimizer(model),) if optimizer else (),
        communicators=comms,
        buckets=tuple(make_buckets(named, SMALL_BUCKET, pad_to=world)),
        named_parameters=named,
        device=torch.device("cpu"),
        bucket_bytes=SMALL_BUCKET,
    )


def test_registry_names_and_defaults():
    assert algorithms.get_algorithm("decentralized") == DecentralizedAlgorithm("all", 1, True)
    assert algorithms.get_algorithm("low_precision_decentralized") == LowPrecisionDecentralizedAlgorithm(1, True)
    assert algorithms.get_algorithm("decentralized", peer_selection_mode="shift_one").peer_selection_mode == "shift_one"
    assert algorithms.algorithm_class("decentralized") is DecentralizedAlgorithm
    assert algorithms.algorithm_class("low_precision_decentralized") is LowPrecisionDecentralizedAlgorithm
    assert DecentralizedAlgorithm.name == "decentralized"
    assert LowPrecisionDecentralizedAlgorithm.name == "low_precision_decentralized"
    assert {"decentralized", "low_precision_decentralized"} <= set(algorithms.available_algorithms())


def test_shift_one_peer_formula_is_a_perfect_matching_that_rotates():
    for n in (2, 4, 6, 8):
        h = n // 2
        for t in range(2 * n):
            peers = [shift_one_peer(r, t, n) for r in range(n)]
            assert all(peers[peers[r]] == r != peers[r] for r in range(n)), (n, t, peers)
            for r in range(n):
                assert peers[r] == ((t + r) % h + h if r < h else (r - h - t) % h)
        # Over h rounds rank 0 meets every rank of the other half.
        assert sorted(shift_one_peer(0, t, n) for t in range(h)) == list(range(h, n))
    assert [shift_one_peer(r, 1, 4) for r in range(4)] == [3, 2, 1, 0]
    for n in (3, 5):
        with pytest.raises(ValueError, match="needs an even number of them, got"):
            shift_one_peer(0, 0, n)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        shift_one_peer(0, 0, 1)


def test_odd_rank_counts_are_refused_for_shift_one():
    with pytest.raises(ValueError, match="shift_one' pairs ranks two by two and needs an even number of them, got 3"):
        DecentralizedAlgorithm("shift_one").reify(stub_context(3))
    # Hierarchical: nodes are paired; 3 nodes of 2 ranks.
    with pytest.raises(ValueError, match="pairs nodes .* got 3; use peer_selection_mode='all'"):
        DecentralizedAlgorithm("shift_one").reify(stub_context(6, intra=2))
    # Fine: "all" on 3 ranks, shift_one on 6 flat ranks or 3 nodes x 2... ranks, one rank (nothing to exchange).
    for algorithm, context in (
        (DecentralizedAlgorithm("all"), stub_context(3)),
        (DecentralizedAlgorithm("shift_one", hierarchical=False), stub_context(6, intra=2)),
        (DecentralizedAlgorithm("shift_one"), stub_context(6, intra=3)),
        (DecentralizedAlgorithm("shift_one"), stub_context(1)),
    ):
        impl = algorithm.reify(context)
        assert impl.need_gradient_hooks is False


def test_reify_errors_and_state_validation():
    for algorithm in (DecentralizedAlgorithm(), LowPrecisionDecentralizedAlgorithm()):
        with pytest.raises(ValueError, match=f"{algorithm.name} communicates weights .* pass the optimizer"):
            algorithm.reify(stub_context(2, optimizer=False))
    with pytest.raises(TypeError, match="parameter 4.bias has dtype torch.float64; the 8-bit codes compress"):
        LowPrecisionDecentralizedAlgorithm().reify(stub_context(2, dtype=torch.float64))
    dec = DecentralizedAlgorithm().reify(stub_context(2, dtype=torch.float64))
    assert dec.state_dict() == {"step": 0}
    dec.load_state_dict({"step": 7})
    assert dec.step == 7
    for bad in ({}, {"step": -1}, {"step": 1.5}):
        with pytest.raises(ValueError, match="decentralized: the checkpoint"):
            dec.load_state_dict(bad)
    low = LowPrecisionDecentralizedAlgorithm().reify(stub_context(2))
    state = low.state_dict()
    assert sorted(state) == ["left", "right", "step", "weights"] and state["step"] == 0
    assert [t.numel() for t in state["weights"]] == [b.numel for b in low.buckets] == [131, 1024, 352]
    initial = torch.cat([p.detach().reshape(-1) for p in low.buckets[0].params])
    assert torch.equal(state["left"][0], initial) and torch.equal(state["right"][0], initial)
    state["weights"][0] += 1  # state_dict returns copies
    assert torch.equal(low.weights[0], initial)
    low.load_state_dict({**state, "step": 4})
    assert low.step == 4 and torch.equal(low.weights[0], initial + 1)
    with pytest.raises(ValueError, match="'right' has sizes \\[131, 1024\\]"):
        low.load_state_dict({**state, "right": state["right"][:2]})
    with pytest.raises(ValueError, match="has no 'left'"):
        low.load_state_dict({"step": 0, "weights": state["weights"], "right": state["right"]})


# ============================================================================ multi-process


@pytest.mark.parametrize("name,scenario", JOBS.cases("decentralized"))
def test_decentralized_matches_simulation(name, scenario):
    """Every step's weights, before the optimizer's update (after averaging) and after it, on every rank.

    Exact, except for the flat "all" average of 4 ranks: gloo (and MPI) may add the four addends in another
    order than the simulation (and in different orders for different elements), a few ulps per average
    (relative 2**-22 per addition). Carried through 4 steps of momentum SGD at lr 0.05 that stays far below
    1e-6 of the parameters' scale, which is itself far below their change over the run (~1e-2). Hierarchical
    2x2 "all" averages pairs only, ((a + b) / 2 + (c + d) / 2) / 2: exact.
    """
    seed, values = JOBS.run(name)
    n = len(values)
    options = scenario.options
    mode = options.get("peer_selection_mode", "all")
    interval = options.get("communication_interval", 1)
    local = JOBS.jobs[name].local_world_size if options.get("hierarchical", True) else None
    assert all(v[scenario.label]["levels"] == (local is not None) for v in values)
    assert all(v[scenario.label]["step"] == STEPS for v in values)
    before, after = decentralized_reference(seed, n, mode, interval, local)
    exact = not (mode == "all" and local is None and n > 2)
    scale = max(float(np.abs(p).max()) for p in after[0][-1].values())
    for v in values:
        r = v["rank"]
        for step in range(STEPS):
            for got, want in (
                (v[scenario.label]["before"][step], before[r][step]),
                (v[scenario.label]["after"][step], after[r][step]),
            ):
                if exact:
                    assert_params_equal(got, want, f"rank {r} step {step}")
                else:
                    assert max_diff(got, want) <= 1e-6 * scale, (r, step, max_diff(got, want))
    # "all": the averaged weights are bit-identical on every rank at communicating steps, and differ otherwise.
    for step in range(STEPS):
        same = all(
            max_diff(v[scenario.label]["before"][step], values[0][scenario.label]["before"][step]) == 0 for v in values
        )
        if mode == "all":
            assert same == (step % interval == 0), step
        elif step % interval:
            assert not same
    # Communication changed something: the ranks did not just train alone.
    alone = decentralized_reference(seed, n, mode, STEPS + 1, local)[1]
    assert max_diff(values[-1][scenario.label]["params"], alone[-1][-1]) > 1e-5


@pytest.mark.parametrize("name,scenario", JOBS.cases("low_precision_decentralized"))
def test_low_precision_decentralized_matches_simulation_exactly(name, scenario):
    seed, values = JOBS.run(name)
    n = len(values)
    options = scenario.options
    interval = options.get("communication_interval", 1)
    local = JOBS.jobs[name].local_world_size if options.get("hierarchical", True) else None
    layout = values[0][scenario.label]["layout"]
    assert [names for names, _, _ in layout] == [["4.bias", "4.weight", "2.bias"], ["2.weight"], ["0.bias", "0.weight"]]
    assert all(v[scenario.label]["levels"] == (local is not None) for v in values)
    after, copies = lowprec_reference(seed, n, interval, layout, local)
    for v in values:
        r = v["rank"]
        for step in range(STEPS):
            assert_params_equal(v[scenario.label]["after"][step], after[r][step], f"rank {r} step {step}")
        got = v[scenario.label]["copies"]
        for c, key in enumerate(("weights", "left", "right")):
            for b in range(len(layout)):
                np.testing.assert_array_equal(got[key][b], copies[c][r][b], err_msg=f"rank {r} {key} bucket {b}")
    # The ring's invariant: L is the left neighbour's w and R the right one's, bit for bit (in the ring's group:
    # all ranks when flat, the ranks of the same local index across nodes when hierarchical).
    k = local or 1
    ring = n // k
    for v in values:
        r = v["rank"]
        node, j = divmod(r, k)
        left = values[((node - 1) % ring) * k + j][scenario.label]["copies"]["weights"]
        right = values[((node + 1) % ring) * k + j][scenario.label]["copies"]["weights"]
        for b, (_, numel, _) in enumerate(layout):
            part = slice(None) if local is None else slice(j * (-(-numel // k)), (j + 1) * (-(-numel // k)))
            np.testing.assert_array_equal(v[scenario.label]["copies"]["left"][b][part], left[b][part])
            np.testing.assert_array_equal(v[scenario.label]["copies"]["right"][b][part], right[b][part])
        if local is None and (STEPS - 1) % interval == 0:  # flat, last step communicated: w is the weights
            flat = [
                np.concatenate([v[scenario.label]["params"][nm].reshape(-1) for nm in names]) for names, _, _ in layout
            ]
            for b in range(len(layout)):
                np.testing.assert_array_equal(v[scenario.label]["copies"]["weights"][b], flat[b])


@pytest.mark.parametrize("name", JOBS.jobs_with(PEERS))
def test_shift_one_pairs_ranks_by_the_formula_over_several_rounds(name):
    _, values = JOBS.run(name)
    n = len(values)
    for interval in (1, 2):
        for v in values:
            r = v["rank"]
            got = v["peers"][interval]
            for step, value in enumerate(got["values"]):
                if step % interval:
                    assert value == r, (interval, step)  # no communication: the rank's own weights
                else:
                    peer = shift_one_peer(r, step // interval, n)
                    assert value == (r + peer) / 2, (interval, step, value, peer)
                    assert got["last_peer"][step] == peer
    if n == 4:  # the pairing really changes between rounds
        assert {shift_one_peer(0, t, 4) for t in range(2)} == {2, 3}


def test_checkpoint_continues_identically():
    _, values = JOBS.run("gloo-2ranks")
    for v in values:
        for label in ("dec", "lowprec"):
            c = v["checkpoint"][label]
            assert c["saved_step"] == 3
            assert_params_equal(c["resumed"], c["continued"], f"rank {v['rank']} {label}")
            assert max_diff(c["without_state"], c["continued"]) > 1e-5, label
        assert v["checkpoint"]["lowprec"]["saved_keys"] == ["left", "right", "step", "weights"]


def test_configuration_errors_on_a_real_job():
    _, values = JOBS.run("gloo-2ranks")
    for v in values:
        e = v["errors"]
        assert e["dec_no_optimizer"].startswith("ValueError: decentralized communicates weights")
        assert e["lowprec_no_optimizer"].startswith("ValueError: low_precision_decentralized communicates weights")
        assert e["lowprec_float64"].startswith(
            "TypeError: low_precision_decentralized: parameter 4.bias has dtype torch.float64"
        )
        assert "'left' has sizes [131, 1024]" in e["lowprec_bad_state"]
        for mode in ("all", "shift_one"):  # float64 is averaged in full precision too (2 steps ran)
            assert all(np.isfinite(p).all() for p in e[f"dec_float64_{mode}"].values())


def test_jobs_use_the_intended_communicators():
    _, values = JOBS.run("gloo-4ranks-2nodes")
    assert all(v["hierarchical"] and v["world"] == "ProcessGroupCommunicator" for v in values)
    if JOBS.mpi:
        _, values = JOBS.run("mpi-4ranks-2nodes")
        assert all(v["hierarchical"] and v["native"] and v["world"] == "NativeCommunicator" for v in values)

"""QAdam and 1-bit Adam through the PyTorch bridge (bagua_torch.algorithms.qadam / onebit_adam).

Multi-process jobs (one per configuration, several scenarios each; see
qadam_onebit_workers_torch.py) run over gloo on 2 ranks, over gloo on 4 ranks laid out as 2
nodes x 2 (so ``hierarchical=True`` really uses two levels), and under ``mpiexec``
through the native MPI communicator (2 x 2). The tests check:

* inside the warm-up, both optimizers equal ``torch.optim.Adam(foreach=False)`` fed the
  gradients GradientAllReduce averages (same hierarchy, so the very same averaged bits)
  bit for bit: parameters, ``exp_avg``, ``exp_avg_sq``, ``step``; on 2 ranks also against a
  single-process Adam on ``(g0 + g1) / 2`` (exact: a two-term sum does not depend on order);
* after the warm-up, against a single-process plain-torch simulation of all ranks that
  starts from the state the ranks reached at the warm-up boundary and runs the same
  bagua_torch.ops kernels on the same buffers (alltoall / allgather simulated by
  indexing): exact for both QAdam and 1-bit Adam. (1-bit Adam's sign scale is a sum
  inside the kernel; the simulation calls the same kernel on the same bytes, so its
  summation order is the same and no tolerance is needed.) The hierarchical 2 x 2 case
  adds a two-rank full-precision average inside each node, also order-independent;
* checkpoints taken inside and after the warm-up continue identically; configuration
  errors are refused with clear messages.
"""

from __future__ import annotations

import copy
from functools import partial

import numpy as np
import pytest
import torch
from algorithms_reference import assert_tree_equal
from frozen_variance_reference import STEP_BOUND, variance_floors
from gradient_allreduce_bytegrad_workers_torch import batch, loss_fn, make_mlp, params_of
from qadam_onebit_workers_torch import (
    BETAS,
    EPS,
    LR,
    RUN_STEPS,
    RUN_WARMUP,
    STEPS,
    WARMUP_STEPS,
)
from scenarios import Job, JobTable, Scenario, has_mpi

import bagua_torch
from bagua_torch import ops
from bagua_torch.algorithms import algorithm_class, get_algorithm
from bagua_torch.algorithms.onebit_adam import OneBitAdamAlgorithm, OneBitAdamOptimizer
from bagua_torch.algorithms.qadam import QAdamAlgorithm, QAdamOptimizer


def warmup(hierarchical: bool) -> Scenario:
    return Scenario("warmup", {"hierarchical": hierarchical})


def run(algo: str, hierarchical: bool, weighed_out: bool = False) -> Scenario:
    options = {"algo": algo, "hierarchical": hierarchical}
    return Scenario("run", {**options, "weighed_out": True} if weighed_out else options)


JOBS = JobTable(
    "qadam_onebit_workers_torch:job",
    {
        "gloo-2ranks": Job(
            2,
            "python",
            (
                warmup(True),
                run("qadam", True),
                run("onebit_adam", True),
                run("qadam", True, weighed_out=True),
                run("onebit_adam", True, weighed_out=True),
                Scenario("checkpoint"),
                Scenario("errors"),
            ),
        ),
        "gloo-4ranks-2nodes": Job(
            4,
            "python",
            (
                warmup(True),
                run("qadam", True),
                run("onebit_adam", True),
                run("qadam", False),
                run("onebit_adam", False),
                run("qadam", True, weighed_out=True),
                run("onebit_adam", True, weighed_out=True),
            ),
            2,
        ),
        "mpi-4ranks-2nodes": Job(4, "mpiexec", (warmup(False), run("qadam", True), run("onebit_adam", False)), 2),
    },
    mpi=has_mpi(bagua_torch.build_info()),
)


class _Threads:
    """One intra-op thread, as in the workers: the same float32 gradients bit for bit."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)


# ============================================================================ single process


def test_registry_and_construction():
    model = make_mlp(0)
    q = QAdamOptimizer(model.parameters(), lr=0.1, warmup_steps=5)
    o = OneBitAdamOptimizer(model.parameters())
    assert algorithm_class("qadam") is QAdamAlgorithm and algorithm_class("onebit_adam") is OneBitAdamAlgorithm
    assert get_algorithm("qadam", optimizer=q) == QAdamAlgorithm(q, hierarchical=True)
    assert get_algorithm("onebit_adam", optimizer=o, hierarchical=False) == OneBitAdamAlgorithm(o, hierarchical=False)
    assert QAdamAlgorithm.name == "qadam" and OneBitAdamAlgorithm.name == "onebit_adam"
    assert q.warmup_steps == 5 and q.step_id == 0 and q.in_warmup
    assert q.defaults == {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    assert "warmup_steps=5" in repr(QAdamAlgorithm(q))  # part of the configuration the wrapper compares


def test_configuration_errors():
    params = list(make_mlp(0).parameters())
    adam = torch.optim.Adam(params)
    with pytest.raises(TypeError, match="qadam: the optimizer must be a bagua_torch QAdamOptimizer, got Adam"):
        QAdamAlgorithm(adam)
    with pytest.raises(
        TypeError, match="onebit_adam: the optimizer must be a bagua_torch OneBitAdamOptimizer, got QAdamOptimizer"
    ):
        OneBitAdamAlgorithm(QAdamOptimizer(params))
    with pytest.raises(TypeError, match="qadam: the optimizer must be a bagua_torch QAdamOptimizer, got OneBitAdam"):
        QAdamAlgorithm(OneBitAdamOptimizer(params))
    with pytest.raises(
        TypeError,
        match=r"^qadam needs its QAdamOptimizer: QAdamAlgorithm\(optimizer\) "
        r"or get_algorithm\('qadam', optimizer=optimizer\)",
    ):
        get_algorithm("qadam")
    with pytest.raises(TypeError, match="onebit_adam needs its OneBitAdamOptimizer"):
        OneBitAdamAlgorithm()
    with pytest.raises(TypeError, match="qadam: hierarchical must be a bool"):
        QAdamAlgorithm(QAdamOptimizer(params), hierarchical=1)
    for kwargs, message in [
        ({"warmup_steps": 0}, "warmup_steps must be an int >= 1"),
        ({"warmup_steps": 2.0}, "warmup_steps must be an int >= 1"),
        ({"betas": (0.9, 1.0)}, r"b2 \(betas\[1\]\) must be a float in \[0, 1\)"),
        ({"betas": 0.9}, "betas must be a pair"),
        ({"eps": 0.0}, "eps must be a float > 0"),
        ({"lr": -1.0}, r"learning_rate \(lr\) must be a float >= 0"),
    ]:
        with pytest.raises(ValueError, match=f"qadam: {message}"):
            QAdamOptimizer(params, **kwargs)
    with pytest.raises(TypeError, match="real floating-point"):
        QAdamOptimizer([torch.zeros(3, dtype=torch.int32)])
    q = QAdamOptimizer(params)
    with pytest.raises(ValueError, match="has no 'step_id'; was it saved by a QAdamOptimizer"):
        q.load_state_dict(adam.state_dict())
    saved = QAdamOptimizer(params, warmup_steps=7).state_dict()
    with pytest.raises(ValueError, match="saved with warmup_steps=7, this optimizer has warmup_steps=100"):
        q.load_state_dict(saved)


def test_optimizer_warmup_alone_is_torch_adam_bit_for_bit(seed):
    """Without communication (one process), the warm-up steps are torch.optim.Adam(foreach=False)'s, also with a
    parameter whose gradient is None (skipped, as torch does)."""
    with _Threads():
        a, b = make_mlp(seed), make_mlp(seed)
        qa = QAdamOptimizer(a.parameters(), lr=LR, warmup_steps=10, betas=BETAS, eps=EPS)
        adam = torch.optim.Adam(b.parameters(), lr=LR, betas=BETAS, eps=EPS, foreach=False)
        for step in range(5):
            for model, opt in ((a, qa), (b, adam)):
                x, y = batch(seed, step, 0)
                opt.zero_grad()
                loss_fn(model, x, y).backward()
                if step == 1:
                    model[0].bias.grad = None
                opt.step()
        for (name, p), q in zip(a.named_parameters(), b.parameters()):
            np.testing.assert_array_equal(p.detach().numpy(), q.detach().numpy(), err_msg=name)
            for key in ("step", "exp_avg", "exp_avg_sq"):
                np.testing.assert_array_equal(qa.state[p][key].numpy(), adam.state[q][key].numpy())
        assert qa.step_id == 5
        state = qa.state_dict()
        assert state["step_id"] == 5 and state["warmup_steps"] == 10


@pytest.mark.parametrize("step_bound", [float(STEP_BOUND), None], ids=["bounded", "bagua_formula"])
def test_optimizer_after_warmup_alone_follows_its_formula(seed, step_bound):
    """One process, whose momentum average is its own: after the warm-up the frozen v is bias-corrected by the
    warm-up's count and each step bounded, or in Bagua's formula (``step_bound=None``) by the running count and
    unbounded; bit for bit against that formula in plain torch from the state at the warm-up boundary."""
    beta1, beta2 = BETAS
    with _Threads():
        model = make_mlp(seed)
        opt = QAdamOptimizer(
            model.parameters(), lr=LR, warmup_steps=RUN_WARMUP, betas=BETAS, eps=EPS, step_bound=step_bound
        )
        for step in range(RUN_STEPS):
            if step == RUN_WARMUP:
                reference = copy.deepcopy(model)
                moments = {
                    name: (opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone())
                    for name, p in model.named_parameters()
                }
            opt.zero_grad()
            loss_fn(model, *batch(seed, step, 0)).backward()
            if not opt.in_warmup:
                opt.local_momentum()
                opt.mark_momentum_averaged()
            opt.step()
        floors = variance_floors(
            {k: v.numpy() for k, (_, v) in moments.items()},
            mean=lambda v: (torch.from_numpy(v).sum(dtype=torch.float32) / v.size).item(),
        )
        for step in range(RUN_WARMUP, RUN_STEPS):
            reference.zero_grad()
            loss_fn(reference, *batch(seed, step, 0)).backward()
            with torch.no_grad():
                for name, p in reference.named_parameters():
                    m, v = moments[name]
                    m.lerp_(p.grad, 1 - beta1)
                    bc1 = 1 - beta1 ** (step + 1)
                    bc2 = 1 - beta2 ** (step + 1 if step_bound is None else RUN_WARMUP)
                    denom = (v.clamp(min=float(floors[name])).sqrt() / bc2**0.5).add_(EPS)
                    if step_bound is None:
                        p.addcdiv_(m, denom, value=-LR / bc1)
                    else:
                        bound = step_bound * bc1
                        p.add_((m / denom).clamp_(-bound, bound), alpha=-LR / bc1)
    assert_tree_equal(params_of(model), params_of(reference), "vs the formula in plain torch")


# ============================================================================ warm-up


@pytest.mark.parametrize("name,scenario", JOBS.cases("warmup"))
def test_warmup_is_adam_on_averaged_gradients_bit_for_bit(name, scenario):
    seed, values = JOBS.run(name)
    n = len(values)
    for v in values:
        got = v[scenario.label]
        adam = got["adam"]
        for algo in ("qadam", "onebit_adam"):
            assert got[algo]["hooks"] == [True] * STEPS  # gradients averaged in every warm-up backward
            assert got[algo]["step_id"] == STEPS <= WARMUP_STEPS
            assert_tree_equal(got[algo]["params"], adam["params"], f"rank {v['rank']} {algo} params")
            assert_tree_equal(got[algo]["state"], adam["state"], f"rank {v['rank']} {algo} state")
        assert_tree_equal(adam["params"], values[0][scenario.label]["adam"]["params"])
    if n == 2:
        # And against one process: Adam on (g0 + g1) / 2, the gradients computed by plain torch.
        with _Threads():
            model = make_mlp(seed)
            opt = torch.optim.Adam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, foreach=False)
            for step in range(STEPS):
                grads = []
                for r in range(n):
                    model.zero_grad()
                    loss_fn(model, *batch(seed, step, r)).backward()
                    grads.append([p.grad.clone() for p in model.parameters()])
                for p, g0, g1 in zip(model.parameters(), *grads):
                    p.grad = (g0 + g1).div_(2)
                opt.step()
        expected = {k: p.detach().numpy() for k, p in model.named_parameters()}
        assert_tree_equal(values[0][scenario.label]["qadam"]["params"], expected, "vs single-process Adam")


# ============================================================================ after the warm-up: simulation


def _minmax_exchange(xs: list[torch.Tensor], ranks: list[int], residuals) -> list[torch.Tensor]:
    """compressed_allreduce.minmax_allreduce over the ranks holding ``xs``, simulated: every rank's result."""
    n, m = len(xs), xs[0].numel() // len(xs)
    rows = [ops.minmax_uint8_compress(x, n).view(n, -1) for x in xs]
    mine = [ops.minmax_uint8_decompress_reduce(torch.cat([rows[i][j] for i in range(n)]), m, n) for j in range(n)]
    gathered = torch.cat([ops.minmax_uint8_compress(c, 1) for c in mine])
    return [ops.minmax_uint8_decompress(gathered, n * m, n, xs[0].dtype)] * n


def _sign_exchange(xs: list[torch.Tensor], ranks: list[int], residuals, scale: float = 1.0) -> list[torch.Tensor]:
    """compressed_allreduce.sign_allreduce simulated; ``residuals[r]`` = (worker, server) of world rank r; each
    reduced chunk times ``scale`` before the server compresses it."""
    n, m = len(xs), xs[0].numel() // len(xs)
    rows = [ops.sign_compress_ef(x, residuals[r][0], n)[0].view(n, -1) for x, r in zip(xs, ranks)]
    mine = [ops.sign_decompress_reduce(torch.cat([rows[i][j] for i in range(n)]), m, n) * scale for j in range(n)]
    gathered = torch.cat([ops.sign_compress_ef(c, residuals[r][1], 1)[0] for c, r in zip(mine, ranks)])
    return [ops.sign_decompress(gathered, n * m, n, xs[0].dtype)] * n


def _allreduce(xs: list[torch.Tensor], exchange, residuals, local: int | None) -> list[torch.Tensor]:
    """One bucket over all ranks: flat, or compressed_allreduce.hierarchical (full-precision average inside each
    node of ``local`` ranks, ``exchange`` between nodes, allgather inside the node)."""
    n = len(xs)
    if local is None:
        return exchange(xs, list(range(n)), residuals)
    nodes = n // local
    # slices[node][l]: the node's average of row l (gloo: sum, then divided by the rank count).
    slices = [
        [
            torch.stack([xs[node * local + r].view(local, -1)[l] for r in range(local)]).sum(0).div_(local)
            for l in range(local)
        ]
        for node in range(nodes)
    ]
    between = [
        exchange([slices[node][l] for node in range(nodes)], [node * local + l for node in range(nodes)], residuals)
        for l in range(local)
    ]
    return [torch.cat([between[l][node] for l in range(local)]) for node in range(nodes) for _ in range(local)]


def simulate(
    seed: int, n: int, algo: str, boundary: dict, layout, local: int | None, steps: range, weighed_out: bool = False
):
    """All n ranks in one process, from the state at the warm-up boundary (identical on every rank): local
    gradients by plain torch, torch Adam's momentum update, the compression pipeline through bagua_torch.ops, the
    frozen-v update with torch Adam's operations. ``weighed_out``: the last rank sends zeros, and the average is
    rescaled to the others' (QAdam's after the exchange, 1-bit Adam's before the server compresses it). Returns
    (params, state, residuals)."""
    beta1, beta2 = BETAS
    with _Threads():
        model = make_mlp(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.from_numpy(boundary["params"][name]))
        names = [name for name, _ in model.named_parameters()]
        shapes = {name: p.shape for name, p in model.named_parameters()}
        step_of = {k: boundary["state"][k][0] for k in names}
        exp_avg = {k: torch.from_numpy(boundary["state"][k][1].copy()) for k in names}
        exp_avg_sq = {k: torch.from_numpy(boundary["state"][k][2].copy()) for k in names}
        share = local or 1
        residuals = [
            ([torch.zeros(size // share) for _, size in layout], [torch.zeros(size // n) for _, size in layout])
            for _ in range(n)
        ]
        scale = n / (n - 1) if weighed_out else 1.0
        exchange = _minmax_exchange if algo == "qadam" else partial(_sign_exchange, scale=scale)
        for step in steps:
            momenta = []
            for r in range(n):
                model.zero_grad()
                loss_fn(model, *batch(seed, step, r)).backward()
                momenta.append({k: exp_avg[k].clone().lerp_(p.grad, 1 - beta1) for k, p in model.named_parameters()})
            for b, (bucket_names, size) in enumerate(layout):
                flats = [torch.cat([momenta[r][k].reshape(-1) for k in bucket_names]) for r in range(n)]
                flats = [torch.cat([f, torch.zeros(size - f.numel())]) for f in flats]
                if weighed_out:
                    flats[-1] = torch.zeros(size)
                per_bucket = [(w[b], s[b]) for w, s in residuals]
                results = _allreduce(flats, exchange, per_bucket, local)
                if algo == "qadam" and weighed_out:
                    results = [r.mul(scale) for r in results]
                for res in results[1:]:
                    assert torch.equal(res, results[0])
                offset = 0
                for k in bucket_names:
                    numel = shapes[k].numel()
                    exp_avg[k] = results[0][offset : offset + numel].view(shapes[k]).clone()
                    offset += numel
            floors = variance_floors(
                {k: v.numpy() for k, v in exp_avg_sq.items()},
                mean=lambda v: (torch.from_numpy(v).sum(dtype=torch.float32) / v.size).item(),
            )
            with torch.no_grad():
                for k, p in model.named_parameters():
                    step_of[k] += 1
                    # v froze after RUN_WARMUP steps, and its bias correction with it (frozen_variance's docstring).
                    bc1, bc2 = 1 - beta1 ** step_of[k], 1 - beta2**RUN_WARMUP
                    variance = exp_avg_sq[k].clamp(min=float(floors[k]))  # the frozen v's floor
                    denom = (variance.sqrt() / bc2**0.5).add_(EPS)
                    bound = float(STEP_BOUND) * bc1  # the direction (m / bc1) / denom, clipped to +-STEP_BOUND
                    p.add_((exp_avg[k] / denom).clamp_(-bound, bound), alpha=-(LR / bc1))
        params = {k: p.detach().numpy().copy() for k, p in model.named_parameters()}
        state = {k: (step_of[k], exp_avg[k].numpy(), exp_avg_sq[k].numpy()) for k in names}
    return params, state, residuals


@pytest.mark.parametrize("name,scenario", JOBS.cases("run"))
def test_after_warmup_matches_single_process_simulation_exactly(name, scenario):
    seed, values = JOBS.run(name)
    n = len(values)
    algo, hierarchical = scenario.options["algo"], scenario.options["hierarchical"]
    local = JOBS.jobs[name].local_world_size if hierarchical else None
    first = values[0][scenario.label]
    assert first["levels"] == (local is not None)
    assert first["hooks"] == [True] * RUN_WARMUP + [False] * (RUN_STEPS - RUN_WARMUP)
    for v in values:  # replicas identical at the boundary and at the end
        assert_tree_equal(v[scenario.label]["boundary"], first["boundary"], f"rank {v['rank']} boundary")
        assert_tree_equal(v[scenario.label]["params"], first["params"], f"rank {v['rank']} params")
        assert_tree_equal(v[scenario.label]["state"], first["state"], f"rank {v['rank']} state")
    layout = first["layout"]
    steps = range(RUN_WARMUP, RUN_STEPS)
    weighed_out = scenario.options.get("weighed_out", False)
    params, state, residuals = simulate(seed, n, algo, first["boundary"], layout, local, steps, weighed_out)
    assert_tree_equal(first["params"], params, "params vs the simulation")
    assert_tree_equal(first["state"], state, "optimizer state vs the simulation")
    # v stayed frozen after the warm-up; the momentum moved.
    for k, (_, m, v2) in first["state"].items():
        np.testing.assert_array_equal(v2, first["boundary"]["state"][k][2])
        assert not np.array_equal(m, first["boundary"]["state"][k][1])
    if algo == "onebit_adam":
        for v in values:
            got = v[scenario.label]["algorithm_state"]
            workers, servers = residuals[v["rank"]]
            assert_tree_equal(got["worker_residuals"], [w.numpy() for w in workers], "worker residuals")
            assert_tree_equal(got["server_residuals"], [s.numpy() for s in servers], "server residuals")
            if weighed_out and local is None and v["rank"] == n - 1:  # its zeros crossed the signs exactly: a scale
                # of 0 (in two levels it compresses its node's average)
                assert all(np.abs(w).max() == 0 for w in got["worker_residuals"])
            else:
                assert any(np.abs(w).max() > 0 for w in got["worker_residuals"])
    else:
        assert first["algorithm_state"] == {}


# ============================================================================ checkpoints, errors


def test_checkpoint_across_the_warmup_boundary_continues_identically():
    _, values = JOBS.run("gloo-2ranks")
    for v in values:
        for key, got in v["checkpoint"].items():
            algo, save_at = key.split("@")
            assert got["resumed"]["step_id"] == int(save_at)
            assert_tree_equal(got["resumed"]["params"], got["continued"], f"rank {v['rank']} {key}")
            assert "_extra_state" in got["keys"]
            if algo == "onebit_adam" and save_at == "4":
                # The residuals are the algorithm's state: without them the run diverges.
                assert any(
                    not np.array_equal(got["without_state"]["params"][k], got["continued"][k]) for k in got["continued"]
                )
            else:
                # No residuals yet (or none at all): the weights and the optimizer are the whole state.
                assert_tree_equal(got["without_state"]["params"], got["continued"], f"{key} without state")


def test_wrap_time_errors():
    _, values = JOBS.run("gloo-2ranks")
    for v in values:
        e = v["errors"]
        assert e["optimizer_not_wrapped"].startswith("ValueError: qadam: its optimizer is not among the optimizers")
        assert (
            "must hold exactly the wrapped model's trainable parameters (6 tensors; the optimizer holds 6, 0"
            in (e["optimizer_of_other_model"])
        )
        assert "the optimizer holds 2, 2 of them" in e["optimizer_with_some_parameters"]
        assert e["float64"].startswith("TypeError: qadam: parameter 4.bias has dtype torch.float64")
        assert "qadam needs its QAdamOptimizer" in e["by_name_without_optimizer"]
        another = e["by_name_with_another_optimizer"]
        assert another == "TypeError: qadam: the optimizer must be a bagua_torch QAdamOptimizer, got SGD"  # named once
        assert e["bad_residuals"].startswith("ValueError: onebit_adam: the checkpoint's 'server_residuals' has sizes")
        assert e["step_without_algorithm"].startswith(
            "RuntimeError: QAdamOptimizer: after its 1 warm-up steps the momentum must be averaged"
        )


def test_native_mpi_communicator_used():
    _, values = JOBS.run("mpi-4ranks-2nodes")
    assert all(v["world"] == "NativeCommunicator" for v in values)


def test_qadam_weight_decay_is_torchs_adam_l2_in_warmup_and_reaches_the_momentum_after():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4))]
    mirror = [torch.nn.Parameter(p.detach().clone()) for p in params]
    qadam = QAdamOptimizer(params, lr=0.01, warmup_steps=4, weight_decay=0.1)
    adam = torch.optim.Adam(mirror, lr=0.01, weight_decay=0.1, foreach=False)
    for _ in range(4):
        grads = [torch.randn_like(p) for p in params]
        for p, q, g in zip(params, mirror, grads):
            p.grad, q.grad = g.clone(), g.clone()
        qadam.step()
        adam.step()
        for p, q, g in zip(params, mirror, grads):
            assert torch.equal(p, q)
            assert torch.equal(p.grad, g)  # the user's gradient is left as it was
    momentum = [qadam.momentum(p).clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    qadam.local_momentum()
    for p, m in zip(params, momentum):
        assert torch.equal(qadam.momentum(p), m.lerp(p.grad + 0.1 * p.detach(), 0.1))
    with pytest.raises(ValueError, match="weight_decay"):
        QAdamOptimizer(params, weight_decay=-1.0)

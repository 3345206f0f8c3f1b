"""The convergence gate: every registered algorithm of both front ends trains the workload's GPT past what byte
frequencies alone give, about as well as gradient allreduce with AdamW does at equal tokens.

``gpt_gate.py`` defines the run: a small GPT, started from one AdamW model that has left the unigram plateau but
not crossed the bar (:func:`pretrained`, held-out loss at least START_FLOOR), then STEPS steps of 16 windows of 32
corpus bytes, in JAX on 2 ranks, in torch on 2 nodes of 2 ranks (its hierarchical algorithms train on both levels),
AdamW with a warm-up and a cosine decay (the Adam-type algorithms: Adam with the same schedule). Each algorithm's
model is judged on 64 held-out windows, every rank's own model (decentralized and asynchronous replicas differ),
by :func:`verdict`:

* its held-out loss at or below BAR (2.5 nats per byte, 0.8 below the held-out text's unigram entropy of 3.31):
  the model predicts bytes from the bytes before them, not only from how often each occurs;
* its held-out loss at most MARGIN above gradient allreduce's in the same front end (MARGINS for the algorithms
  that average models rather than gradients). The start is at least START_FLOOR, above BAR: every algorithm
  crosses the bar itself, and one that stops learning where it started fails the bar;
* every parameter finite, and each parameter tensor's largest magnitude at most 3x the same tensor's under AdamW
  (plus 0.05; plus lr x steps for the tensors that start at zero, the biases: AdamW keeps some tiny while any
  optimizer may move a coordinate by about lr per step). With Bagua's unbounded QAdam / 1-bit Adam step
  (``step_bound=None``) 1-bit Adam reached 4.6x on an MLP projection.

An algorithm that cannot learn fails: :func:`test_the_gate_rejects_an_algorithm_that_cannot_learn` trains gradient
allreduce whose averaged gradients reach AdamW STALE_STEPS steps late, from the same start.

Where the time goes: the pretraining in this process, then the JAX algorithms on a 2-device mesh in this process,
one compilation each; asynchronous averaging in JAX runs its rounds between steps over the native engine, so it
runs in a 2-process MPI job; the torch algorithms run one after the other in one 4-process gloo job. Both jobs
start when the pretraining ends and run while the mesh trains.
"""

from __future__ import annotations

import functools
import threading
import zlib

import jax
import numpy as np
import optax
import pytest
from gpt_gate import (
    B2,
    BAR,
    BATCH,
    HELDOUT_WINDOWS,
    LR,
    MODEL,
    NRANKS,
    OPTIONS,
    PRETRAIN_LR,
    PRETRAIN_STEPS,
    PRETRAIN_WINDOWS,
    START_FLOOR,
    STEPS,
    TORCH_NODES,
    WEIGHT_DECAY,
    learning_rate,
    summary,
)
from gpt_workers_jax import gate_adamw, gate_schedule
from jax.sharding import Mesh
from multiprocess import has_mpiexec, run_ranks

import bagua_jax
from bagua_common.workload import gpt_config, init_gpt_params, load_corpus
from bagua_jax import algorithms as jax_algorithms
from bagua_jax.models.gpt import gpt_loss_fn
from bagua_jax.trainer import DataParallel
from bagua_torch.algorithms import available_algorithms as torch_algorithms

# The first test's setup trains every run (180-250 s on a 2-core machine): the suite's 300 s hang guard is too tight
# for it, so the guard here is the training jobs' own limit.
pytestmark = pytest.mark.timeout(600)

MARGIN = 0.1
MARGINS = {
    ("jax", "diloco"): 0.15,
    ("torch", "diloco"): 0.15,
}
"""Held-out loss (nats per byte) a (front end, algorithm) may trail gradient allreduce by (see the module docstring).
Seeds 1-5 under load: at most 0.049 (DiLoCo 0.076); asynchronous averaging 0.04 (gpt_gate.ASYNC_STEP_SECONDS)."""
ASYNC_ROUNDS_PER_STEP = 0.1
"""Asynchronous averaging averaged at least this often after its warm-up (0.32-0.42 measured, under load too)."""
MAGNITUDE_FACTOR, MAGNITUDE_SLACK = 3.0, 0.05
REPLICA_SPREAD = 0.1
"""The largest distance of a torch rank's parameters from the ranks' mean, over how far the mean moved, for the
algorithms that average every step (gpt_workers_torch.py); about 0.5 when decentralized's replicas never average."""
STALE_STEPS = 10
"""How late the broken variant's averaged gradients reach the optimizer."""

JAX_NATIVE_ONLY = ("async",)  # its rounds run between steps over the native engine, not on a mesh


@functools.cache
def _heldout_loss():
    """The jitted loss that judges every algorithm's parameters (NumPy arrays): compiled once, not per algorithm."""
    return jax.jit(gpt_loss_fn(MODEL))


def heldout() -> dict:
    return {"tokens": load_corpus().heldout_batch(HELDOUT_WINDOWS, gpt_config(MODEL).context + 1)}


def pretrained(seed: int) -> dict[str, np.ndarray]:
    """The model every algorithm starts from: ``init_gpt_params(seed)`` after PRETRAIN_STEPS steps of plain AdamW
    (one process, PRETRAIN_WINDOWS windows of ``(seed, step, 0)`` per step, lr rising linearly to PRETRAIN_LR)."""

    loss_fn = gpt_loss_fn(MODEL)
    tx = optax.adamw(optax.linear_schedule(0.0, PRETRAIN_LR, PRETRAIN_STEPS), b2=B2, weight_decay=WEIGHT_DECAY)

    @jax.jit
    def step(params, opt_state, tokens):
        grads = jax.grad(loss_fn)(params, {"tokens": tokens})
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    params = jax.tree.map(jax.numpy.asarray, init_gpt_params(MODEL, seed))
    opt_state = tx.init(params)
    corpus, length = load_corpus(), gpt_config(MODEL).context + 1
    for t in range(PRETRAIN_STEPS):
        params, opt_state = step(params, opt_state, corpus.batch(seed, t, 0, PRETRAIN_WINDOWS, length))
    return {k: np.asarray(v) for k, v in params.items()}


def _jax_mesh_run(name: str, seed: int, start: dict, optimizer: optax.GradientTransformation | None = None) -> list:
    options = dict(OPTIONS.get(name, {}))
    if name in ("qadam", "onebit_adam"):
        options["b2"] = B2
    algorithm = jax_algorithms.make_algorithm(name, learning_rate=gate_schedule(), **options)
    if optimizer is None and not hasattr(algorithm, "learning_rate"):
        optimizer = gate_adamw()
    mesh = Mesh(np.array(jax.devices()[:NRANKS]), ("ranks",))
    trainer = DataParallel(gpt_loss_fn(MODEL), optimizer, algorithm, mesh=mesh)
    state = trainer.init(start)
    corpus, length = load_corpus(), gpt_config(MODEL).context + 1
    for step in range(STEPS):
        tokens = np.concatenate([corpus.batch(seed, PRETRAIN_STEPS + step, r, BATCH, length) for r in range(NRANKS)])
        state, _ = trainer.step(state, {"tokens": tokens})
    evaluate, batch = _heldout_loss(), heldout()
    per_rank = []
    for r in range(NRANKS):
        params = (
            state.params
            if getattr(algorithm, "replicas_identical", False)
            else jax.tree.map(lambda p: p[r], state.params)
        )
        params = {k: np.asarray(v) for k, v in params.items()}
        per_rank.append(summary(params, float(evaluate(params, batch))))
    return per_rank


def _in_thread(target, *args, **kwargs) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run():
        try:
            box["value"] = target(*args, **kwargs)
        except BaseException as error:  # re-raised by the test that reads it
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


@pytest.fixture(scope="module")
def gate_seed(seed) -> int:
    return zlib.crc32(f"{seed}:gpt-gate".encode())


@pytest.fixture(scope="module")
def start(gate_seed) -> dict[str, np.ndarray]:
    return pretrained(gate_seed)


@pytest.fixture(scope="module")
def runs(gate_seed, start) -> dict[str, dict[str, list[dict]]]:
    """front end -> algorithm -> every rank's summary, "torch_hierarchical": whether every torch rank had two
    levels, and "start": the pretrained model's held-out loss; trained once per session."""
    seed = gate_seed
    torch_ranks = NRANKS * TORCH_NODES
    jobs = {
        "torch": _in_thread(
            run_ranks, "gpt_workers_torch:gate", torch_ranks, torch_algorithms(), seed, start, timeout=600
        )
    }
    if bagua_jax.build_info()["mpi"] and has_mpiexec():
        jobs["jax"] = _in_thread(
            run_ranks, "gpt_workers_jax:async_gate", NRANKS, seed, start, launcher="mpiexec", timeout=600
        )
    trained = {
        "jax": {n: _jax_mesh_run(n, seed, start) for n in jax_algorithms.algorithm_names() if n not in JAX_NATIVE_ONLY},
        "torch": {},
        "start": float(_heldout_loss()(start, heldout())),
    }
    for front_end, (thread, box) in jobs.items():
        thread.join()
        if "error" in box:
            raise box["error"]
        ranks = sorted((r.value for r in box["value"]), key=lambda v: v["rank"])
        if front_end == "torch":
            trained["torch_hierarchical"] = all(r.pop("hierarchical") for r in ranks)
        for name in set(ranks[0]) - {"rank"}:
            trained[front_end][name] = [r[name] for r in ranks]
    return trained


def verdict(ranks: list[dict], reference: dict, margin: float) -> list[str]:
    """Why the gate rejects an algorithm whose ranks ended as ``ranks`` (their summaries), against gradient
    allreduce's ``reference``: an empty list if it passes."""
    slack = {k: LR * STEPS if not v.any() else MAGNITUDE_SLACK for k, v in init_gpt_params(MODEL, 0).items()}
    bound = {k: MAGNITUDE_FACTOR * v + slack[k] for k, v in reference["max_abs"].items()}
    failures = []
    for rank, result in enumerate(ranks):
        loss = result["heldout_loss"]
        if not result["finite"]:
            failures.append(f"rank {rank}: a parameter is not finite")
        if not loss <= BAR:
            failures.append(f"rank {rank}: held-out loss {loss:.3f} above the bar {BAR}")
        if not loss <= reference["heldout_loss"] + margin:
            failures.append(
                f"rank {rank}: held-out loss {loss:.3f} more than {margin} above gradient allreduce's "
                f"{reference['heldout_loss']:.3f}"
            )
        grown = {k: (v, bound[k]) for k, v in result["max_abs"].items() if not v <= bound[k]}
        if grown:
            failures.append(f"rank {rank}: largest magnitudes beyond 3x AdamW's: {grown}")
    return failures


def registered(front_end: str) -> list[str]:
    return jax_algorithms.algorithm_names() if front_end == "jax" else torch_algorithms()


CASES = [(front_end, name) for front_end in ("jax", "torch") for name in registered(front_end)]


def test_both_front_ends_schedule_the_same_learning_rate():
    optax_rates = np.asarray(gate_schedule()(np.arange(STEPS + 1)))
    np.testing.assert_allclose([learning_rate(step) for step in range(STEPS + 1)], optax_rates, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("front_end", ["jax", "torch"])
def test_every_registered_algorithm_is_gated(runs, front_end):
    trained = set(runs[front_end])
    missing = set(registered(front_end)) - trained
    if front_end == "jax" and missing == set(JAX_NATIVE_ONLY) and not bagua_jax.build_info()["mpi"]:
        pytest.skip("built without the MPI engine: JAX's asynchronous averaging is not gated")
    assert not missing and "gradient_allreduce" in trained, missing
    if front_end == "torch":  # two nodes: the hierarchical algorithms (their default) train on both levels
        assert runs["torch_hierarchical"]


@pytest.mark.parametrize(("front_end", "name"), CASES)
def test_algorithm_learns_like_gradient_allreduce_with_adamw(runs, front_end, name):
    trained = runs[front_end]
    if name not in trained:
        pytest.skip(f"{front_end} {name} did not run here (see test_every_registered_algorithm_is_gated)")
    ranks = trained[name]
    # The gate's steps are where the bar is crossed: an algorithm that stops learning at the start fails it.
    assert runs["start"] >= START_FLOOR, runs["start"]
    if name == "async":  # it did average, as often as the verdict assumes
        after_warmup = STEPS - OPTIONS["async"]["warmup_steps"]
        rounds = [(r["rounds"], r.get("step_ms")) for r in ranks]  # the JAX ranks report their median step's ms
        assert all(r["rounds"] >= ASYNC_ROUNDS_PER_STEP * after_warmup for r in ranks), rounds
    failures = verdict(ranks, trained["gradient_allreduce"][0], MARGINS.get((front_end, name), MARGIN))
    assert not failures, failures
    if "replica_spread" in ranks[0]:
        assert ranks[0]["replica_spread"] <= REPLICA_SPREAD, ranks[0]["replica_spread"]  # they did average


def stale(steps: int) -> optax.GradientTransformation:
    """Passes on each step's updates ``steps`` steps late (zeros until then): averaged gradients gone stale."""

    def init_fn(params):
        return tuple(jax.tree.map(jax.numpy.zeros_like, params) for _ in range(steps))

    def update_fn(updates, state, params=None):
        del params
        return state[0], (*state[1:], updates)

    return optax.GradientTransformation(init_fn, update_fn)


def test_the_gate_rejects_an_algorithm_that_cannot_learn(runs, gate_seed, start):
    """Gradient allreduce whose averaged gradients reach AdamW STALE_STEPS steps late, a bucket read before its
    allreduce was refreshed: from the same start it stays near the byte frequencies' loss, which a gate that
    stops at the unigram plateau passed."""
    broken = _jax_mesh_run("gradient_allreduce", gate_seed, start, optax.chain(stale(STALE_STEPS), gate_adamw()))
    failures = verdict(broken, runs["jax"]["gradient_allreduce"][0], MARGIN)
    assert any("above the bar" in f for f in failures), (broken[0]["heldout_loss"], failures)

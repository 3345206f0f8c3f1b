"""Rank bodies for test_qadam_onebit_torch.py: QAdam and 1-bit Adam through the PyTorch bridge.

One job per configuration runs several scenarios and returns a dict per scenario; the
test process checks them against single-process references. Models and data come from
gradient_allreduce_bytegrad_workers_torch (deterministic functions of a seed).
"""

from __future__ import annotations

import io
import os

import torch
from gradient_allreduce_bytegrad_workers_torch import (
    SMALL_BUCKET,
    batch,
    load_checkpoint,
    loss_fn,
    make_mlp,
    params_of,
    setup,
)
from scenarios import Registry, Scenario, raised
from torch import nn

scenario = Registry()

LR = 0.01
BETAS = (0.9, 0.999)
EPS = 1e-8
WARMUP_STEPS = 4  # the "warmup" scenario: all steps inside the warm-up
STEPS = 4
RUN_WARMUP = 2  # the "run" scenario: 2 warm-up steps, then RUN_STEPS - RUN_WARMUP compressed ones
RUN_STEPS = 6


def _classes(algo: str):
    if algo == "qadam":
        from bagua_torch.algorithms.qadam import QAdamAlgorithm, QAdamOptimizer

        return QAdamOptimizer, QAdamAlgorithm
    from bagua_torch.algorithms.onebit_adam import (
        OneBitAdamAlgorithm,
        OneBitAdamOptimizer,
    )

    return OneBitAdamOptimizer, OneBitAdamAlgorithm


def _wrap(algo: str, model: nn.Module, warmup_steps: int, hierarchical: bool = True, by_name: bool = False):
    import bagua_torch
    from bagua_torch.algorithms import get_algorithm

    opt_cls, algo_cls = _classes(algo)
    opt = opt_cls(model.parameters(), lr=LR, warmup_steps=warmup_steps, betas=BETAS, eps=EPS)
    algorithm = (
        get_algorithm(algo, optimizer=opt, hierarchical=hierarchical)
        if by_name
        else algo_cls(opt, hierarchical=hierarchical)
    )
    return bagua_torch.with_bagua(model, [opt], algorithm, bucket_bytes=SMALL_BUCKET), opt


def _train(wrapped, opt, seed: int, steps, rank: int, after_step=None, weighed_out=None) -> list[bool]:
    hooks = []
    for step in steps:
        x, y = batch(seed, step, rank)
        opt.zero_grad()
        wrapped.algorithm_impl.weighed_out = weighed_out
        hooks.append(bool(wrapped.algorithm_impl.need_gradient_hooks))
        loss_fn(wrapped, x, y).backward()
        opt.step()
        if after_step is not None:
            after_step(step)
    return hooks


def opt_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """Per parameter name: (step, exp_avg, exp_avg_sq) as numpy."""
    out = {}
    for name, p in model.named_parameters():
        s = opt.state[p]
        out[name] = (float(s["step"]), s["exp_avg"].numpy().copy(), s["exp_avg_sq"].numpy().copy())
    return out


# ----------------------------------------------------------------------------- scenarios


@scenario
def warmup(seed: int, rank: int, hierarchical: bool) -> dict:
    """Inside the warm-up, QAdam and 1-bit Adam (built by name) against GradientAllReduce (same hierarchy) +
    torch.optim.Adam(foreach=False): the very same averaged gradients, so the results must agree bit for bit."""
    import bagua_torch
    from bagua_torch.algorithms import GradientAllReduceAlgorithm

    out = {}
    reference = make_mlp(seed)
    adam = torch.optim.Adam(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    wrapped = bagua_torch.with_bagua(
        reference, [adam], GradientAllReduceAlgorithm(hierarchical=hierarchical), bucket_bytes=SMALL_BUCKET
    )
    grads = []

    def keep_grads(step):
        grads.append({n: p.grad.numpy().copy() for n, p in reference.named_parameters()})

    _train(wrapped, adam, seed, range(STEPS), rank, keep_grads)
    wrapped.close()
    out["adam"] = {"params": params_of(reference), "state": opt_state(reference, adam), "grads": grads}
    for algo in ("qadam", "onebit_adam"):
        model = make_mlp(seed)
        w, opt = _wrap(algo, model, WARMUP_STEPS, hierarchical, by_name=True)
        hooks = _train(w, opt, seed, range(STEPS), rank)
        out[algo] = {"params": params_of(model), "state": opt_state(model, opt), "hooks": hooks, "step_id": opt.step_id}
        w.close()
    return out


@scenario
def run(seed: int, rank: int, algo: str, hierarchical: bool, weighed_out: bool = False) -> dict:
    """RUN_WARMUP warm-up steps then compressed ones: the state at the warm-up boundary, the final state, and what
    the test needs to simulate the compressed steps (bucket layout, residual sizes). ``weighed_out``: the last rank
    is weighed out of every step (a fault-tolerant job's joiner: its gradients, then its momentum, left out)."""
    from bagua_torch.algorithms.base import WeighedOut

    model = make_mlp(seed)
    wrapped, opt = _wrap(algo, model, RUN_WARMUP, hierarchical)
    snapshot = {}

    def at_boundary(step):
        if step == RUN_WARMUP - 1:
            snapshot.update(params=params_of(model), state=opt_state(model, opt))

    world = wrapped.algorithm_impl.world.size
    weighing = WeighedOut(rank < world - 1, world / (world - 1)) if weighed_out else None
    hooks = _train(wrapped, opt, seed, range(RUN_STEPS), rank, at_boundary, weighing)
    impl = wrapped.algorithm_impl
    out = {
        "boundary": snapshot,
        "params": params_of(model),
        "state": opt_state(model, opt),
        "hooks": hooks,
        "layout": [(list(b.names), b.size) for b in wrapped.buckets],
        "levels": impl.levels is not None,
        "algorithm_state": {k: [t.numpy().copy() for t in v] for k, v in impl.state_dict().items()},
    }
    wrapped.close()
    return out


@scenario
def checkpoint(seed: int, rank: int) -> dict:
    """Save inside the warm-up (step 2 of 3) and after it (step 4), continue to step 7; a fresh model and optimizer
    loaded from the checkpoint continue identically. For 1-bit Adam, loading the weights and the optimizer but not
    the residuals does not."""
    out = {}
    warmup_steps, total = 3, 7
    for algo in ("qadam", "onebit_adam"):
        for save_at in (2, 4):
            model = make_mlp(seed)
            wrapped, opt = _wrap(algo, model, warmup_steps)
            _train(wrapped, opt, seed, range(save_at), rank)
            buffer = io.BytesIO()
            torch.save({"model": wrapped.state_dict(), "optimizer": opt.state_dict()}, buffer)
            _train(wrapped, opt, seed, range(save_at, total), rank)
            continued = params_of(model)
            keys = sorted(wrapped.state_dict())
            wrapped.close()

            out[f"{algo}@{save_at}"] = {
                "continued": continued,
                "keys": keys,
                **{
                    key: _resume(
                        seed, rank, algo, warmup_steps, buffer, range(save_at, total), with_state=key == "resumed"
                    )
                    for key in ("resumed", "without_state")
                },
            }
    return out


def _resume(
    seed: int, rank: int, algo: str, warmup_steps: int, buffer: io.BytesIO, steps: range, with_state: bool
) -> dict:
    """A fresh model and optimizer loaded from the checkpoint in ``buffer`` (``with_state=False``: the weights and
    the optimizer only, not the algorithm state), trained on ``steps``."""
    fresh = make_mlp(seed + 77)
    w, fresh_opt = _wrap(algo, fresh, warmup_steps)
    load_checkpoint(buffer, w, fresh, fresh_opt, with_state)
    step_id = fresh_opt.step_id
    _train(w, fresh_opt, seed, steps, rank)
    w.close()
    return {"params": params_of(fresh), "step_id": step_id}


@scenario
def errors(rank: int) -> dict:
    """Configurations refused when the model is wrapped (every rank makes the same calls)."""
    import bagua_torch
    from bagua_torch.algorithms.qadam import QAdamAlgorithm, QAdamOptimizer

    found = {}
    model = make_mlp(0)
    opt = QAdamOptimizer(model.parameters(), warmup_steps=1)
    found["optimizer_not_wrapped"] = raised(lambda: bagua_torch.with_bagua(model, [], QAdamAlgorithm(opt)))
    other = QAdamOptimizer(make_mlp(0).parameters())
    found["optimizer_of_other_model"] = raised(lambda: bagua_torch.with_bagua(model, [other], QAdamAlgorithm(other)))
    partial = QAdamOptimizer(list(model.parameters())[:2])
    found["optimizer_with_some_parameters"] = raised(
        lambda: bagua_torch.with_bagua(model, [partial], QAdamAlgorithm(partial))
    )
    double = make_mlp(0, torch.float64)
    dopt = QAdamOptimizer(double.parameters())
    found["float64"] = raised(lambda: bagua_torch.with_bagua(double, [dopt], QAdamAlgorithm(dopt)))
    # By name, the one optimizer given is the algorithm's own: none, or another kind, is a clear error.
    found["by_name_without_optimizer"] = raised(lambda: bagua_torch.with_bagua(model, [], "qadam"))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    found["by_name_with_another_optimizer"] = raised(lambda: bagua_torch.with_bagua(model, [sgd], "qadam"))

    # A 1-bit Adam checkpoint whose residuals do not fit this model.
    wrapped, _ = _wrap("onebit_adam", make_mlp(0), 1)
    state = wrapped.state_dict()
    state["_extra_state"]["algorithm_state"]["server_residuals"][0] = torch.zeros(3)
    found["bad_residuals"] = raised(lambda: wrapped.load_state_dict(state))
    wrapped.close()

    # After the warm-up, stepping outside the wrapper (hooks removed by close()) is refused.
    model = make_mlp(0)
    wrapped, opt = _wrap("qadam", model, 1)
    _train(wrapped, opt, 0, range(2), rank)
    wrapped.close()
    x, y = batch(0, 9, rank)
    opt.zero_grad()
    loss_fn(model, x, y).backward()
    found["step_without_algorithm"] = raised(opt.step)
    return found


# ----------------------------------------------------------------------------- jobs


def job(seed: int, scenarios: list[Scenario], local_world_size: int | None = None) -> dict:
    """``scenarios`` on this rank; ``local_world_size`` lays the ranks out as nodes of that many ranks."""
    kwargs = {}
    if local_world_size:
        rank = int(os.environ["RANK"])
        kwargs = {"local_world_size": local_world_size, "local_rank": rank % local_world_size}
    group = setup(**kwargs)
    out = {"rank": group.rank, "size": group.size, "world": type(group.world).__name__}
    out.update(scenario.run(scenarios, seed=seed, rank=group.rank))
    return out

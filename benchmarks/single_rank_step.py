"""The compute of one training step on one rank, with no communication: what the scale model starts from.

Each trial starts a fresh process (one CPU thread, JAX on the CPU with one device, as a study's rank runs) that
trains the network study's and the LM study's models with a plain optimizer, ``--warmup`` untimed steps then
``--steps`` timed ones, each waited for; its figure is the median step. Models: ``mlp`` (the network study's
1.84M-parameter MLP, ``--batch-size`` images, SGD with momentum as the synthetic benchmark), ``gpt-mini`` (the
LM study's GPT, ``--gpt-batch`` windows of 129 bytes, AdamW as the LM study).

    python benchmarks/single_rank_step.py                  # writes benchmarks/results/single-rank-step.{json,md}
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import network_study  # noqa: E402
import synthetic  # noqa: E402
from harness import study  # noqa: E402
from harness.jobs import child_env  # noqa: E402

MODELS = ("mlp", "gpt-mini")
FRONT_ENDS = ("torch", "jax")


def _batch(model: str, batch: int, image_size: int) -> tuple[Any, Any]:
    return synthetic.random_batch(batch, image_size, 0, model)


def time_torch(model: str, batch: int, warmup: int, steps: int) -> list[float]:
    """Seconds of each timed step of ``model`` in torch."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    width, layers, image_size = network_study.MODELS.get(model, (0, 0, 0))
    net = synthetic.torch_model(model, synthetic.init_params(model, image_size, width, layers))
    if model == "mlp":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
    x, y = (torch.from_numpy(a) for a in _batch(model, batch, image_size))
    y = y.long()
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def time_jax(model: str, batch: int, warmup: int, steps: int) -> list[float]:
    """Seconds of each timed step of ``model`` in JAX (jitted, each step waited for)."""
    import jax
    import optax

    width, layers, image_size = network_study.MODELS.get(model, (0, 0, 0))
    params = [jax.numpy.asarray(p) for p in synthetic.init_params(model, image_size, width, layers)]
    loss_fn = synthetic.jax_model(model)
    tx = optax.sgd(0.01, momentum=0.9) if model == "mlp" else optax.adamw(1e-3, weight_decay=0.01)
    data = tuple(jax.numpy.asarray(a) for a in _batch(model, batch, image_size))

    @jax.jit
    def step(params, state):
        grads = jax.grad(loss_fn)(params, data)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    state = (params, tx.init(params))
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        state = jax.block_until_ready(step(*state))
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def worker(argv: list[str]) -> None:
    """One trial's process: ``FRONT_END MODEL BATCH WARMUP STEPS``; prints the timed steps' seconds (JSON)."""
    front_end, model, batch, warmup, steps = argv
    timer = time_torch if front_end == "torch" else time_jax
    print(json.dumps(timer(model, int(batch), int(warmup), int(steps))))


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--batch-size", type=int, default=32, help="images per step (mlp)")
    p.add_argument("--gpt-batch", type=int, default=1, help="windows of 129 bytes per step (gpt-mini)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)


def variants(args: argparse.Namespace) -> list[study.Variant]:
    return [
        study.Variant(f"{fe} {model}", {"front_end": fe, "model": model}) for model in args.models for fe in FRONT_ENDS
    ]


def measure(trial: study.Trial) -> dict[str, Any]:
    args, v = trial.args, trial.variant
    batch = args.gpt_batch if v["model"].startswith("gpt-") else args.batch_size
    argv = [
        sys.executable,
        __file__,
        "--worker",
        v["front_end"],
        v["model"],
        str(batch),
        str(args.warmup),
        str(args.steps),
    ]
    done = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=600)
    if done.returncode:
        return {"status": "failed", "log_tail": done.stderr.splitlines()[-8:]}
    times = json.loads(done.stdout.splitlines()[-1])
    return {"status": "ok", "step_s": statistics.median(times), "step_s_all": times, "batch": batch}


STUDY = study.Study(
    name="single-rank-step",
    title="One rank's training step, no communication",
    description=__doc__,
    variants=variants,
    measure=measure,
    ranks=(1,),
    repeats=3,
    network=False,
    add_options=add_options,
    plot=False,
    worker=worker,
)


if __name__ == "__main__":
    sys.exit(study.main(STUDY))

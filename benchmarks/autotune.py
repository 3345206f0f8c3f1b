"""Tuned against default bucket size, on shaped links: what in-band autotuning buys (or not).

Each front end (``--front-end``) and rate runs one job of ``--ranks`` ranks, each in its own
network namespace of ``benchmarks/harness/links.py`` with a token-bucket-shaped link. Every rank
trains two copies of the network study's MLP (1.84M parameters) with gradient allreduce: one with
the default 10 MiB buckets, one with ``autotune="once"``.

* torch: gloo ranks, ``with_bagua``. The tuned copy first trains until its tuner has decided
  (the tuning steps are training steps).
* JAX: ``DataParallel`` over the native MPI communicator (``bagua-launch --mpi``, as the README's
  jobs run). ``init`` tunes before the first step, on the communication-only program; the tuning
  cost is the steps of those programs, the seconds spent compiling them and the tuned ``init``'s
  wall time against the default's.

Then the two copies alternate, ``--steps`` timed steps each, ``--repeats`` times (ABAB, the order
flipped every repeat), so both see the same machine load. The ratio default/tuned per repeat gives
the mean and a 95% interval (t distribution). Results: ``autotune-torch.md`` / ``autotune-jax.md``
(and ``.json``). Root only (namespaces)::

    sudo python benchmarks/autotune.py --rates 100mbit,1gbit --front-end jax
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from harness import links as nh
from harness.jobs import child_env
from harness.results import RESULTS, finish_meta, header_lines, run_meta, write_results

from bagua_common.job.local_launch import free_port

FRONT_ENDS = ("torch", "jax")
PACKAGES = {"torch": ["torch", "numpy"], "jax": ["jax", "jaxlib", "optax", "numpy"]}
# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom.
T95 = [12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12, 2.11, 2.10]
MLP_DIMS = (3072, 512, 512, 10)
BATCH = 32


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t interval of ``ratios``."""
    mean = statistics.fmean(ratios)
    if len(ratios) < 2:
        return mean, math.nan, math.nan
    half = T95[min(len(ratios) - 2, len(T95) - 1)] * statistics.stdev(ratios) / math.sqrt(len(ratios))
    return mean, mean - half, mean + half


def alternate(train: Callable[[str, int], float], args: argparse.Namespace) -> list[dict[str, float]]:
    """``args.repeats`` blocks of ``args.steps`` steps per variant, ABAB with the order flipped every repeat."""
    rows = []
    for repeat in range(args.repeats):
        order = ("default", "tuned") if repeat % 2 == 0 else ("tuned", "default")
        rows.append({name: train(name, args.steps) for name in order})
    return rows


def worker_torch(args: argparse.Namespace) -> None:
    import os

    import torch
    from torch import nn

    import bagua_torch

    torch.set_num_threads(1)
    bagua_torch.init_process_group(timeout=300)
    rank = int(os.environ["RANK"])

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        layers = [nn.Linear(a, b) for a, b in zip(MLP_DIMS, MLP_DIMS[1:])]
        return nn.Sequential(layers[0], nn.ReLU(), layers[1], nn.ReLU(), layers[2])

    models = {
        "default": bagua_torch.with_bagua(mlp(), [], "gradient_allreduce", autotune="off"),
        "tuned": bagua_torch.with_bagua(mlp(), [], "gradient_allreduce", autotune="once"),
    }
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    x, y = torch.randn(BATCH, MLP_DIMS[0]), torch.randint(0, MLP_DIMS[-1], (BATCH,))

    def train(name: str, steps: int) -> float:
        model, optimizer = models[name], optimizers[name]
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        model.wait_gradients()
        return (time.perf_counter() - start) / steps

    tuning_steps = 0
    while not models["tuned"].bucket_tuner.finished and tuning_steps < args.max_tuning_steps:
        train("tuned", 1)
        tuning_steps += 1
    rows = alternate(train, args)
    if rank == 0:
        Path(args.result).write_text(
            json.dumps(
                {
                    "tuning_steps": tuning_steps,
                    "tuned_bucket_bytes": models["tuned"].bucket_bytes,
                    "default_bucket_bytes": models["default"].bucket_bytes,
                    "finished": models["tuned"].bucket_tuner.finished,
                    "repeats": rows,
                }
            )
        )


def worker_jax(args: argparse.Namespace) -> None:
    from unittest import mock

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from bagua_jax import NativeCommunicator
    from bagua_jax.algorithms import GradientAllReduce
    from bagua_jax.trainer import DataParallel

    comm = NativeCommunicator.world(timeout=300)
    rng = np.random.default_rng(0)
    params = [
        {"w": (rng.standard_normal((a, b)) / math.sqrt(a)).astype(np.float32), "b": np.zeros(b, np.float32)}
        for a, b in zip(MLP_DIMS, MLP_DIMS[1:])
    ]
    data = np.random.default_rng([1, int(comm.rank())])  # each rank its own batch (DataParallel refuses one for all)
    batch = (
        jnp.asarray(data.standard_normal((BATCH, MLP_DIMS[0])), jnp.float32),
        jnp.asarray(data.integers(0, MLP_DIMS[-1], BATCH), jnp.int32),
    )

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        x, labels = batch
        for layer in params[:-1]:
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        logits = x @ params[-1]["w"] + params[-1]["b"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    trainers = {
        name: DataParallel(loss_fn, optax.sgd(0.01), GradientAllReduce(), communicator=comm, autotune=mode)
        for name, mode in (("default", "off"), ("tuned", "once"))
    }
    states, init_s = {}, {}
    for name, trainer in trainers.items():
        # Counts the steps of the communication-only programs that init times (spied, not replaced).
        with mock.patch.object(DataParallel, "step", autospec=True, side_effect=DataParallel.step) as steps:
            start = time.perf_counter()
            states[name] = trainer.init(params)
            init_s[name] = time.perf_counter() - start
        if name == "tuned":
            tuning_steps = steps.call_count
        states[name], _ = jax.block_until_ready(trainer.step(states[name], batch))  # compiles the step, untimed

    def train(name: str, steps: int) -> float:
        state = states[name]
        start = time.perf_counter()
        for _ in range(steps):
            state, loss = trainers[name].step(state, batch)
        jax.block_until_ready((state, loss))
        states[name] = state
        return (time.perf_counter() - start) / steps

    rows = alternate(train, args)
    tuning = trainers["tuned"].bucket_tuning
    if int(comm.rank()) == 0:
        Path(args.result).write_text(
            json.dumps(
                {
                    "tuning_steps": tuning_steps,
                    "tuning_compile_s": tuning.compile_s,
                    "init_s": init_s,
                    "candidate_medians_s": {str(b): s for b, s in tuning.medians_s.items()},
                    "tuned_bucket_bytes": trainers["tuned"].algorithm.bucket_bytes,
                    "default_bucket_bytes": trainers["default"].algorithm.bucket_bytes,
                    "repeats": rows,
                }
            )
        )
    comm.barrier(jnp.zeros((), jnp.float32))


def run_rate(args: argparse.Namespace, front_end: str, rate: int) -> dict[str, Any]:
    """One job of ``args.ranks`` ranks of ``front_end`` on links of ``rate``: the workers' result and the ratio."""
    with tempfile.TemporaryDirectory() as tmp, nh.Network(args.ranks, rate, verbose=False) as net:
        result = Path(tmp) / "result.json"
        command = [sys.executable, __file__, "--worker", front_end, "--result", str(result)]
        command += ["--steps", str(args.steps), "--repeats", str(args.repeats)]
        command += ["--max-tuning-steps", str(args.max_tuning_steps)]
        env = {**child_env(), "BAGUA_AUTOTUNE_CACHE": str(Path(tmp) / "autotune.json")}
        print(f"{front_end}, {nh.rate_label(rate)}: {args.ranks} ranks ...", flush=True)
        if front_end == "jax":
            codes = net.run_mpi(command, timeout=1800, base_env=env)
        else:
            codes = net.run_all(command, free_port(), timeout=1800, base_env=env)
        if not result.exists() or codes != [0] * args.ranks:
            raise SystemExit(f"{front_end}, {nh.rate_label(rate)}: the job failed, exit codes {codes}")
        run = json.loads(result.read_text())
    mean, low, high = interval([r["default"] / r["tuned"] for r in run["repeats"]])
    print(f"  tuned {run['tuned_bucket_bytes']} B: default/tuned {mean:.3f} [{low:.3f}, {high:.3f}]", flush=True)
    return {"rate": nh.rate_label(rate), **run, "ratio_mean": mean, "ratio_ci95": [low, high]}


def report(args: argparse.Namespace, front_end: str, meta: dict[str, Any], results: list[dict[str, Any]]) -> None:
    """Write ``autotune-<front_end>.md`` and ``.json``."""
    title = {"torch": "torch, gradient allreduce, gloo", "jax": "JAX, gradient allreduce, native MPI communicator"}
    lines = [f"# Autotuned bucket size against the default ({title[front_end]})", "", *header_lines(meta)]
    lines.append(
        f"- {args.ranks} ranks, one network namespace each; the study's MLP (1.84M parameters), batch {BATCH} per "
        f"rank; {args.repeats} alternating blocks of {args.steps} steps per variant"
    )
    jax_cost = front_end == "jax"
    if jax_cost:
        lines.append(
            "- tuning steps: steps of the communication-only programs run by `init` (each candidate's first one "
            "compiles it); compile s: their compile seconds (`bucket_tuning.compile_s`); init s: the tuned and the "
            "default trainer's `init` wall time"
        )
    cost_head = " tuning steps | compile s | init s tuned / default |" if jax_cost else " tuning steps |"
    lines += [
        "",
        f"| link | default bucket | tuned bucket |{cost_head} default ms/step | tuned ms/step "
        "| default/tuned (95% CI) |",
        "|---|---:|---:|" + "---:|" * (3 if jax_cost else 1) + "---:|---:|---|",
    ]
    for r in results:
        default = statistics.median(x["default"] for x in r["repeats"]) * 1e3
        tuned = statistics.median(x["tuned"] for x in r["repeats"]) * 1e3
        cost = f" {r['tuning_steps']} |"
        if jax_cost:
            cost += f" {r['tuning_compile_s']:.1f} | {r['init_s']['tuned']:.1f} / {r['init_s']['default']:.1f} |"
        lines.append(
            f"| {r['rate']} | {r['default_bucket_bytes'] >> 20} MiB | {r['tuned_bucket_bytes'] >> 20} MiB |{cost} "
            f"{default:.1f} | {tuned:.1f} | {r['ratio_mean']:.3f} "
            f"[{r['ratio_ci95'][0]:.3f}, {r['ratio_ci95'][1]:.3f}] |"
        )
    lines += [
        "",
        "A ratio above 1 means the tuned bucket size is faster. The 4 ranks share 2 cores (see the load "
        "averages); an interval that holds 1 is no measured gain.",
        "",
    ]
    md, _ = write_results(args.out, f"autotune-{front_end}", lines, {"meta": meta, "results": results})
    print(f"wrote {md}")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--front-end", choices=[*FRONT_ENDS, "both"], default="both")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rates", default="100mbit,1gbit", help="comma-separated link rates")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per block")
    parser.add_argument("--repeats", type=int, default=8, help="alternating blocks per variant")
    parser.add_argument("--max-tuning-steps", type=int, default=400, help="torch: give up tuning after this many steps")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", choices=FRONT_ENDS, help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        {"torch": worker_torch, "jax": worker_jax}[args.worker](args)
        return
    nh.require_root()
    for front_end in FRONT_ENDS if args.front_end == "both" else (args.front_end,):
        meta = run_meta(PACKAGES[front_end], argv=argv, ranks=args.ranks)
        results = [run_rate(args, front_end, nh.parse_rate(rate)) for rate in args.rates.split(",")]
        finish_meta(meta)
        report(args, front_end, meta, results)


if __name__ == "__main__":
    main(sys.argv[1:])

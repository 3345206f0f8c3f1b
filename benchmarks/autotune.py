"""Tuned against default bucket size, on shaped links: what in-band autotuning buys (or not).

Each rate runs one job of ``--ranks`` torch ranks (gloo), each in its own network namespace of
``benchmarks/network_harness.py`` with a token-bucket-shaped link. Every rank wraps two copies
of the network study's MLP (1.84M parameters) with gradient allreduce: one with the default
10 MiB buckets, one with ``autotune="once"``. The tuned copy first trains until its tuner has
decided; then the two alternate, ``--steps`` timed steps each, ``--repeats`` times (ABAB, the
order flipped every repeat), so both see the same machine load. The ratio default/tuned per
repeat gives the mean and a 95% interval (t distribution). Root only (namespaces)::

    sudo python benchmarks/autotune.py --rates 100mbit,1gbit
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import _common
import network_harness as nh

# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom.
T95 = [12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12, 2.11, 2.10]


def interval(ratios: list[float]) -> tuple[float, float, float]:
    """Mean and 95% t interval of ``ratios``."""
    mean = statistics.fmean(ratios)
    if len(ratios) < 2:
        return mean, math.nan, math.nan
    half = T95[min(len(ratios) - 2, len(T95) - 1)] * statistics.stdev(ratios) / math.sqrt(len(ratios))
    return mean, mean - half, mean + half


def worker(args: argparse.Namespace) -> None:
    import os

    import torch
    from torch import nn

    import bagua_torch

    torch.set_num_threads(1)
    bagua_torch.init_process_group(timeout=300)
    rank = int(os.environ["RANK"])

    def mlp() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3072, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    models = {
        "default": bagua_torch.with_bagua(mlp(), [], "gradient_allreduce", autotune="off"),
        "tuned": bagua_torch.with_bagua(mlp(), [], "gradient_allreduce", autotune="once"),
    }
    optimizers = {k: torch.optim.SGD(m.parameters(), lr=0.01) for k, m in models.items()}
    x, y = torch.randn(32, 3072), torch.randint(0, 10, (32,))

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
    rows = []
    for repeat in range(args.repeats):
        order = ("default", "tuned") if repeat % 2 == 0 else ("tuned", "default")
        rows.append({name: train(name, args.steps) for name in order})
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


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--rates", default="100mbit,1gbit", help="comma-separated link rates")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per block")
    parser.add_argument("--repeats", type=int, default=8, help="alternating blocks per variant")
    parser.add_argument("--max-tuning-steps", type=int, default=400)
    parser.add_argument("--out", type=Path, default=_common.RESULTS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    nh.require_root()
    meta = _common.run_meta(argv, _common.device_info("cpu"), ["torch", "numpy"], ranks=args.ranks)
    results = []
    for rate_text in args.rates.split(","):
        rate = nh.parse_rate(rate_text)
        with tempfile.TemporaryDirectory() as tmp, nh.Network(args.ranks, rate, verbose=False) as net:
            result = Path(tmp) / "result.json"
            cache = Path(tmp) / "autotune.json"
            command = [sys.executable, __file__, "--worker", "--result", str(result)]
            command += ["--steps", str(args.steps), "--repeats", str(args.repeats)]
            command += ["--max-tuning-steps", str(args.max_tuning_steps)]
            base = {**__import__("os").environ, "BAGUA_AUTOTUNE_CACHE": str(cache)}
            print(f"{nh.rate_label(rate)}: {args.ranks} ranks ...", flush=True)
            codes = net.run_all(command, _common.free_port(), timeout=1800, base_env=base)
            if codes != [0] * args.ranks:
                raise SystemExit(f"{nh.rate_label(rate)}: the job failed, exit codes {codes}")
            run = json.loads(result.read_text())
        ratios = [r["default"] / r["tuned"] for r in run["repeats"]]
        mean, low, high = interval(ratios)
        results.append({"rate": nh.rate_label(rate), **run, "ratio_mean": mean, "ratio_ci95": [low, high]})
        print(f"  tuned {run['tuned_bucket_bytes']} B: default/tuned {mean:.3f} [{low:.3f}, {high:.3f}]", flush=True)
    _common.finish_meta(meta)
    lines = ["# Autotuned bucket size against the default (torch, gradient allreduce)", "", *_common.header_lines(meta)]
    lines += [
        f"- {args.ranks} ranks, one network namespace each; the study's MLP (1.84M parameters); "
        f"{args.repeats} alternating blocks of {args.steps} steps per variant",
        "",
        "| link | default bucket | tuned bucket | tuning steps | default ms/step | tuned ms/step | default/tuned (95% CI) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        default = statistics.median(x["default"] for x in r["repeats"]) * 1e3
        tuned = statistics.median(x["tuned"] for x in r["repeats"]) * 1e3
        lines.append(
            f"| {r['rate']} | {r['default_bucket_bytes'] >> 20} MiB | {r['tuned_bucket_bytes'] >> 20} MiB | "
            f"{r['tuning_steps']} | {default:.1f} | {tuned:.1f} | {r['ratio_mean']:.3f} "
            f"[{r['ratio_ci95'][0]:.3f}, {r['ratio_ci95'][1]:.3f}] |"
        )
    lines += [
        "",
        "A ratio above 1 means the tuned bucket size is faster. The 4 ranks share 2 cores (see the load "
        "averages); an interval that holds 1 is no measured gain.",
        "",
    ]
    md, _ = _common.write_results(args.out, "autotune-torch", lines, {"meta": meta, "results": results})
    print(f"wrote {md}")


if __name__ == "__main__":
    main(sys.argv[1:])

"""The LM study's settings search: throughput of the candidate GPTs, and learning-rate sweeps of DDP fp32's math.

DDP fp32 over 4 ranks of B windows is, up to rounding, one process over the 4B windows of the 4 ranks (DDP
averages the ranks' gradients of their mean losses; one process takes the gradient of the mean over all of them):
the sweep trains that one process, with torch's AdamW and the schedule of ``lm_study_settings.Schedule``, on the
tokens the 4 ranks would see (``Corpus.batch(seed, step, rank, B, context + 1)`` for ranks 0-3), and evaluates the
held-out loss every ``--eval-every`` steps. Each run is kept in the JSON as soon as it is done; a rerun skips the
runs already there.

    python benchmarks/lm_study_sweep.py throughput --sizes tiny mini small --windows 1 2 4
    python benchmarks/lm_study_sweep.py run --size mini --windows 2 --steps 2000 --lr 1e-3 2e-3 4e-3 --warmup 100
    python benchmarks/lm_study_sweep.py report
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from lm_study_settings import RANKS, Schedule  # noqa: E402

RESULTS = HERE / "results"
NAME = "lm-study-sweep"
QUIET_LOAD = 1.5
"""The highest 1-minute load at which a throughput figure is published."""


def gpt_size(name: str) -> Any:
    """A GPT size by name (``small``) or a candidate spelled ``LAYERSxWIDTHxHEADSxCONTEXT`` (``4x128x4x128``)."""
    from bagua_common.workload import GPTConfig, gpt_config

    parts = name.split("x")
    if len(parts) == 4 and all(part.isdigit() for part in parts):
        layers, width, heads, context = map(int, parts)
        return GPTConfig(name, layers=layers, width=width, heads=heads, context=context)
    return gpt_config(name)


def _load_average() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def throughput(size: str, windows: int, threads: int, steps: int, seed: int = 0) -> dict[str, Any]:
    """Tokens per second of one process training ``size`` on ``windows`` windows per step with ``threads`` threads
    (forward, backward and AdamW; the median of ``steps`` steps after two untimed ones)."""
    import torch

    from bagua_common.workload import init_gpt_params, load_corpus
    from bagua_torch.models.gpt import GPT, next_token_loss

    torch.set_num_threads(threads)
    config = gpt_size(size)
    corpus, length = load_corpus(), config.context + 1
    model = GPT(config, init_gpt_params(config, seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(steps + 2):
        batch = torch.from_numpy(corpus.batch(seed, step, 0, windows, length))
        begin = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        next_token_loss(model(batch[:, :-1]), batch).backward()
        optimizer.step()
        times.append(time.perf_counter() - begin)
    step_s = float(np.median(times[2:]))
    return {
        "size": size,
        "parameters": config.parameter_count,
        "windows": windows,
        "threads": threads,
        "step_ms": round(1e3 * step_s, 2),
        "tokens_per_s": round(windows * config.context / step_s),
    }


def train(run: dict[str, Any]) -> dict[str, Any]:
    """One run of DDP fp32's math in one process (see the module docstring): its held-out curve and wall time."""
    import torch

    from bagua_common.workload import init_gpt_params, load_corpus
    from bagua_torch.models.gpt import GPT, next_token_loss

    torch.set_num_threads(run["threads"])
    config = gpt_size(run["size"])
    corpus, length = load_corpus(), config.context + 1
    heldout = torch.from_numpy(corpus.heldout_batch(run["heldout_windows"], length))
    schedule = Schedule(**run["schedule"])
    model = GPT(config, init_gpt_params(config, run["seed"]))
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=schedule.peak, betas=tuple(run["betas"]), weight_decay=run["weight_decay"]
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor)

    def evaluate() -> float:
        with torch.no_grad():
            return next_token_loss(model(heldout[:, :-1]), heldout).item()

    curve, start, load_before = [[0, evaluate()]], time.perf_counter(), _load_average()
    for step in range(schedule.total):
        tokens = np.concatenate(
            [corpus.batch(run["seed"], step, rank, run["windows"], length) for rank in range(run["ranks"])]
        )
        batch = torch.from_numpy(tokens)
        optimizer.zero_grad(set_to_none=True)
        next_token_loss(model(batch[:, :-1]), batch).backward()
        optimizer.step()
        scheduler.step()
        if (step + 1) % run["eval_every"] == 0 or step + 1 == schedule.total:
            curve.append([step + 1, evaluate()])
            if len(curve) % 10 == 1:
                print(f"  step {step + 1}: {curve[-1][1]:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
            if not np.isfinite(curve[-1][1]):
                break
    return {
        **run,
        "curve": curve,
        "final_loss": curve[-1][1],
        "wall_s": round(time.perf_counter() - start, 1),
        "load": [load_before, _load_average()],
    }


def run_name(run: dict[str, Any]) -> str:
    s = run["schedule"]
    return (
        f"{run['size']}-w{run['windows']}x{run['ranks']}-{s['kind']}-lr{s['peak']:g}-wu{s['warmup']}-"
        f"{s['total']}steps-b{run['betas'][1]:g}-wd{run['weight_decay']:g}"
    )


def _keep(path: Path, section: str, key: str, value: dict[str, Any]) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault(section, {})[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def report(out: Path) -> None:
    """``lm-study-sweep.md`` and ``.png``: the throughput table, every run's figures, the curves with the held-out
    text's unigram and bigram entropies."""
    from harness import plots
    from harness.results import table, write_results
    from lm_study_report import steps_to

    from bagua_common.workload import load_corpus

    data = json.loads((out / f"{NAME}.json").read_text())
    entropies = load_corpus().heldout_entropies()
    lines = ["# LM study: the settings search", "", __doc__.split("\n\n")[1].replace("\n", " "), ""]
    lines += [f"Held-out text: unigram entropy {entropies.unigram:.4f}, bigram conditional entropy "
              f"{entropies.bigram:.4f} nats/byte.", ""]  # fmt: skip
    if data.get("throughput"):
        lines += ["## Throughput: one process, forward + backward + AdamW", ""]
        rows = [r for r in data["throughput"].values() if r["load"] <= QUIET_LOAD]
        lines += [f"Only the measurements taken at a 1-minute load <= {QUIET_LOAD} (the JSON keeps every one).", ""]
        head = ["size", "parameters", "windows", "threads", "ms/step", "tokens/s", "1-min load"]
        lines += table(head, [[r[k] for k in ("size", "parameters", "windows", "threads", "step_ms",
                                                "tokens_per_s", "load")] for r in rows]) + [""]  # fmt: skip
    runs = data.get("runs", {})
    goals = {"bigram": entropies.bigram, "2.0": 2.0, "1.9": 1.9}
    head = ["run", "tokens/step", "final loss", "best loss", *(f"steps to {g}" for g in goals), "1-min load"]
    cells = []
    for name, run in runs.items():
        tokens = run["windows"] * run["ranks"] * gpt_size(run["size"]).context
        cells.append([name, tokens, f"{run['final_loss']:.4f}", f"{min(x for _, x in run['curve']):.4f}",
                      *(_steps(steps_to(run["curve"], g)) for g in goals.values()),
                      "-".join(f"{x:.1f}" for x in run["load"])])  # fmt: skip
    lines += ["## Runs (DDP fp32's math in one process)", "", *table(head, cells), "", *_ddp_check(out, runs), "",
              f"![curves]({NAME}.png)"]  # fmt: skip
    write_results(out, NAME, lines, data)
    sizes = sorted({run["size"] for run in runs.values()})
    drawn = plots.figure(1, max(1, len(sizes)), size=(7, 5))
    if drawn is None or not sizes:
        return
    fig, axes = drawn
    for ax, size in zip(axes[0], sizes):
        mine = {n: r for n, r in runs.items() if r["size"] == size}
        plots.curves(ax, {n.removeprefix(size + "-"): ([p[0] * r["windows"] * r["ranks"] * gpt_size(size).context
                                                       / 1e6 for p in r["curve"]], [p[1] for p in r["curve"]])
                          for n, r in mine.items()})  # fmt: skip
        plots.references(ax, {"unigram entropy": entropies.unigram, "bigram entropy": entropies.bigram})
        ax.set_ylim(1.6, 3.6)
        ax.set_xlabel("tokens (millions)")
        ax.set_ylabel("held-out loss (nats per byte)")
        ax.set_title(f"GPT {size}")
        ax.legend(fontsize=6)
    plots.save(fig, out / f"{NAME}.png")


def _ddp_check(out: Path, runs: dict[str, Any]) -> list[str]:
    """The one check that one process computes DDP's numbers: the study's DDP fp32 run on 4 ranks against the run
    here with the same settings, at every evaluation."""
    from lm_study_report import check_gap

    study = out / "lm-study.json"
    ddp = json.loads(study.read_text()).get("train", {}).get("torch/ddp") if study.exists() else None
    if not ddp or ddp.get("status") != "ok":
        return ["(the study's DDP fp32 run is not there yet: no check of one process against 4 ranks)"]
    settings = json.loads(study.read_text())["settings"]
    keys = ("size", "windows", "ranks", "schedule", "betas", "weight_decay", "heldout_windows", "eval_every", "seed")
    for name, run in runs.items():
        if all(run[k] == settings[k] for k in keys):
            gap = check_gap(run["curve"], ddp["curve"])
            return [f"Check: DDP fp32 on 4 ranks (the study's `torch/ddp`) against `{name}` in one process: largest "
                    f"gap {gap:.2g} nats/byte over {len(run['curve']) - 1} evaluations (final {ddp['final_loss']:.4f} "
                    f"against {run['final_loss']:.4f})."]  # fmt: skip
    return ["(no run here has the study's settings: no check of one process against 4 ranks)"]


def _steps(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__)
    p.add_argument("--out", type=Path, default=RESULTS)
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("throughput", help="tokens/s of one process for candidate sizes")
    t.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    t.add_argument("--windows", nargs="+", type=int, default=[4, 8])
    t.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    t.add_argument("--steps", type=int, default=8)
    r = sub.add_parser("run", help="train DDP fp32's math in one process, one run per learning rate")
    r.add_argument("--size", required=True)
    r.add_argument("--windows", type=int, required=True, help="windows per rank and step (4 ranks)")
    r.add_argument("--steps", type=int, required=True)
    r.add_argument("--lr", nargs="+", type=float, required=True, help="peak learning rates")
    r.add_argument("--warmup", type=int, default=100)
    r.add_argument("--kind", choices=["cosine", "constant"], default="cosine")
    r.add_argument("--final-ratio", type=float, default=0.1)
    r.add_argument("--b2", type=float, default=0.95)
    r.add_argument("--weight-decay", type=float, default=0.1)
    r.add_argument("--eval-every", type=int, default=50)
    r.add_argument("--heldout-windows", type=int, default=128)
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--seed", type=int, default=0)
    sub.add_parser("report", help="md + png from the json")
    args = p.parse_args(argv)
    path = args.out / f"{NAME}.json"
    if args.command == "report":
        report(args.out)
        return 0
    if args.command == "throughput":
        for size in args.sizes:
            for windows in args.windows:
                for threads in args.threads:
                    row = {**throughput(size, windows, threads, args.steps), "load": _load_average()}
                    print(json.dumps(row), flush=True)
                    _keep(path, "throughput", f"{size}-w{windows}-t{threads}", row)
        return 0
    for lr in args.lr:
        run = {
            "size": args.size,
            "windows": args.windows,
            "ranks": RANKS,
            "schedule": vars(Schedule(lr, args.warmup, args.steps, args.kind, args.final_ratio)),
            "betas": [0.9, args.b2],
            "weight_decay": args.weight_decay,
            "eval_every": args.eval_every,
            "heldout_windows": args.heldout_windows,
            "threads": args.threads,
            "seed": args.seed,
        }
        name = run_name(run)
        done = json.loads(path.read_text()).get("runs", {}) if path.exists() else {}
        if name in done:
            print(f"{name}: kept ({done[name]['final_loss']:.4f})", flush=True)
            continue
        result = train(run)
        _keep(path, "runs", name, result)
        losses = " ".join(f"{s}:{loss:.3f}" for s, loss in result["curve"][:: max(1, len(result["curve"]) // 8)])
        print(f"{name}: {result['final_loss']:.4f} in {result['wall_s']} s (pid {os.getpid()}) [{losses}]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

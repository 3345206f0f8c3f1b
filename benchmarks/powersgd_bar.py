"""PowerSGD's bar: ours against DDP's ``powerSGD_hook``, rank 4, over shaped links, interleaved and repeated.

On the network study's links (4 ranks at ``--links``, 100 Mbit/s by default) each repeat runs, in an order rotated
from repeat to repeat, :mod:`network_study`'s job for:

* torch DDP (gloo) + ``powerSGD_hook`` rank 4 (error feedback, warm start, one bucket; the study's configuration),
* ``bagua_torch`` PowerSGD rank 4 (``with_bagua`` over gloo),
* ``bagua_jax`` PowerSGD rank 4 (``DataParallel`` over the native MPI engine),

on ``--models``: ``gpt-small`` (the project's GPT, windows of 129 corpus bytes, ``--gpt-batch`` per rank) and
``mlp`` (the study's 1.84M-parameter MLP, ``--batch-size`` images). Both PowerSGDs and the hook run the same exact
warm-up, over before the timed iterations.

Per front end: the ratio of the hook's step time to ours, paired by repeat (median and range) and pooled (the
ratio of the medians of all timed iterations, with a bootstrap 95% interval). The bar, at least 1.2x, is met
where that whole interval is at or above it, missed where it is all below, unresolved otherwise. Where a front end
does not meet it, the run then prints the step's breakdown from :mod:`powersgd_breakdown` with its command.

    python benchmarks/powersgd_bar.py                               # gpt-small and mlp, 100 Mbit/s, 3 repeats
    python benchmarks/powersgd_bar.py --models gpt-small --repeats 5
    python benchmarks/powersgd_bar.py --report --name powersgd-bar  # the report again from the JSON
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import network_study  # noqa: E402
from harness import results, study  # noqa: E402
from harness.repeats import spread  # noqa: E402

HOOK = ("torch", "ddp_powersgd_rank4")
OURS = {"torch": ("torch", "powersgd_rank4"), "jax": ("jax", "powersgd_rank4")}
BAR = 1.2
MODELS = ("gpt-small", "mlp")


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--gpt-batch", type=int, default=2, help="windows of 129 bytes per rank and step (gpt-small)")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank and step (mlp)")
    network_study.add_job_options(p, job_timeout=300)


def variants(args: argparse.Namespace) -> list[study.Variant]:
    return [
        study.Variant(f"{fw}/{alg} {model}", {"framework": fw, "algorithm": alg, "model": model})
        for model in args.models
        for fw, alg in (HOOK, *OURS.values())
    ]


def measure(trial: study.Trial) -> dict[str, Any]:
    """:func:`network_study.run_job` with the batch of the variant's model, no digits training."""
    args = trial.args
    batch = args.gpt_batch if trial.variant["model"] in network_study.GPT_MODELS else args.batch_size
    job_args = argparse.Namespace(**{**vars(args), "batch_size": batch, "jax_comm": "mpi", "convergence_steps": 0})
    return network_study.run_job(job_args, trial.net, trial.variant, trial.scratch(), convergence=False)


def _upgraded(row: dict[str, Any]) -> dict[str, Any]:
    """A row of a results file written before the harness (``load_average`` before the job, no load gate)."""
    if "variant" in row:
        return row
    return {**network_study.upgraded(row), "load": {"load_before": row["load_average"][0], "published": True}}


def bootstrap_ratio(hook: list[float], ours: list[float], draws: int = 2000) -> tuple[float, float]:
    """A 95% interval of median(hook) / median(ours), resampling each side's timed iterations."""
    rng = np.random.default_rng(0)
    a, b = np.asarray(hook), np.asarray(ours)
    ratios = np.median(rng.choice(a, (draws, a.size)), 1) / np.median(rng.choice(b, (draws, b.size)), 1)
    return float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def verdict(interval: tuple[float, float]) -> str:
    """ "met" where the whole 95% interval of hook / ours is at or above the bar, "missed" where it is all below,
    "unresolved" where the machine's noise leaves it either way."""
    low, high = interval
    return "met" if low >= BAR else "missed" if high < BAR else "unresolved"


def summarize(rows: list[dict[str, Any]], models: list[str]) -> list[dict[str, Any]]:
    """Per model and front end: each side's step times and the hook / ours ratios (see the module docstring)."""
    rows = [_upgraded(r) for r in rows]

    def published(model: str, variant: tuple[str, str]) -> list[dict[str, Any]]:
        return [
            r
            for r in rows
            if (r["model"], r["framework"], r["algorithm"]) == (model, *variant)
            and r["status"] == "ok"
            and r.get("load", {}).get("published", True)
        ]

    out = []
    for model in models:
        hook = published(model, HOOK)
        for framework, variant in OURS.items():
            ours = published(model, variant)
            if not hook or not ours:
                out.append({"model": model, "framework": framework, "status": "missing"})
                continue
            by_repeat = {r["repeat"]: r["step_s"] for r in hook}
            paired = [by_repeat[r["repeat"]] / r["step_s"] for r in ours if r["repeat"] in by_repeat]
            hook_all = [s for r in hook for s in r["step_s_all"]]
            ours_all = [s for r in ours for s in r["step_s_all"]]
            interval = bootstrap_ratio(hook_all, ours_all)
            out.append(
                {
                    "model": model,
                    "framework": framework,
                    "status": "ok",
                    "hook_ms": [r["step_s"] * 1e3 for r in hook],
                    "ours_ms": [r["step_s"] * 1e3 for r in ours],
                    "hook_bytes": statistics.median(r["bytes_sent_per_step"] for r in hook),
                    "ours_bytes": statistics.median(r["bytes_sent_per_step"] for r in ours),
                    "paired_ratios": paired,
                    "pooled_ratio": statistics.median(hook_all) / statistics.median(ours_all),
                    "pooled_interval": interval,
                    "verdict": verdict(interval),
                }
            )
    return out


def table_lines(summary: list[dict[str, Any]]) -> list[str]:
    head = [
        "model",
        "front end",
        "DDP + powerSGD_hook ms/step",
        "ours ms/step",
        "bytes/step/rank hook / ours",
        "hook / ours by repeat",
        "pooled hook / ours [95%]",
        "bar 1.2x",
    ]
    cells = []
    for s in summary:
        if s["status"] != "ok":
            cells.append([s["model"], s["framework"], "", "", "", "", "", s["status"]])
            continue
        low, high = s["pooled_interval"]
        cells.append(
            [
                s["model"],
                s["framework"],
                spread(s["hook_ms"]).format(".0f"),
                spread(s["ours_ms"]).format(".0f"),
                f"{s['hook_bytes'] / 1e3:.0f} kB / {s['ours_bytes'] / 1e3:.0f} kB",
                spread(s["paired_ratios"]).format(".2f", "x"),
                f"{s['pooled_ratio']:.2f}x [{low:.2f}, {high:.2f}]",
                s["verdict"],
            ]
        )
    return results.table(head, cells, "llrrrrrl")


def report(data: dict[str, Any]) -> list[str]:
    settings = data["settings"]
    loads = [r["load_average"][0] for r in data["rows"] if "load_average" in r]
    lines = [
        f"- {settings['repeats']} repeats, variants interleaved in a rotated order; per job {settings['warmup_iters']}"
        f" untimed + {settings['iters']} timed iterations of {settings['batches_per_iter']} steps; per rank batch: "
        f"{settings['gpt_batch']} windows of 129 bytes (gpt-small), {settings['batch_size']} images (mlp); warm-up "
        "exact steps over before the timed iterations; DDP's hook in one bucket as in the network study",
        *(
            [
                f"- 1-minute load average before each job (recorded before the load gate): median "
                f"{statistics.median(loads):.1f}, range [{min(loads):.1f}, {max(loads):.1f}]"
            ]
            if loads
            else []
        ),
        "- ms/step: median over repeats [range]; ratios > 1 mean ours is faster",
        "",
        *table_lines(summarize(data["rows"], settings["models"])),
        "",
        "Verdict: the pooled ratio's 95% interval entirely at or above 1.2x (met), entirely below (missed), or "
        "across it (unresolved at this load).",
        "",
    ]
    return lines + data.get("breakdowns", [])


def breakdown(args: argparse.Namespace, model: str) -> list[str]:
    """Run :mod:`powersgd_breakdown` for ``model`` on the same links; its command and table."""
    batch = args.gpt_batch if model in network_study.GPT_MODELS else args.batch_size
    argv = [str(HERE / "powersgd_breakdown.py"), "--links", *args.links, "--models", model]
    argv += ["--ranks", *map(str, args.ranks), "--batch-size", str(batch), "--out", str(args.out)]
    argv += ["--name", f"{args.name}-breakdown-{model}", "--study", "none"]
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=args.job_timeout * 3)
    written = args.out / f"{args.name}-breakdown-{model}.md"
    table = [line for line in written.read_text().splitlines() if line.startswith("|")] if written.exists() else []
    return [
        f"Breakdown of ours on {model} (`{results.command(argv[1:], argv[0])}`):",
        "",
        *(table or [done.stderr[-600:]]),
        "",
    ]


def finish(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """After a run: the breakdown of every model whose bar is not met."""
    summary = summarize(data["rows"], args.models)
    missed = [m for m in args.models if any(s["model"] == m and s.get("verdict") != "met" for s in summary)]
    data["breakdowns"] = [line for model in missed for line in breakdown(args, model)]


STUDY = study.Study(
    name="powersgd-bar",
    title="PowerSGD rank 4 against DDP's powerSGD_hook rank 4",
    description=__doc__,
    variants=variants,
    measure=measure,
    links=("100mbit",),
    ranks=(4,),
    repeats=3,
    add_options=add_options,
    report=report,
    finish=finish,
    plot=False,
)


if __name__ == "__main__":
    sys.exit(study.main(STUDY))

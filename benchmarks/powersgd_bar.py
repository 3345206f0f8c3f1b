"""PowerSGD's bar: ours against DDP's ``powerSGD_hook``, rank 4, over shaped links, interleaved and repeated.

On the network study's emulated links (:mod:`harness.links`: one namespace per rank, ``tbf`` at
``--rate``, 4 ranks by default) each repeat runs, one job at a time and in a rotated order, the
synthetic benchmark's worker (as :mod:`network_study` does) for:

* torch DDP (gloo) + ``powerSGD_hook`` rank 4 (error feedback, warm start, one bucket; the
  study's configuration),
* ``bagua_torch`` PowerSGD rank 4 (``with_bagua`` over gloo),
* ``bagua_jax`` PowerSGD rank 4 (``DataParallel`` over the native MPI engine),

on ``--models``: ``gpt-small`` (the project's GPT, ~3.3M parameters, windows of 129 corpus bytes,
``--gpt-batch`` per rank) and ``mlp`` (the study's 1.84M-parameter MLP, ``--batch-size`` images).
Both PowerSGDs and the hook run the same exact warm-up (``start_iter`` = the hook's
``start_powerSGD_iter`` = ``max(2, warm-up steps)``), over before the timed iterations.

Per variant: the median time per step of each repeat (each the median of its timed iterations,
mean over the ranks), their median and range; per front end the ratio of the hook's step time
to ours, paired by repeat (median and range) and pooled (the ratio of the medians of all timed
iterations, with a bootstrap 95% interval). The bar, at least 1.2x, is met where that whole
interval is at or above it, missed where it is all below, unresolved otherwise. The load average
is recorded before every job. Where a front end does not meet the bar, the run then prints the
step's breakdown from :mod:`powersgd_breakdown` (compute, compression, waiting, wire) with its
command. Results: ``benchmarks/results/<--name>.md`` and ``.json``.

    python benchmarks/powersgd_bar.py                               # gpt-small and mlp, 100 Mbit/s, 3 repeats
    python benchmarks/powersgd_bar.py --models gpt-small --repeats 5
    python benchmarks/powersgd_bar.py --replot --name powersgd-bar  # the report again from the JSON
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import network_study  # noqa: E402
from harness import links as nh  # noqa: E402
from harness.machine import cores, load_average  # noqa: E402
from harness.options import add_out_option  # noqa: E402
from harness.repeats import rotated  # noqa: E402
from harness.results import finish_meta, header_lines, run_meta, write_results  # noqa: E402

HOOK = ("torch", "ddp_powersgd_rank4")
OURS = {"torch": ("torch", "powersgd_rank4"), "jax": ("jax", "powersgd_rank4")}
VARIANTS = [HOOK, *OURS.values()]
BAR = 1.2


def wait_for_harness(seconds: float) -> None:
    """Wait until no other run holds the harness's namespaces (they are one per machine)."""
    deadline = time.monotonic() + seconds
    while any(nh.OUR_NS.match(ns) for ns in nh.list_namespaces()):
        if time.monotonic() > deadline:
            raise SystemExit("the network harness is still in use by another run; try again later")
        time.sleep(5)


def job_args(args: argparse.Namespace, model: str) -> argparse.Namespace:
    """What :func:`network_study.run_job` reads, with the batch of ``model``."""
    batch = args.gpt_batch if model in network_study.GPT_MODELS else args.batch_size
    return argparse.Namespace(
        batch_size=batch, jax_comm="mpi", **{f: getattr(args, f) for f in network_study.JOB_OPTIONS}
    )


def run_jobs(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    port = 29700
    with tempfile.TemporaryDirectory(prefix="bagua-powersgd-bar-") as tmp, nh.Network(args.ranks, args.rate) as net:
        for repeat in range(args.repeats):
            order = rotated(VARIANTS, repeat)
            for model in args.models:
                for framework, algorithm in order if repeat % 2 == 0 else order[::-1]:
                    port += 1
                    load = load_average()
                    row = network_study.run_job(
                        job_args(args, model), net, framework, algorithm, port, Path(tmp), model, False
                    )
                    row.update(repeat=repeat, load_average=load)
                    rows.append(row)
                    step = f"{row['step_s'] * 1e3:8.1f} ms/step" if row.get("status") == "ok" else row.get("status")
                    print(f"repeat {repeat} {model:>9} {framework:>5} {algorithm:<20} {step}  load {load}", flush=True)
    return rows


def _ok(rows: list[dict[str, Any]], model: str, variant: tuple[str, str]) -> list[dict[str, Any]]:
    return [
        r for r in rows if r["model"] == model and (r["framework"], r["algorithm"]) == variant and r["status"] == "ok"
    ]


def bootstrap_ratio(hook: list[float], ours: list[float], draws: int = 2000) -> tuple[float, float]:
    """A 95% interval of median(hook) / median(ours), resampling each side's timed iterations."""
    rng = np.random.default_rng(0)
    a, b = np.asarray(hook), np.asarray(ours)
    ratios = np.median(rng.choice(a, (draws, a.size)), 1) / np.median(rng.choice(b, (draws, b.size)), 1)
    return float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def summarize(rows: list[dict[str, Any]], models: list[str]) -> list[dict[str, Any]]:
    """Per model and front end: each variant's step times and the hook / ours ratios (see the module docstring)."""
    out = []
    for model in models:
        hook = _ok(rows, model, HOOK)
        for framework, variant in OURS.items():
            ours = _ok(rows, model, variant)
            if not hook or not ours:
                out.append({"model": model, "framework": framework, "status": "missing"})
                continue
            by_repeat = {r["repeat"]: r["step_s"] for r in hook}
            paired = [by_repeat[r["repeat"]] / r["step_s"] for r in ours if r["repeat"] in by_repeat]
            hook_all = [s for r in hook for s in r["step_s_all"]]
            ours_all = [s for r in ours for s in r["step_s_all"]]
            pooled = statistics.median(hook_all) / statistics.median(ours_all)
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
                    "pooled_ratio": pooled,
                    "pooled_interval": bootstrap_ratio(hook_all, ours_all),
                }
            )
            out[-1]["verdict"] = verdict(out[-1]["pooled_interval"])
    return out


def verdict(interval: tuple[float, float]) -> str:
    """ "met" where the whole 95% interval of hook / ours is at or above the bar, "missed" where it is all below,
    "unresolved" where the machine's noise leaves it either way."""
    low, high = interval
    return "met" if low >= BAR else "missed" if high < BAR else "unresolved"


def _ms(values: list[float]) -> str:
    return f"{statistics.median(values):.0f} [{min(values):.0f}, {max(values):.0f}]"


def table_lines(summary: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| model | front end | DDP + powerSGD_hook ms/step | ours ms/step | bytes/step/rank hook / ours | "
        "hook / ours by repeat | pooled hook / ours [95%] | bar 1.2x |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for s in summary:
        if s["status"] != "ok":
            lines.append(f"| {s['model']} | {s['framework']} | | | | | | {s['status']} |")
            continue
        low, high = s["pooled_interval"]
        paired = s["paired_ratios"]
        lines.append(
            f"| {s['model']} | {s['framework']} | {_ms(s['hook_ms'])} | {_ms(s['ours_ms'])} | "
            f"{s['hook_bytes'] / 1e3:.0f} kB / {s['ours_bytes'] / 1e3:.0f} kB | "
            f"{statistics.median(paired):.2f}x [{min(paired):.2f}, {max(paired):.2f}] | "
            f"{s['pooled_ratio']:.2f}x [{low:.2f}, {high:.2f}] | {s['verdict']} |"
        )
    return lines


def breakdown(args: argparse.Namespace, model: str) -> list[str]:
    """Run :mod:`powersgd_breakdown` for ``model`` on the same links; its command and table."""
    batch = args.gpt_batch if model in network_study.GPT_MODELS else args.batch_size
    argv = [sys.executable, str(HERE / "powersgd_breakdown.py"), "--rates", args.rate]
    argv += ["--models", model, "--ranks", str(args.ranks), "--batch-size", str(batch)]
    argv += ["--out", str(args.out), "--name", f"{args.name}-breakdown-{model}", "--study", "none"]
    wait_for_harness(args.wait)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=args.job_timeout * 3)
    table = [line for line in done.stdout.splitlines() if line.startswith("|")]
    command = "python " + " ".join(argv[1:]).replace(str(HERE.parent) + "/", "")
    return [f"Breakdown of ours on {model} (`{command}`):", "", *(table or [done.stderr[-600:]]), ""]


def report_lines(args: argparse.Namespace, meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    """The Markdown report of a run (without the breakdowns)."""
    summary = summarize(rows, args.models)
    loads = [r["load_average"][0] for r in rows]
    lines = [
        f"# PowerSGD rank 4 against DDP's powerSGD_hook rank 4: {args.ranks} ranks at {args.rate}",
        "",
        *header_lines(meta),
        f"- 1-minute load average before each job: median {statistics.median(loads):.1f}, range "
        f"[{min(loads):.1f}, {max(loads):.1f}] on {meta['cores']} cores shared with other engineers' work",
        f"- {args.repeats} repeats, variants interleaved in a rotated order; per job {args.warmup_iters} untimed + "
        f"{args.iters} timed iterations of {args.batches_per_iter} steps; per rank batch: {args.gpt_batch} windows "
        f"of 129 bytes (gpt-small), {args.batch_size} images (mlp); warm-up exact steps (start_iter = the hook's "
        "start_powerSGD_iter) over before the timed iterations; DDP's hook in one bucket as in the network study",
        "- ms/step: median over repeats [range]; ratios > 1 mean ours is faster",
        "",
        *table_lines(summary),
        "",
        "Verdict: the pooled ratio's 95% interval entirely at or above 1.2x (met), entirely below (missed), or "
        "across it (unresolved at this load).",
        "",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    json_path = args.out / f"{args.name}.json"
    if args.replot:
        data = json.loads(json_path.read_text())
        args = argparse.Namespace(**{**vars(args), **data["settings"]})
        meta, rows, breakdowns = data["meta"], data["rows"], data["breakdowns"]
    else:
        nh.require_root()
        wait_for_harness(args.wait)
        meta = run_meta(("torch", "jax"), argv=sys.argv[1:] if argv is None else argv, cores=cores())
        rows = run_jobs(args)
        finish_meta(meta)
        summary = summarize(rows, args.models)
        breakdowns = [
            line
            for model in args.models
            if any(s["model"] == model and s.get("verdict") != "met" for s in summary)
            for line in breakdown(args, model)
        ]
    lines = report_lines(args, meta, rows) + breakdowns
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "name", "replot")}
    payload = {"meta": meta, "settings": settings, "summary": summarize(rows, args.models), "rows": rows}
    for path in write_results(args.out, args.name, lines, {**payload, "breakdowns": breakdowns}):
        print(f"wrote {path}")
    print("\n".join(lines))
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["gpt-small", "mlp"], choices=["gpt-small", "mlp"])
    nh.add_link_options(p)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--gpt-batch", type=int, default=2, help="windows of 129 bytes per rank and step (gpt-small)")
    p.add_argument("--batch-size", type=int, default=32, help="images per rank and step (mlp)")
    network_study.add_job_options(p, job_timeout=300)
    p.add_argument("--wait", type=float, default=600, help="seconds to wait for the harness if another run holds it")
    add_out_option(p)
    p.add_argument("--name", default="powersgd-bar")
    p.add_argument("--replot", action="store_true", help="only rewrite the report from --name's JSON")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())

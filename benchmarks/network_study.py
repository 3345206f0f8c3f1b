"""Network trade-off study: time per step and loss of every algorithm over shaped links (issue 7).

For each rank count (``--ranks``, default 4 and 2) and each per-rank link rate
(``--rates``, default 100 Mbit/s, 300 Mbit/s, 1 Gbit/s, 10 Gbit/s and unshaped (the bare
veth, well above 10 Gbit/s)) the study builds the emulated network of :mod:`harness.links` (one
namespace per rank, veth pairs to a bridge, ``tbf`` shaping on both ends of every pair),
then runs, one job at a time, the synthetic benchmark's worker
(``benchmarks/synthetic.py --worker``) on its communication-heavy ``mlp`` model in every
rank's namespace:

* torch: the baseline (PyTorch DDP over gloo), DDP with its built-in communication hooks
  (``fp16_compress_hook``, ``powerSGD_hook`` ranks 1 and 4; ``bf16_compress_hook`` needs CUDA
  and NCCL and is left out on the CPU) and every ``bagua_torch`` algorithm (gloo);
* JAX: the baseline (a ``shard_map`` step differentiating the ``lax.pmean`` of the loss,
  over ``jax.distributed`` with gloo CPU collectives) and every ``bagua_jax`` algorithm in
  ``DataParallel`` over the native MPI engine: ``bagua-launch --mpi`` runs in rank 0's
  namespace and hydra reaches the other namespaces through the harness
  (:meth:`harness.links.Network.run_mpi`). ``--jax-comm gloo`` runs them in
  ``DataParallel(mesh=...)`` over ``jax.distributed`` + gloo instead (without ``async``,
  whose background averager needs the native engine).

``decentralized`` is the registry default (peer mode ``"all"``), ``decentralized_shift_one``
the ``"shift_one"`` mode, ``powersgd_rank1`` / ``powersgd_rank4`` PowerSGD of that rank (exact
steps during the warm-up, like DDP's hook). ``--models``: ``mlp`` (the original 1.84M-parameter
model) and ``matrices`` (16x16x3 input, four hidden layers of 1024: mostly 1024x1024 matrices).
Each rank's bytes sent per timed step are read from its namespace's ``/proc/net/dev``.
``--repeats`` runs the whole grid again, interleaved (``--repeat-only`` limits the later rounds
to some variants); ``--convergence-rate`` trains the digits MLP once per variant. No latency is
added when the kernel lacks ``sch_netem`` (the harness says so); bandwidth only.

Each job: ``--warmup-iters`` untimed iterations, then ``--iters`` timed ones of
``--batches-per-iter`` steps; the time per step of an iteration is the mean over the ranks,
the table reports the median over iterations. QAdam's and OneBitAdam's full-precision
warm-up ends inside the untimed iterations. ``async`` runs local steps while a background
thread averages the weights: its time per step does not wait for the network, so its
figure is not comparable with the synchronous ones (marked). Then, in the same job and the
same network, the worker trains a small MLP on scikit-learn's digits with the same
algorithm for ``--convergence-steps`` steps (global batch 128); the table's loss is the
training loss over the last 10 of them, averaged over the ranks: what each algorithm's
compression or decentralization costs in progress per step.

Results go to ``benchmarks/results/network-study.json`` (written after every job, so
an interrupted study keeps what it measured), ``.md`` and ``.png``.

    python benchmarks/network_study.py                                 # the whole grid
    python benchmarks/network_study.py --ranks 4 --rates 100mbit 1gbit
    python benchmarks/network_study.py --replot                        # md + png from the json
    python benchmarks/harness/links.py --cleanup                     # leftovers of a killed run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import synthetic  # noqa: E402
from harness import links as nh  # noqa: E402
from harness import plots  # noqa: E402
from harness.jobs import child_env  # noqa: E402
from harness.machine import cores  # noqa: E402
from harness.options import add_out_option, add_timeout_options  # noqa: E402
from harness.results import finish_meta, run_meta  # noqa: E402

ALGORITHMS = [
    "gradient_allreduce",
    "bytegrad",
    "decentralized",
    "decentralized_shift_one",
    "low_precision_decentralized",
    "qadam",
    "onebit_adam",
    "async",
    "powersgd_rank1",
    "powersgd_rank4",
]
BASELINE = {"torch": "ddp", "jax": "pmean"}
# DDP with its built-in communication hooks: the torch table's other baselines (what a torch user
# picks on a slow network).
DDP_HOOKS = synthetic.DDP_HOOKS
# torch 2.13's DDP refuses bf16_compress_hook without CUDA 11+ and NCCL 2.10+ (a TypeError at
# register_comm_hook), so on this CPU study it cannot run.
CPU_UNSUPPORTED = ("ddp_bf16",)
# The models timed: the synthetic benchmark's mlp (width, hidden layers, image side); "mlp" is the
# study's original 1.84M-parameter model, "matrices" one whose gradient is mostly 1024x1024 matrices.
MODELS = {"mlp": (512, 2, 32), "matrices": (1024, 4, 16)}
# The project's GPT (bagua_common.workload) by size, as the synthetic benchmark names it: batches are windows of
# its context plus one corpus bytes.
GPT_MODELS = ("gpt-tiny", "gpt-small")
FRAMEWORKS = ("torch", "jax")
# Slowest links first: the points the study is about are measured even if it is cut short.
DEFAULT_RATES = ["100mbit", "300mbit", "1gbit", "10gbit", "none"]


JOB_OPTIONS = ("lr", "warmup_iters", "iters", "batches_per_iter", "comm_timeout", "job_timeout", "tail_lines")
"""What :func:`run_job` reads from its arguments besides ``batch_size`` and ``jax_comm``: the options of
:func:`add_job_options`."""


def add_job_options(parser: argparse.ArgumentParser, job_timeout: float) -> None:
    """The options of :data:`JOB_OPTIONS`, for a script that runs :func:`run_job`: the worker's learning rate and
    iterations, the timeouts (a job's default ``job_timeout`` seconds) and how much of a failed job's log is kept."""
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--warmup-iters", type=int, default=2, help="untimed iterations per job")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per job")
    parser.add_argument("--batches-per-iter", type=int, default=2, help="steps per iteration")
    add_timeout_options(parser, comm=90, job=job_timeout)
    parser.add_argument("--tail-lines", type=int, default=8, help="last lines of a failed job's log kept in its row")


def job_list(args) -> list[tuple[str, str]]:
    # JAX's async averages in a background thread over the native engine: not on a mesh.
    skipped = {"jax": ("async",) if args.jax_comm == "gloo" else (), "torch": ()}
    peers = {"torch": [h for h in DDP_HOOKS if h not in CPU_UNSUPPORTED], "jax": []}
    return [
        (fw, alg)
        for fw in args.frameworks
        for alg in [BASELINE[fw], *peers[fw], *args.algorithms]
        if alg not in skipped[fw]
    ]


def worker_argv(args, framework: str, algorithm: str, result: Path, model: str, convergence: bool) -> list[str]:
    width, layers, image_size = MODELS.get(model, MODELS["mlp"])
    shared = ("batch_size", "lr", "warmup_iters", "iters", "batches_per_iter", "comm_timeout", "jax_comm")
    options = {name: getattr(args, name) for name in shared}
    options.update(
        model=model if model in GPT_MODELS else "mlp",
        width=width,
        layers=layers,
        image_size=image_size,
        threads=1,
        device="cpu",
        convergence_steps=args.convergence_steps if convergence else 0,
    )
    return [sys.executable, synthetic.__file__, *synthetic.worker_arguments(framework, algorithm, result, options)]


def run_job(
    args, net: nh.Network, framework: str, algorithm: str, port: int, tmp: Path, model: str, convergence: bool
) -> dict[str, Any]:
    result = tmp / f"{framework}-{algorithm}-{net.ranks}-{port}.json"
    log = tmp / f"{result.stem}.log"
    start = time.perf_counter()
    argv = worker_argv(args, framework, algorithm, result, model, convergence)
    with open(log, "w") as out:
        if framework == "jax" and algorithm != BASELINE["jax"] and args.jax_comm == "mpi":
            codes = net.run_mpi(argv, args.job_timeout, base_env=child_env(), stdout=out)
        else:
            codes = net.run_all(argv, port, args.job_timeout, base_env=child_env(), stdout=out)
    wall = time.perf_counter() - start
    row: dict[str, Any] = {
        "framework": framework,
        "algorithm": algorithm,
        "model": model,
        "ranks": net.ranks,
        "rate_bits": net.rate,
        "rate": nh.rate_label(net.rate),
        "wall_s": round(wall, 1),
        "exit_codes": codes,
    }
    per_rank = []
    for r in range(net.ranks):
        path = Path(f"{result}.rank{r}")
        if path.exists():
            per_rank.append(json.loads(path.read_text()))
    tail = log.read_text(errors="replace").strip().splitlines()[-args.tail_lines :]
    if len(per_rank) != net.ranks:
        row["status"] = "timeout" if any(c is None for c in codes) else "failed"
        row["log_tail"] = tail
        return row
    if any(c != 0 for c in codes):
        # Every rank wrote its results, then a rank failed on the way out (seen: gloo's
        # "terminate called without an active exception" at exit); the measurement stands.
        row["exit_note"] = f"exit codes {codes} after every rank wrote its results: " + " / ".join(tail[-2:])
    # seconds per step of each timed iteration, mean over ranks
    steps = [
        statistics.fmean(args.batch_size / rr["rates"][i] for rr in per_rank) for i in range(len(per_rank[0]["rates"]))
    ]
    row.update(
        status="ok",
        step_s=statistics.median(steps),
        step_s_mean=statistics.fmean(steps),
        step_s_min=min(steps),
        step_s_max=max(steps),
        step_s_all=steps,
        warmup_s=max(rr["warmup_s"] for rr in per_rank),
        bytes_sent_per_step=statistics.fmean(rr["bytes_sent_per_step"] for rr in per_rank),
    )
    if convergence:
        row["digits_loss"] = synthetic.digits_loss(per_rank)
        # The loss of every step, averaged over the ranks: the table reads it a quarter of the way in too.
        row["digits_curve"] = [
            round(statistics.fmean(rr["digits_losses"][i] for rr in per_rank), 6) for i in range(args.convergence_steps)
        ]
    return row


def parameter_count(model: str) -> int:
    if model in GPT_MODELS:
        from bagua_common.workload import gpt_config

        return gpt_config(model.removeprefix("gpt-")).parameter_count
    width, layers, image_size = MODELS[model]
    dims = [3 * image_size**2] + [width] * layers + [10]
    return sum(a * b + b for a, b in zip(dims, dims[1:]))


def wire_estimate(model: str, ranks: int, rate: int | None) -> float | None:
    """Seconds a ring allreduce of the fp32 gradient needs on one link (2 (n-1)/n x bytes each way)."""
    if rate is None:
        return None
    return 2 * (ranks - 1) / ranks * parameter_count(model) * 4 * 8 / rate


def _key(r: dict[str, Any]) -> tuple:
    return (r.get("model", "mlp"), r["ranks"], r["rate"], r["framework"], r["algorithm"])


def merged(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, ranks, rate, framework, algorithm): the repeats' timed iterations pooled
    (median over all of them), each repeat's median kept, the loss from the repeat that trained."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(_key(r), []).append(r)
    out = []
    for group in groups.values():
        ok = [r for r in group if r.get("status") == "ok"]
        if not ok:
            out.append(group[-1])
            continue
        steps = [s for r in ok for s in r["step_s_all"]]
        row = {k: v for k, v in ok[0].items() if k not in ("digits_loss", "digits_curve", "repeat")}
        row.update(
            model=row.get("model", "mlp"),
            step_s=statistics.median(steps),
            step_s_all=steps,
            repeat_step_s=[r["step_s"] for r in ok],
            repeats=len(ok),
        )
        if any("bytes_sent_per_step" in r for r in ok):
            row["bytes_sent_per_step"] = statistics.median(
                r["bytes_sent_per_step"] for r in ok if "bytes_sent_per_step" in r
            )
        trained = next((r for r in ok if "digits_curve" in r), None)
        if trained:
            row.update(digits_loss=trained["digits_loss"], digits_curve=trained["digits_curve"])
        out.append(row)
    return out


def add_ratios(rows: list[dict[str, Any]]) -> None:
    index = {_key(r): r for r in rows if r.get("status") == "ok"}
    for r in rows:
        if r.get("status") != "ok":
            continue
        model, ranks, rate, fw, _ = _key(r)
        base = index.get((model, ranks, rate, fw, BASELINE[fw]))
        ref = index.get((model, ranks, rate, fw, "gradient_allreduce"))
        r["speedup_vs_baseline"] = base["step_s"] / r["step_s"] if base else None
        r["speedup_vs_allreduce"] = ref["step_s"] / r["step_s"] if ref else None


def _rate_order(label: str) -> float:
    return float("inf") if label == "unshaped" else nh.parse_rate(label.replace(" ", "").replace("/s", ""))


def _label(fw: str, alg: str) -> str:
    peers = {
        "ddp": "torch DDP fp32 (baseline)",
        "pmean": "jax lax.pmean (baseline)",
        "ddp_fp16": "torch DDP + fp16_compress_hook",
        "ddp_bf16": "torch DDP + bf16_compress_hook",
        "ddp_powersgd_rank1": "torch DDP + powerSGD_hook rank 1",
        "ddp_powersgd_rank4": "torch DDP + powerSGD_hook rank 4",
    }
    label = peers.get(alg, f"bagua_{fw} {alg}")
    return label + (" (local steps, not comparable)" if alg == "async" else "")


def _time_cell(r: dict[str, Any]) -> str:
    cell = f"{r['step_s'] * 1e3:.0f}"
    if r.get("speedup_vs_baseline"):
        cell += f" ({r['speedup_vs_baseline']:.2f}x)"
    if r.get("speedup_vs_allreduce") and r["algorithm"] not in ("gradient_allreduce", *BASELINE.values()):
        cell += f", {r['speedup_vs_allreduce']:.2f} ar"
    return cell


def _find(rows, model, ranks, rate, fw, alg) -> dict[str, Any] | None:
    return next((x for x in rows if _key(x) == (model, ranks, rate, fw, alg)), None)


def _loss_cell(rows, ranks: int, fw: str, alg: str, steps: int) -> str:
    """The digits loss at the last step (mean of the last 10) and a quarter of the way in."""
    r = next((x for x in rows if x["ranks"] == ranks and _key(x)[3:] == (fw, alg) and "digits_curve" in x), None)
    if r is None:
        return ""
    early = steps // 4
    return f"{statistics.fmean(r['digits_curve'][early - 10 : early]):.3f} / {r['digits_loss']:.4f}"


def _grid(rows: list[dict[str, Any]], model: str, ranks: int, rates: list[str], steps: int) -> list[str]:
    """One table row per (framework, algorithm) in first-seen order: time per step at each rate,
    bytes sent per step, the digits loss."""
    lines = [
        "| variant | " + " | ".join(rates) + " | MB sent/step/rank | digits loss |",
        "|---|" + "---|" * (len(rates) + 2),
    ]
    mine = [r for r in rows if r["ranks"] == ranks and r.get("model", "mlp") == model]
    for fw, alg in dict.fromkeys((r["framework"], r["algorithm"]) for r in mine):
        cells = []
        for rate in rates:
            r = _find(mine, model, ranks, rate, fw, alg)
            cells.append("" if r is None else (_time_cell(r) if r["status"] == "ok" else r["status"]))
        sent = [x["bytes_sent_per_step"] for x in mine if _key(x)[3:] == (fw, alg) and "bytes_sent_per_step" in x]
        cells.append(f"{statistics.median(sent) / 1e6:.3f}" if sent else "")
        cells.append(_loss_cell(rows, ranks, fw, alg, steps) if steps else "")
        lines.append(f"| {_label(fw, alg)} | " + " | ".join(cells) + " |")
    return lines


def _ratio(reference: dict[str, Any], row: dict[str, Any]) -> str:
    """``reference``'s step time over ``row``'s, pooled, then of each repeat (as they were interleaved)."""
    text = f"{reference['step_s'] / row['step_s']:.2f}x"
    pairs = list(zip(reference.get("repeat_step_s", []), row.get("repeat_step_s", [])))
    if len(pairs) > 1:
        text += " (repeats: " + ", ".join(f"{a / b:.2f}x" for a, b in pairs) + ")"
    return text


def bar_lines(rows: list[dict[str, Any]], model: str, ranks: int, rates: list[str]) -> list[str]:
    """Issue 16's bars: our PowerSGD rank 4 against DDP's powerSGD_hook rank 4 (both front ends),
    and JAX's against lax.pmean."""
    lines = []
    hook = "ddp_powersgd_rank4"
    for rate in rates:
        ref = _find(rows, model, ranks, rate, "torch", hook)
        cells = []
        for fw in ("torch", "jax"):
            ours = _find(rows, model, ranks, rate, fw, "powersgd_rank4")
            if ours and ref and ours.get("status") == ref.get("status") == "ok":
                cells.append(f"bagua_{fw} powersgd rank 4 / DDP powerSGD_hook rank 4: {_ratio(ref, ours)}")
        ours = _find(rows, model, ranks, rate, "jax", "powersgd_rank4")
        base = _find(rows, model, ranks, rate, "jax", BASELINE["jax"])
        if ours and base and ours.get("status") == base.get("status") == "ok":
            cells.append(f"bagua_jax powersgd rank 4 / lax.pmean: {_ratio(base, ours)}")
        if cells:
            lines.append(f"- {rate}: " + "; ".join(cells))
    return lines


def table_lines(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    steps = meta["settings"].get("convergence_steps")
    for model in dict.fromkeys(r.get("model", "mlp") for r in rows):
        for ranks in sorted({r["ranks"] for r in rows}):
            rates = sorted({r["rate"] for r in rows if r["ranks"] == ranks}, key=_rate_order)
            lines += [
                f"### {model} ({parameter_count(model):,} parameters), {ranks} ranks",
                "",
                "Time per step in ms (median of the timed iterations of every repeat); in brackets the speed-up "
                "over the framework's baseline (torch DDP fp32, resp. jax lax.pmean) at the same bandwidth; "
                "`x.xx ar` the speed-up over the same framework's Bagua fp32 gradient_allreduce. MB sent per step: "
                "bytes the rank's network interface sent in the timed steps (all headers included), median over "
                "rates and repeats. Digits loss: training loss of the digits MLP (global batch 128) averaged over "
                f"the ranks and the 10 steps before step {steps // 4}, resp. {steps}"
                + (f", trained once per variant at {meta['convergence_rate']}" if meta.get("convergence_rate") else "")
                + ".",
                "",
            ]
            lines += _grid(rows, model, ranks, rates, steps)
            est = [
                wire_estimate(
                    model, ranks, nh.parse_rate(rate.replace(" ", "").replace("/s", "")) if rate != "unshaped" else None
                )
                for rate in rates
            ]
            lines.append(
                "| *fp32 ring-allreduce wire time (estimate)* | "
                + " | ".join("" if e is None else f"*{e * 1e3:.0f}*" for e in est)
                + " | | |"
            )
            lines.append("")
            bars = bar_lines(rows, model, ranks, rates)
            if bars:
                lines += ["Ratios of step times (issue 16's bars):", "", *bars, ""]
    return lines


def write_results(args, meta: dict[str, Any], rows: list[dict[str, Any]], final: bool) -> list[Path]:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{args.name}.json"]
    # One line per row: each carries a 200-point loss curve.
    paths[0].write_text(
        '{"meta": '
        + json.dumps(meta, indent=1)
        + ',\n "rows": [\n'
        + ",\n".join("  " + json.dumps(r) for r in rows)
        + "\n ]\n}\n"
    )
    if not final:
        return paths
    failed = [r for r in rows if r.get("status") != "ok"]
    rows = merged(rows)
    add_ratios(rows)
    models = dict.fromkeys(r.get("model", "mlp") for r in rows)
    md = [
        f"# Network trade-off study ({meta['date']})",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Load average (1, 5, 15 min) before: {meta['load_average_before']}, after: {meta['load_average_after']}.",
        "",
        f"Machine: {meta['machine']}; {meta['cores']} CPU cores, no GPU; torch {meta['versions'].get('torch')}, "
        f"jax {meta['versions'].get('jax')}. Each rank is a process in its own network namespace "
        "(benchmarks/harness/links.py): veth pair to a bridge in a separate namespace, token-bucket (tbf) "
        "shaping of each rank's link in both directions at the given rate; 'unshaped' is the bare veth "
        "(well above 10 Gbit/s).",
        "",
        "Models: the synthetic benchmark's MLP "
        + "; ".join(
            f"'{m}' ({MODELS[m][2]}x{MODELS[m][2]}x3 input, {MODELS[m][1]} hidden layers of {MODELS[m][0]}, "
            f"{parameter_count(m):,} parameters, {parameter_count(m) * 4 / 1e6:.1f} MB of fp32 gradient)"
            for m in models
            if m in MODELS
        )
        + f"; batch {meta['settings']['batch_size']} per rank, 1 torch thread per rank; "
        f"{meta['settings']['warmup_iters']} untimed + {meta['settings']['iters']} timed iterations of "
        f"{meta['settings']['batches_per_iter']} steps per job, {meta['settings'].get('repeats', 1)} repeat(s) "
        "interleaved (every variant at every rate once, then again).",
        "",
    ]
    md += [f"- {n}" for n in meta["notes"]] + [""]
    md += table_lines(meta, rows)
    if failed:
        md += ["### Failed jobs", ""]
        for r in failed:
            md.append(
                f"- {r['framework']} {r['algorithm']}, {r.get('model', 'mlp')}, {r['ranks']} ranks, {r['rate']}, "
                f"round {r.get('repeat', 0) + 1}: {r['status']}: "
                + " / ".join(r.get("log_tail", [])[-3:]).replace("|", "\\|")
            )
        md.append("")
    noted = [r for r in rows if r.get("status") == "ok" and r.get("exit_note")]
    if noted:
        md += ["### Jobs that failed on the way out (their measurements stand)", ""]
        md += [
            f"- {r['framework']} {r['algorithm']}, {r['ranks']} ranks, {r['rate']}: "
            + r["exit_note"].replace("|", "\\|")
            for r in noted
        ] + [""]
    if meta.get("closing"):
        md += ["### Closing note", "", meta["closing"], ""]
    paths.append(out / f"{args.name}.md")
    paths[-1].write_text("\n".join(md))
    png = plot(args, meta, rows, out / f"{args.name}.png")
    if png:
        paths.append(png)
    return paths


def plot(args, meta, rows, path: Path) -> Path | None:
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:  # nothing to chart without a finished job
        return None
    panels = [
        (m, k) for m in dict.fromkeys(r.get("model", "mlp") for r in ok) for k in sorted({r["ranks"] for r in ok})
    ]
    frameworks = [fw for fw in FRAMEWORKS if any(r["framework"] == fw for r in ok)]
    drawn = plots.figure(len(frameworks), len(panels))
    if drawn is None:
        return None
    fig, axes = drawn
    for row, fw in enumerate(frameworks):
        for col, (model, ranks) in enumerate(panels):
            ax = axes[row][col]
            mine = [r for r in ok if r["ranks"] == ranks and r["framework"] == fw and r.get("model", "mlp") == model]
            rates = sorted({r["rate"] for r in ok if r["ranks"] == ranks}, key=_rate_order)
            for alg in dict.fromkeys(r["algorithm"] for r in mine):
                pts = sorted((rates.index(r["rate"]), r["step_s"] * 1e3) for r in mine if r["algorithm"] == alg)
                style = "--" if alg in BASELINE.values() or alg in DDP_HOOKS else ("-." if alg == "async" else "-")
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=_label(fw, alg))
            ax.set_xticks(range(len(rates)), rates)
            ax.set_xlabel("per-rank link bandwidth")
            ax.set_ylabel("time per step (ms, log)")
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            engine = "gloo" if fw == "torch" or meta.get("jax_comm") == "gloo" else "MPI (pmean: gloo)"
            ax.set_title(f"{fw}, {ranks} ranks, {model} ({parameter_count(model) / 1e6:.2f} M params), CPU, {engine}")
            ax.legend(fontsize=7)
    fig.suptitle("Bagua algorithms over shaped links (tbf, network namespaces)")
    return plots.save(fig, path, dpi=110)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 2])
    p.add_argument("--rates", nargs="+", default=DEFAULT_RATES, help="per-rank link rates; 'none' = unshaped")
    p.add_argument(
        "--algorithms",
        nargs="+",
        default=ALGORITHMS,
        choices=ALGORITHMS,
        metavar="NAME",
        help="Bagua algorithms (each framework's baseline always runs)",
    )
    p.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    p.add_argument(
        "--jax-comm",
        choices=("mpi", "gloo"),
        default="mpi",
        help="bagua_jax over the native MPI engine (default; mpiexec reaches the namespaces "
        "through the harness) or over JAX's collectives on a mesh (jax.distributed + gloo)",
    )
    p.add_argument(
        "--convergence-steps", type=int, default=200, help="digits training steps after the timing, per job (0: off)"
    )
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way latency per link (needs netem)")
    p.add_argument(
        "--models", nargs="+", default=["mlp"], choices=[*MODELS, *GPT_MODELS], help="models timed (default: mlp)"
    )
    p.add_argument(
        "--repeats", type=int, default=1, help="times every job runs, interleaved: each round covers every rate and job"
    )
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run only these variants (every round)")
    p.add_argument(
        "--repeat-only",
        nargs="+",
        default=None,
        metavar="NAME",
        help="in the rounds after the first, run only these variants (e.g. the ones a ratio is read from)",
    )
    p.add_argument(
        "--convergence-rate",
        default=None,
        help="train the digits MLP only at this rate, in the first round and for the first model (the "
        "synchronous variants compute the same numbers everywhere; default: in every job)",
    )
    p.add_argument("--batch-size", type=int, default=32)
    add_job_options(p, job_timeout=150)
    p.add_argument("--study-timeout", type=float, default=7200, help="stop starting jobs after this many seconds")
    add_out_option(p)
    p.add_argument("--name", default="network-study")
    p.add_argument("--append", action="store_true", help="add to the rows of an existing json (same settings)")
    p.add_argument("--replot", action="store_true", help="only rewrite md + png from the json")
    p.add_argument("--closing", default=None, help="text of the closing note (or @file)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    json_path = args.out / f"{args.name}.json"
    closing = None
    if args.closing:
        closing = Path(args.closing[1:]).read_text() if args.closing.startswith("@") else args.closing
    if args.replot:
        data = json.loads(json_path.read_text())
        if closing:
            data["meta"]["closing"] = closing
        for path in write_results(args, data["meta"], data["rows"], final=True):
            print(f"wrote {path}")
        return 0
    nh.require_root()
    probe = nh.probe()
    notes = []
    if not probe.get("netem"):
        notes.append("The kernel has no sch_netem: no latency is added; links are shaped by bandwidth (tbf) only.")
    if "jax" in args.frameworks:
        notes.append(
            "bagua_jax algorithms: DataParallel over the native MPI engine (mpiexec in rank 0's namespace "
            "starts the other ranks through the harness; TCP over the shaped links, no shared memory, "
            "UCX's eager protocol for every size)."
            if args.jax_comm == "mpi"
            else "bagua_jax algorithms: DataParallel(mesh=...) over jax.distributed + gloo (JAX's collectives); "
            "async is left out, its background averager needs the native engine."
        )
    if "torch" in args.frameworks:
        notes.append(
            "DDP + bf16_compress_hook is not measured: torch's DDP refuses to register it without CUDA 11+ and "
            "NCCL 2.10+ (TypeError on gloo/CPU). DDP + powerSGD_hook runs with one bucket (bucket_cap_mb=1024): "
            "with several buckets its callback-issued allreduces interleave differently across ranks on gloo "
            "and the job fails ('Received data size doesn't match expected size')."
        )
    count = cores()
    if max(args.ranks) > count:
        notes.append(
            f"{max(args.ranks)} ranks on {count} cores: the CPU is oversubscribed (compute and "
            "compression of the ranks take turns)."
        )
    meta = run_meta(("torch", "jax", "numpy"), argv=sys.argv[1:] if argv is None else argv)
    meta.update(
        {
            "machine": platform.processor() or platform.machine(),
            "cores": count,
            "kernel": platform.release(),
            "probe": probe,
            "parameters": {m: parameter_count(m) for m in args.models},
            "settings": {
                k: getattr(args, k)
                for k in (
                    "models",
                    "repeats",
                    "batch_size",
                    "lr",
                    "warmup_iters",
                    "iters",
                    "batches_per_iter",
                    "convergence_steps",
                )
            },
            "delay_ms": args.delay_ms,
            "convergence_rate": None
            if args.convergence_rate is None
            else nh.rate_label(nh.parse_rate(args.convergence_rate)),
            "jax_comm": args.jax_comm,
            "notes": notes,
        }
    )
    if closing:
        meta["closing"] = closing
    rows: list[dict[str, Any]] = []
    if args.append and json_path.exists():
        old = json.loads(json_path.read_text())
        rows = old["rows"]
        meta["notes"] = list(dict.fromkeys(old["meta"]["notes"] + notes))
        meta["closing"] = closing or old["meta"].get("closing")
        meta["command"] = old["meta"]["command"] + "`, then `" + meta["command"]
    jobs = job_list(args)
    print(
        f"{len(jobs)} jobs x {len(args.models)} models x {len(args.rates)} rates x {len(args.ranks)} rank counts "
        f"x {args.repeats} repeats; parameters {meta['parameters']}",
        flush=True,
    )
    port = 29500
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="bagua-netstudy-") as tmp:
            for repeat in range(args.repeats):
                for ranks in args.ranks:
                    for rate in args.rates:
                        if time.monotonic() - start > args.study_timeout:
                            print("study timeout reached; stopping", flush=True)
                            break
                        with nh.Network(ranks, rate, args.delay_ms) as net:
                            for model in args.models:
                                for fw, alg in jobs:
                                    if (args.only and alg not in args.only) or (
                                        repeat and args.repeat_only and alg not in args.repeat_only
                                    ):
                                        continue
                                    port += 1
                                    convergence = args.convergence_steps > 0 and (
                                        meta["convergence_rate"] is None
                                        or (
                                            repeat == 0
                                            and model == args.models[0]
                                            and nh.rate_label(net.rate) == meta["convergence_rate"]
                                        )
                                    )
                                    row = run_job(args, net, fw, alg, port, Path(tmp), model, convergence)
                                    row["repeat"] = repeat
                                    rows.append(row)
                                    msg = (
                                        f"{row['step_s'] * 1e3:8.1f} ms/step "
                                        f"{row['bytes_sent_per_step'] / 1e6:7.3f} MB/step"
                                        if row["status"] == "ok"
                                        else f"{row['status']}: {' / '.join(row.get('log_tail', [])[-2:])}"
                                    )
                                    print(
                                        f"#{repeat} {ranks} ranks {row['rate']:>12} {model:>8} {fw:>5} {alg:<20} {msg} "
                                        f"({row['wall_s']:.0f} s)",
                                        flush=True,
                                    )
                                    write_results(args, meta, rows, final=False)
    except KeyboardInterrupt:
        print("interrupted; writing what was measured", file=sys.stderr)
    meta["total_s"] = round(time.monotonic() - start, 1)
    finish_meta(meta)
    for path in write_results(args, meta, rows, final=True):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

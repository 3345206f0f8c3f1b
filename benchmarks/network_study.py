"""Network trade-off study: time per step and loss of every algorithm over shaped links (issue 7).

On the harness's emulated network (``benchmarks/harness/links.py``: a namespace per rank, ``tbf`` on both ends of
every link) each job runs the synthetic benchmark's worker (``benchmarks/synthetic.py --worker``) in every rank's
namespace, one job at a time:

* torch: the baseline (PyTorch DDP over gloo), DDP with its built-in communication hooks (``fp16_compress_hook``,
  ``powerSGD_hook`` ranks 1 and 4; ``bf16_compress_hook`` needs CUDA and NCCL and is left out on the CPU) and
  every ``bagua_torch`` algorithm (gloo);
* JAX: the baseline (a ``shard_map`` step differentiating the ``lax.pmean`` of the loss, over ``jax.distributed``
  with gloo) and every ``bagua_jax`` algorithm in ``DataParallel`` over the native MPI engine (``bagua-launch
  --mpi`` in rank 0's namespace; hydra reaches the others through the harness); ``--jax-comm gloo`` runs them in
  ``DataParallel(mesh=...)`` over ``jax.distributed`` + gloo instead (without ``async``).

``decentralized`` is the registry default (peer mode ``"all"``), ``decentralized_shift_one`` the ``"shift_one"``
mode, ``powersgd_rank1`` / ``powersgd_rank4`` PowerSGD of that rank. ``--models``: ``mlp`` (1.84M parameters),
``matrices`` (16x16x3 input, four hidden layers of 1024), ``gpt-tiny`` and ``gpt-small``.

A job: ``--warmup-iters`` untimed iterations, then ``--iters`` timed ones of ``--batches-per-iter`` steps; a
job's time per step is the median over its iterations of the mean over the ranks; each rank's bytes sent per
timed step come from its namespace's ``/proc/net/dev``. QAdam's and 1-bit Adam's full-precision warm-up ends
inside the untimed iterations. ``async``'s steps do not wait for the network (marked: not comparable). With
``--convergence-steps`` the job then trains a digits MLP with the same algorithm (global batch 128): the table's
loss is the training loss over the last 10 steps, averaged over the ranks (``--convergence-rate``: only at that
link, in the first repeat and for the first model). The table gives the median over the repeats with [min, max]
(the harness: interleaved, each job behind the load gate).

    python benchmarks/network_study.py                                 # the whole grid
    python benchmarks/network_study.py --ranks 4 --links 100mbit 1gbit
    python benchmarks/network_study.py --report                        # md + png from the json
    python benchmarks/harness/links.py --cleanup                       # leftovers of a killed run
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import synthetic  # noqa: E402
from harness import plots, study  # noqa: E402
from harness.jobs import run_ranks  # noqa: E402
from harness.links import Network, link_name, parse_rate, rate_label  # noqa: E402
from harness.machine import cores  # noqa: E402
from harness.options import add_timeout_options  # noqa: E402
from harness.repeats import Spread, paired_ratios  # noqa: E402

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
DDP_HOOKS = synthetic.DDP_HOOKS
# torch 2.13's DDP refuses bf16_compress_hook without CUDA 11+ and NCCL 2.10+ (a TypeError at register_comm_hook).
CPU_UNSUPPORTED = ("ddp_bf16",)
# The synthetic benchmark's mlp by name: (width, hidden layers, image side).
MODELS = {"mlp": (512, 2, 32), "matrices": (1024, 4, 16)}
# The project's GPT (bagua_common.workload) by size, as the synthetic benchmark names it.
GPT_MODELS = ("gpt-tiny", "gpt-small")
FRAMEWORKS = ("torch", "jax")
# Slowest links first: the points the study is about are measured even if it is cut short.
DEFAULT_LINKS = ["100mbit", "300mbit", "1gbit", "10gbit", "none"]
NOTES = {
    "torch": "DDP + bf16_compress_hook is not measured: torch's DDP refuses to register it without CUDA 11+ and "
    "NCCL 2.10+. DDP + powerSGD_hook runs with one bucket (bucket_cap_mb=1024): with several, its callback-issued "
    "allreduces interleave differently across ranks on gloo and the job fails.",
    "mpi": "bagua_jax algorithms: DataParallel over the native MPI engine (mpiexec in rank 0's namespace starts the "
    "other ranks through the harness; TCP over the shaped links, no shared memory, UCX's eager protocol).",
    "gloo": "bagua_jax algorithms: DataParallel(mesh=...) over jax.distributed + gloo; async is left out, its "
    "background averager needs the native engine.",
}
OVERSUBSCRIBED = (
    "{ranks} ranks on {cores} cores: the CPU is oversubscribed (the ranks' compute and compression take turns)."
)


def add_job_options(parser: argparse.ArgumentParser, job_timeout: float) -> None:
    """What :func:`run_job` reads besides ``batch_size`` and ``jax_comm``: the worker's learning rate and
    iterations, the timeouts (a job's default ``job_timeout`` seconds) and how much of a failed job's log is kept."""
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--warmup-iters", type=int, default=2, help="untimed iterations per job")
    parser.add_argument("--iters", type=int, default=3, help="timed iterations per job")
    parser.add_argument("--batches-per-iter", type=int, default=2, help="steps per iteration")
    add_timeout_options(parser, comm=90, job=job_timeout)
    parser.add_argument("--tail-lines", type=int, default=8, help="last lines of a failed job's log kept in its row")


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--algorithms",
        nargs="+",
        default=ALGORITHMS,
        choices=ALGORITHMS,
        metavar="NAME",
        help="Bagua algorithms (each framework's baseline and DDP's hooks always run)",
    )
    p.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    p.add_argument(
        "--jax-comm",
        choices=("mpi", "gloo"),
        default="mpi",
        help="bagua_jax over the native MPI engine "
        "(default) or over JAX's collectives on a mesh (jax.distributed + gloo)",
    )
    p.add_argument("--models", nargs="+", default=["mlp"], choices=[*MODELS, *GPT_MODELS])
    p.add_argument("--convergence-steps", type=int, default=200, help="digits steps after the timing (0: off)")
    p.add_argument(
        "--convergence-rate",
        type=link_name,
        default=None,
        help="train the digits MLP only at this "
        "link, in the first repeat and for the first model (default: in every job)",
    )
    p.add_argument("--batch-size", type=int, default=32)
    add_job_options(p, job_timeout=150)
    p.add_argument("--closing", default=None, help="text of the closing note (or @file)")


def variants(args: argparse.Namespace) -> list[study.Variant]:
    """Every (model, framework, algorithm) job: the baseline, DDP's hooks (torch), then ``--algorithms``."""
    skipped = {"jax": ("async",) if args.jax_comm == "gloo" else (), "torch": ()}
    peers = {"torch": [h for h in DDP_HOOKS if h not in CPU_UNSUPPORTED], "jax": []}
    return [
        study.Variant(f"{fw}/{alg} {model}", {"framework": fw, "algorithm": alg, "model": model})
        for model in args.models
        for fw in args.frameworks
        for alg in [BASELINE[fw], *peers[fw], *args.algorithms]
        if alg not in skipped[fw]
    ]


def worker_argv(args: argparse.Namespace, variant: study.Variant, result: Path, convergence: bool) -> list[str]:
    """The synthetic worker's command for ``variant``."""
    model = variant["model"]
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
    worker = synthetic.worker_arguments(variant["framework"], variant["algorithm"], result, options)
    return [sys.executable, synthetic.__file__, *worker]


def run_job(
    args: argparse.Namespace, net: Network, variant: study.Variant, result: Path, convergence: bool
) -> dict[str, Any]:
    """One job of ``variant`` on ``net``: its figures (time per step, bytes, the digits loss), or why it failed."""
    mpi = variant["framework"] == "jax" and variant["algorithm"] != BASELINE["jax"] and args.jax_comm == "mpi"
    argv = worker_argv(args, variant, result, convergence)
    outcome = run_ranks(net, argv, result, mpi=mpi, timeout=args.job_timeout, tail_lines=args.tail_lines)
    row = outcome.row()
    if outcome.ranks is None:
        return row
    ranks = outcome.ranks
    # seconds per step of each timed iteration, mean over the ranks
    steps = [statistics.fmean(args.batch_size / r["rates"][i] for r in ranks) for i in range(len(ranks[0]["rates"]))]
    row.update(
        step_s=statistics.median(steps),
        step_s_all=steps,
        warmup_s=max(r["warmup_s"] for r in ranks),
        bytes_sent_per_step=statistics.fmean(r["bytes_sent_per_step"] for r in ranks),
    )
    if convergence:
        row["digits_loss"] = synthetic.digits_loss(ranks)
        row["digits_curve"] = [
            round(statistics.fmean(r["digits_losses"][i] for r in ranks), 6) for i in range(args.convergence_steps)
        ]
    return row


def measure(trial: study.Trial) -> dict[str, Any]:
    args = trial.args
    convergence = args.convergence_steps > 0 and (
        args.convergence_rate is None
        or (trial.repeat == 0 and trial.variant["model"] == args.models[0] and trial.link == args.convergence_rate)
    )
    return run_job(args, trial.net, trial.variant, trial.scratch(), convergence)


# ------------------------------------------------------------------ the report


def upgraded(row: dict[str, Any]) -> dict[str, Any]:
    """A row of a results file written before the harness, with the harness's keys (variant, link, model)."""
    if "variant" in row:
        return row
    model = row.get("model", "mlp")
    name = f"{row['framework']}/{row['algorithm']} {model}"
    return {**row, "variant": name, "model": model, "link": link_name(row["rate_bits"])}


def parameter_count(model: str) -> int:
    if model in GPT_MODELS:
        from bagua_common.workload import gpt_config

        return gpt_config(model.removeprefix("gpt-")).parameter_count
    width, layers, image_size = MODELS[model]
    dims = [3 * image_size**2] + [width] * layers + [10]
    return sum(a * b + b for a, b in zip(dims, dims[1:]))


def wire_estimate(model: str, ranks: int, link: str) -> float | None:
    """Seconds a ring allreduce of the fp32 gradient needs on one link (2 (n-1)/n x bytes each way)."""
    rate = parse_rate(link)
    return None if rate is None else 2 * (ranks - 1) / ranks * parameter_count(model) * 4 * 8 / rate


def _label(fw: str, alg: str) -> str:
    peers = {
        "ddp": "torch DDP fp32 (baseline)",
        "pmean": "jax lax.pmean (baseline)",
        "ddp_fp16": "torch DDP + fp16_compress_hook",
        "ddp_bf16": "torch DDP + bf16_compress_hook",
        "ddp_powersgd_rank1": "torch DDP + powerSGD_hook rank 1",
        "ddp_powersgd_rank4": "torch DDP + powerSGD_hook rank 4",
    }
    return peers.get(alg, f"bagua_{fw} {alg}") + (" (local steps, not comparable)" if alg == "async" else "")


class Figures:
    """The study's rows indexed by (model, ranks, link, framework, algorithm): each variant's spread of time per
    step over the published repeats, its rows."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = [upgraded(r) for r in rows]
        self.spreads = study.summary(self.rows, "step_s")
        self.facts = {r["variant"]: (r["model"], r["framework"], r["algorithm"]) for r in self.rows}

    def step(self, model: str, ranks: int, link: str, fw: str, alg: str) -> Spread | None:
        return self.spreads.get((f"{fw}/{alg} {model}", ranks, link))

    def repeats(self, model: str, ranks: int, link: str, fw: str, alg: str) -> dict[int, float]:
        """The time per step of each published repeat."""
        name = f"{fw}/{alg} {model}"
        return {
            r.get("repeat", 0): r["step_s"]
            for r in self.rows
            if (r["variant"], r["ranks"], r["link"]) == (name, ranks, link)
            and r.get("status") == "ok"
            and r.get("load", {}).get("published", True)
        }

    def cell(self, model: str, ranks: int, link: str, fw: str, alg: str) -> str:
        """Time per step in ms, median [min, max], with the speed-up over the framework's baseline and over its
        gradient allreduce (ratios of the medians)."""
        mine = self.step(model, ranks, link, fw, alg)
        if mine is None:
            failed = [
                r["status"]
                for r in self.rows
                if r["variant"] == f"{fw}/{alg} {model}" and r["link"] == link and r["ranks"] == ranks
            ]
            return failed[-1] if failed else ""
        text = mine.scaled(1e3).format(".0f")
        base, ref = (
            self.step(model, ranks, link, fw, BASELINE[fw]),
            self.step(model, ranks, link, fw, "gradient_allreduce"),
        )
        if base:
            text += f" ({base.median / mine.median:.2f}x)"
        if ref and alg not in ("gradient_allreduce", *BASELINE.values()):
            text += f", {ref.median / mine.median:.2f} ar"
        return text


def _loss_cell(figures: Figures, ranks: int, fw: str, alg: str, model: str, steps: int) -> str:
    """The digits loss at the last step (mean of the last 10) and a quarter of the way in."""
    row = next(
        (
            r
            for r in figures.rows
            if r["ranks"] == ranks and r["variant"] == f"{fw}/{alg} {model}" and "digits_curve" in r
        ),
        None,
    )
    if row is None:
        return ""
    early = steps // 4
    return f"{statistics.fmean(row['digits_curve'][early - 10 : early]):.3f} / {row['digits_loss']:.4f}"


def bar_lines(figures: Figures, model: str, ranks: int, links: list[str]) -> list[str]:
    """Issue 16's bars: our PowerSGD rank 4 against DDP's powerSGD_hook rank 4 (both front ends), and JAX's against
    lax.pmean; ratios of the medians, then repeat by repeat."""

    def ratio(reference: tuple[str, str], ours: tuple[str, str], link: str) -> str | None:
        a, b = figures.step(model, ranks, link, *reference), figures.step(model, ranks, link, *ours)
        if not (a and b):
            return None
        text = f"{a.median / b.median:.2f}x"
        ra, rb = figures.repeats(model, ranks, link, *reference), figures.repeats(model, ranks, link, *ours)
        common = sorted(set(ra) & set(rb))
        if len(common) > 1:
            text += f" (repeats: {paired_ratios([ra[k] for k in common], [rb[k] for k in common]).format('.2f')})"
        return text

    lines = []
    hook = ("torch", "ddp_powersgd_rank4")
    for link in links:
        cells = [
            f"{what}: {got}"
            for what, got in (
                (
                    "bagua_torch powersgd rank 4 / DDP powerSGD_hook rank 4",
                    ratio(hook, ("torch", "powersgd_rank4"), link),
                ),
                ("bagua_jax powersgd rank 4 / DDP powerSGD_hook rank 4", ratio(hook, ("jax", "powersgd_rank4"), link)),
                ("bagua_jax powersgd rank 4 / lax.pmean", ratio(("jax", "pmean"), ("jax", "powersgd_rank4"), link)),
            )
            if got
        ]
        if cells:
            lines.append(f"- {rate_label(parse_rate(link))}: " + "; ".join(cells))
    return lines


def report(data: dict[str, Any]) -> list[str]:
    meta, figures = data["meta"], Figures(data["rows"])
    settings = meta.get("settings") or data.get("settings", {})
    steps = settings.get("convergence_steps", 0)
    notes = meta.get("notes", [])
    lines = [
        "Each rank is a process in its own network namespace (benchmarks/harness/links.py): a veth pair to a bridge, "
        "token-bucket (tbf) shaping of each rank's link in both directions; 'unshaped' is the bare veth (well above "
        f"10 Gbit/s). Per rank batch {settings.get('batch_size')}, 1 torch thread per rank; "
        f"{settings.get('warmup_iters')} untimed + {settings.get('iters')} timed iterations of "
        f"{settings.get('batches_per_iter')} steps per job, {settings.get('repeats', 1)} repeat(s) interleaved.",
        "",
        *(f"- {n}" for n in notes),
        "",
    ]
    for model in dict.fromkeys(r["model"] for r in figures.rows):
        for ranks in sorted({r["ranks"] for r in figures.rows}):
            mine = [r for r in figures.rows if r["ranks"] == ranks and r["model"] == model]
            if not mine:
                continue
            links = sorted({r["link"] for r in mine}, key=study.link_order)
            lines += [
                f"### {model} ({parameter_count(model):,} parameters), {ranks} ranks",
                "",
                "Time per step in ms, median [min, max] over the repeats; in brackets the speed-up over the "
                "framework's baseline (torch DDP fp32, resp. jax lax.pmean) at the same link; `x.xx ar` the speed-up "
                "over the same framework's Bagua fp32 gradient_allreduce. MB sent per step: bytes the rank's "
                "interface sent in the timed steps, median over links and repeats. Digits loss: training loss of "
                f"the digits MLP averaged over the ranks and the 10 steps before step {steps // 4}, resp. {steps}.",
                "",
            ]
            cells = []
            for name in dict.fromkeys(r["variant"] for r in mine):
                _, fw, alg = figures.facts[name]
                sent = [r["bytes_sent_per_step"] for r in mine if r["variant"] == name and "bytes_sent_per_step" in r]
                cells.append(
                    [
                        _label(fw, alg),
                        *(figures.cell(model, ranks, link, fw, alg) for link in links),
                        f"{statistics.median(sent) / 1e6:.3f}" if sent else "",
                        _loss_cell(figures, ranks, fw, alg, model, steps) if steps else "",
                    ]
                )
            estimates = [wire_estimate(model, ranks, link) for link in links]
            cells.append(
                [
                    "*fp32 ring-allreduce wire time (estimate)*",
                    *("" if e is None else f"*{e * 1e3:.0f}*" for e in estimates),
                    "",
                    "",
                ]
            )
            head = ["variant", *(rate_label(parse_rate(link)) for link in links), "MB sent/step/rank", "digits loss"]
            lines += [*study.results.table(head, cells), ""]
            bars = bar_lines(figures, model, ranks, links)
            if bars:
                lines += ["Ratios of step times (issue 16's bars):", "", *bars, ""]
    failed = [r for r in figures.rows if r.get("status") != "ok"]
    if failed:
        lines += ["### Failed jobs", ""]
        lines += [
            f"- {r['variant']}, {r['ranks']} ranks, {r['link']}, repeat {r.get('repeat', 0)}: {r['status']}: "
            + " / ".join(r.get("log_tail", [])[-3:])
            for r in failed
        ]
        lines.append("")
    if meta.get("closing"):
        lines += ["### Closing note", "", meta["closing"], ""]
    return lines


def plot(data: dict[str, Any], path: Path) -> Path | None:
    """Time per step against the link: a panel per framework (rows) and (model, ranks) (columns)."""
    figures = Figures(data["rows"])
    ok = [r for r in figures.rows if r.get("status") == "ok"]
    panels = list(dict.fromkeys((r["model"], r["ranks"]) for r in ok))
    frameworks = [fw for fw in FRAMEWORKS if any(r["framework"] == fw for r in ok)]
    drawn = plots.figure(len(frameworks), len(panels)) if ok else None
    if drawn is None:
        return None
    fig, axes = drawn
    for i, fw in enumerate(frameworks):
        for j, (model, ranks) in enumerate(panels):
            mine = [r for r in ok if (r["model"], r["ranks"], r["framework"]) == (model, ranks, fw)]
            links = sorted({r["link"] for r in ok if r["ranks"] == ranks}, key=study.link_order)
            labels = [rate_label(parse_rate(link)) for link in links]
            series, styles = {}, {}
            for name in dict.fromkeys(r["variant"] for r in mine):
                alg = figures.facts[name][2]
                points = {
                    label: figures.spreads[(name, ranks, link)]
                    for label, link in zip(labels, links)
                    if (name, ranks, link) in figures.spreads
                }
                series[_label(fw, alg)] = {k: v.scaled(1e3) for k, v in points.items()}
                peer = alg in BASELINE.values() or alg in DDP_HOOKS
                styles[_label(fw, alg)] = {"linestyle": "--" if peer else ("-." if alg == "async" else "-")}
            ax = axes[i][j]
            plots.spreads(ax, labels, series, styles)
            ax.set_xlabel("per-rank link bandwidth")
            ax.set_ylabel("time per step (ms, log)")
            ax.set_title(f"{fw}, {ranks} ranks, {model} ({parameter_count(model) / 1e6:.2f} M params), CPU")
            ax.legend(fontsize=7)
    fig.suptitle("Bagua algorithms over shaped links (tbf, network namespaces)")
    return plots.save(fig, path)


def prepare(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """The notes of a new run (what this machine and these options leave out) and the closing note."""
    meta = data["meta"]
    if not data["rows"] and "notes" not in meta:
        meta["notes"] = [
            *(
                []
                if meta.get("netem")
                else ["The kernel has no sch_netem: no latency; links shaped by bandwidth only."]
            ),
            *([NOTES[args.jax_comm]] if "jax" in args.frameworks else []),
            *([NOTES["torch"]] if "torch" in args.frameworks else []),
            *([OVERSUBSCRIBED.format(ranks=max(args.ranks), cores=cores())] if max(args.ranks) > cores() else []),
        ]
        meta["parameters"] = {m: parameter_count(m) for m in args.models}
    if args.closing:
        meta["closing"] = Path(args.closing[1:]).read_text() if args.closing.startswith("@") else args.closing


STUDY = study.Study(
    name="network-study",
    title="Network trade-off study: every algorithm over shaped links",
    description=__doc__,
    variants=variants,
    measure=measure,
    links=DEFAULT_LINKS,
    ranks=(4, 2),
    repeats=1,
    add_options=add_options,
    report=report,
    prepare=prepare,
    plot=plot,
)


def main(argv: list[str] | None = None) -> int:
    return study.main(STUDY, argv)


if __name__ == "__main__":
    sys.exit(main())

"""The LM study: every algorithm of both front ends and the peers a user would pick instead, trained where learning
happens, and timed to a target loss over shaped links on an idle machine.

Every variant trains the workload's GPT with the study's settings (:mod:`lm_study_settings`: the model, the batch,
the schedule and the token budget, chosen by ``lm_study_sweep.py``) on 4 ranks, each in its own network namespace
(:mod:`harness.links`): torch over gloo, bagua_jax algorithms in ``DataParallel`` over the native MPI engine, plain
JAX (``lax.pmean`` in ``shard_map``) over ``jax.distributed`` with gloo. The study has two halves:

``train``: one job per variant trains the whole budget unshaped (rank 0 evaluates its model on the held-out windows
every ``eval_every`` steps; each rank counts the bytes it sent). Losses do not depend on the load, so this half runs
whenever the machine allows; suspending the study (Ctrl-Z, SIGSTOP) suspends its ranks at their next step. Where
JAX computes the same numbers as torch for an algorithm, its job trains only the first ``--check-fraction`` of the
budget, and the report uses torch's curve once JAX's matched it at every evaluation of that part (within
``CHECK_TOLERANCE``); it says so in the table. With ``--check-fraction 1`` a JAX variant trains the whole budget
(again, when only its check was trained) and the report uses its own curve.

``time``: the time per step of every variant at every link, on an idle machine: jobs of ``--group`` variants at a
time, each job's ranks alive through all its phases (one untimed, then ``--repeats`` rounds of every link); the
phases go out one at a time, the variants of a link interleaved (A B C, C B A, ...), each behind the load gate of
:mod:`harness.load` (the 1-minute load before and after, the runnable threads that are not the study's own sampled
from ``/proc`` during the phase; a phase that met a foreign load above the limit is run again). A round is one step,
or for DiLoCo ``h_t`` steps of a copy with that short round (4, or 2P for Streaming), so that every timed window
holds whole rounds; its time per step at the trained H is ``local + (round - local) * h_t / H`` (``local``: the
median step, ``round``: the mean over whole rounds), since a round's exchange costs the same whatever H. The steps an
algorithm runs uncompressed first (QAdam's and 1-bit Adam's warm-up, PowerSGD's exact steps) take the time per step
of the same front end's gradient allreduce (DDP's for its PowerSGD hook); the timed copies skip them.

Asynchronous averaging's progress depends on the link, so it trains at each link inside a timed phase, and its time
to a target is read off its own clock (``time`` with ``--only torch/async jax/async``).

Time to a target = the steps a variant needs to reach it (linear between evaluations) x its time per step at the
link. The targets: DDP fp32's held-out loss at 80% of its budget, and the fixed ``FIXED_TARGET``. Results are kept
in ``lm-study.json`` as each job finishes; a rerun with the same settings skips what finished there.

    python benchmarks/lm_study.py train                                   # every variant not yet trained
    python benchmarks/lm_study.py train --only torch/ddp
    python benchmarks/lm_study.py train --seed 1 --name lm-study-seed1     # another initialization and data order
    python benchmarks/lm_study.py time --repeats 3                        # every variant's step, every link
    python benchmarks/lm_study.py time --only torch/async jax/async       # asynchronous averaging at each link
    python benchmarks/lm_study.py report                                  # md + png (and the docs page)
    python benchmarks/lm_study.py merge --from A/lm-study.json B/lm-study.json   # runs kept apart, into one
    python benchmarks/harness/links.py --cleanup                          # leftovers of a killed run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import lm_study_report  # noqa: E402
from harness.jobs import run_ranks  # noqa: E402
from harness.links import Network, link_name, probe, require_root  # noqa: E402
from harness.load import LoadGate  # noqa: E402
from harness.phases import PhasedJob, PhaseRunner, kept  # noqa: E402
from harness.results import RESULTS, finish_meta, run_meta  # noqa: E402
from lm_study_settings import STUDY, Schedule  # noqa: E402

LINKS = ["none", "1gbit", "100mbit"]
ASYNC_LINKS = LINKS
CHECK_FRACTION = 0.2
JAX_TWIN = {"pmean": "ddp"}
"""JAX variants whose torch twin has another name (``lax.pmean`` computes DDP's numbers)."""
OWN_CURVE = ("async",)
"""Algorithms whose numbers depend on timing: each front end trains its own curve (at the link)."""
DILOCO_ROUNDS = [(20, "uint8")]
"""DiLoCo variants beside its defaults: (H, outer exchange)."""
STREAMING_ROUNDS = [(4, 20, "uint4")]
"""Streaming DiLoCo variants: (P, H, outer exchange), tau = 1."""


def _variant(
    front_end: str, algorithm: str, label: str | None = None, schedule: Schedule | None = None, **options: Any
) -> dict[str, Any]:
    variant = {"name": f"{front_end}/{label or algorithm}", "front_end": front_end, "algorithm": algorithm,
               "options": options}  # fmt: skip
    return {**variant, "schedule": vars(schedule)} if schedule else variant


def _diloco(front_end: str, h: int, exchange: str, fragments: int = 1) -> dict[str, Any]:
    if fragments == 1:
        return _variant(front_end, "diloco", f"diloco_h{h}_{exchange}", sync_every=h, outer_exchange=exchange)
    return _variant(front_end, "diloco", f"streaming_p{fragments}_h{h}_{exchange}", sync_every=h,
                    outer_exchange=exchange, fragments=fragments, fragment_sync_delay=1)  # fmt: skip


def variants() -> list[dict[str, Any]]:
    """Every variant, in the order they run: the baselines, every registered algorithm with its defaults in each
    front end (so a new algorithm joins the study by itself), then DiLoCo at the round lengths and exchanges of
    :data:`DILOCO_ROUNDS` and Streaming DiLoCo at :data:`STREAMING_ROUNDS`."""
    from bagua_jax.algorithms import algorithm_names as jax_names
    from bagua_torch.algorithms import available_algorithms as torch_names

    listed = [_variant("torch", name) for name in ("ddp", "ddp_fp16", "ddp_powersgd_rank4")]
    listed.append(_variant("jax", "pmean"))
    for front_end, names in (("torch", torch_names()), ("jax", jax_names())):
        listed += [_variant(front_end, name) for name in names]
        listed += [_diloco(front_end, h, exchange) for h, exchange in DILOCO_ROUNDS]
        listed += [_diloco(front_end, h, exchange, p) for p, h, exchange in STREAMING_ROUNDS]
    return listed


OUTER_SEARCH = [
    (20, 0.7, 0.9), (20, 1.0, 0.0), (20, 1.0, 0.5), (50, 0.7, 0.9), (50, 1.0, 0.5),
    (100, 0.7, 0.9), (100, 1.0, 0.0), (100, 1.0, 0.5),
]  # fmt: skip
"""DiLoCo's outer (H, learning rate, momentum) searched for its ``default_outer_settings``."""


ADAM_SEARCH = (1e-3, 4e-3)
"""The Adam-type algorithms' peak learning rates searched beside the study's (their schedule's ``peak``)."""
ADAM_WARMUP_SEARCH = (50, 400)
"""Their full-precision warm-up steps searched beside the default 100 (``warmup_steps``)."""
ADAM_B2_SEARCH = (0.95,)
"""Their second-moment decay searched beside the study's 0.999 (``b2``; AdamW's is 0.95)."""


def search_variants() -> list[dict[str, Any]]:
    """The runs the algorithms' defaults were chosen from (torch, trained only, not timed): ByteGrad with error
    feedback (its default has none), DiLoCo's outer optimizer over :data:`OUTER_SEARCH`, and QAdam's and 1-bit Adam's
    peak learning rate, warm-up and second-moment decay over :data:`ADAM_SEARCH`, :data:`ADAM_WARMUP_SEARCH` and
    :data:`ADAM_B2_SEARCH`."""
    out = [_variant("torch", "bytegrad", "bytegrad_error_feedback", error_feedback=True)]
    out += [_variant("torch", "diloco", f"diloco_h{h}_outer_lr{lr:g}_m{mu:g}", sync_every=h, outer_learning_rate=lr,
                     outer_momentum=mu) for h, lr, mu in OUTER_SEARCH]  # fmt: skip
    for name in ("qadam", "onebit_adam"):
        out += [_variant("torch", name, f"{name}_lr{peak:g}", dataclasses.replace(STUDY.adam_schedule, peak=peak))
                for peak in ADAM_SEARCH]  # fmt: skip
        out += [_variant("torch", name, f"{name}_warmup{n}", warmup_steps=n) for n in ADAM_WARMUP_SEARCH]
        out += [_variant("torch", name, f"{name}_b2_{b2:g}", b2=b2) for b2 in ADAM_B2_SEARCH]
    return out


def twin(variant: dict[str, Any]) -> str | None:
    """The torch variant whose curve a JAX variant uses (checked on a part of the budget), or None: torch's
    variants, and the algorithms whose numbers depend on timing, train their own."""
    if variant["front_end"] != "jax" or variant["algorithm"] in OWN_CURVE:
        return None
    label = variant["name"].split("/", 1)[1]
    return f"torch/{JAX_TWIN.get(label, label)}"


def timing_round(variant: dict[str, Any]) -> int:
    """h_t, the round length DiLoCo is timed with (0: the algorithm communicates every step)."""
    if variant["algorithm"] != "diloco":
        return 0
    return max(4, 2 * variant["options"].get("fragments", 1))


TIMING_OPTIONS = {"qadam": {"warmup_steps": 1}, "onebit_adam": {"warmup_steps": 1}, "powersgd": {"start_iter": 0}}
"""What the timed copies change so that every timed step is the algorithm's own (the report times the uncompressed
first steps as gradient allreduce's)."""


def _jobfile(folder: Path, job: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "job.json"
    path.write_text(json.dumps({**job, "result": str(folder / "result")}))
    return path


def _argv(path: Path) -> list[str]:
    return [sys.executable, str(HERE / "lm_study_worker.py"), str(path)]


def _mpi(variant: dict[str, Any]) -> bool:
    return variant["front_end"] == "jax" and variant["algorithm"] not in ("pmean",)


def train(args: argparse.Namespace, data: dict[str, Any], save: Any) -> None:
    """The ``train`` half (the module docstring): one job per variant not yet trained."""
    budget = args.steps or args.settings.steps

    def steps_of(variant: dict[str, Any]) -> int:
        return budget if twin(variant) is None else max(1, round(args.check_fraction * budget))

    # A job that failed (a timeout, a crash) is run again, and so is one shorter than this run's (a JAX check
    # trained again with a larger --check-fraction); only a finished one is kept.
    done = {name for name, row in data["train"].items() if row.get("status") == "ok"}
    todo = [
        v
        for v in _selected(args)
        if v["algorithm"] not in OWN_CURVE
        and (v["name"] not in done or data["train"][v["name"]]["steps"] < steps_of(v))
    ]
    with (
        tempfile.TemporaryDirectory(prefix="lm-study-") as tmp,
        Network(args.settings.ranks, None, verbose=False) as net,
    ):
        for i, variant in enumerate(todo):
            steps = steps_of(variant)
            job = {"settings": args.settings.as_dict(), **_fields(variant), "mode": "train", "steps": steps,
                   "study_pid": os.getpid()}  # fmt: skip
            path = _jobfile(Path(tmp) / variant["name"].replace("/", "-"), job)
            started = time.strftime("%F %T")
            outcome = run_ranks(net, _argv(path), path.parent / "result", mpi=_mpi(variant), timeout=args.job_timeout)
            row = {**variant, "steps": steps, "started": started, **outcome.row()}
            if outcome.status == "ok":
                row.update(lm_study_report.summarize_training(outcome.ranks))
            data["train"][variant["name"]] = row
            save()
            print(f"[{i + 1}/{len(todo)}] {lm_study_report.train_line(row)}", flush=True)


def _fields(variant: dict[str, Any]) -> dict[str, Any]:
    """What a job file takes of a variant: its front end, algorithm, options, and its own schedule if it has one."""
    return {k: variant[k] for k in ("front_end", "algorithm", "options", "schedule") if k in variant}


def time_steps(args: argparse.Namespace, data: dict[str, Any], save: Any) -> None:
    """The ``time`` half (the module docstring): groups of ``--group`` variants, their phases interleaved, each timed
    phase behind the load gate; asynchronous averaging trains at each link."""
    # A variant whose job failed, or was ended because a job timed beside it failed, is timed again.
    done = {name for name, row in data["timing"].items() if row.get("status") == "ok"}
    todo = [v for v in _selected(args) if v["name"] not in done]
    gate = LoadGate(args.max_load, attempts=args.attempts)
    try:
        with (
            tempfile.TemporaryDirectory(prefix="lm-study-") as tmp,
            Network(args.settings.ranks, None, verbose=False) as net,
        ):
            for start in range(0, len(todo), args.group):
                group = todo[start : start + args.group]
                for variant, row in zip(group, _time_group(args, net, gate, group, Path(tmp))):
                    data["timing"][variant["name"]] = row
                    print(lm_study_report.timing_line(row), flush=True)
                save()
    finally:
        gate.close()


def _time_group(
    args: argparse.Namespace, net: Network, gate: LoadGate, group: list[dict[str, Any]], tmp: Path
) -> list[dict[str, Any]]:
    jobs, paths = [], []
    for variant in group:
        h_t = timing_round(variant)
        if variant["algorithm"] in OWN_CURVE:
            links, timed = list(args.links), [True] * len(args.links)
            job = {"mode": "async", "steps": args.settings.steps}
        else:
            links = ["none"] + [link for _ in range(args.repeats) for link in args.links]
            timed = [False] + [True] * (len(links) - 1)
            options = {**variant["options"], **TIMING_OPTIONS.get(variant["algorithm"], {})}
            variant = {**variant, "options": options}
            job = {"mode": "time", "timing_round": h_t, "timed_rounds": args.timed_steps if not h_t else 2}
        job = {"settings": args.settings.as_dict(), **_fields(variant), **job, "links": links, "timed": timed,
               "phase_wait_s": args.job_timeout}  # fmt: skip
        paths.append(_jobfile(tmp / variant["name"].replace("/", "-"), job))
        jobs.append(PhasedJob(paths[-1].parent, links, timed))
    runner = PhaseRunner(net, jobs, gate)
    outcomes: list[Any] = [None] * len(group)
    aborted = threading.Lock()

    def launch(i: int) -> None:
        outcomes[i] = run_ranks(net, _argv(paths[i]), paths[i].parent / "result", mpi=_mpi(group[i]),
                                timeout=args.job_timeout)  # fmt: skip
        if outcomes[i].status != "ok" and aborted.acquire(blocking=False):
            runner.abort()  # the group's other jobs would wait for phases this one never reaches

    launchers = [threading.Thread(target=launch, args=(i,)) for i in range(len(group))]
    runner.start()
    for thread in launchers:
        thread.start()
    for thread in launchers:
        thread.join()
    runner.stop.set()
    runner.join()
    rows = []
    for i, (variant, outcome) in enumerate(zip(group, outcomes)):
        row = {**variant, "timing_round": timing_round(variant), "date": time.strftime("%F %T"), **outcome.row(),
               "interleaved_with": [v["name"] for v in group if v is not variant]}  # fmt: skip
        if outcome.status == "ok" and aborted.locked() and not runner.completed(i):
            row["status"] = "aborted"  # ended at its next phase: a job of its group failed
        if row["status"] == "ok":
            ranks = [{**r, "phases": kept(r["phases"], runner.records, i)} for r in outcome.ranks]
            row.update(lm_study_report.summarize_timing(ranks, row))
        rows.append(row)
    return rows


def _selected(args: argparse.Namespace) -> list[dict[str, Any]]:
    every = variants() + (search_variants() if args.command == "train" else [])
    names = {v["name"] for v in every}
    unknown = sorted(set(args.only or ()) - names)
    if unknown:
        raise SystemExit(f"lm_study: unknown variants {unknown}; the variants: {sorted(names)}")
    return [v for v in every if args.only is None or v["name"] in args.only]


def merge(args: argparse.Namespace, data: dict[str, Any], save: Any) -> None:
    """The ``merge`` command: the finished rows of studies run apart (each with its own ``--out``, e.g. trained
    side by side) into this one, which must have been run with the same settings; a later file's row wins."""
    for source in args.sources:
        other = json.loads(source.read_text())
        if other["settings"] != data["settings"]:
            raise SystemExit(f"lm_study merge: {source} was run with other settings than {args.out / args.name}")
        for half in ("train", "timing"):
            data[half].update({k: row for k, row in other[half].items() if row.get("status") == "ok"})
        data["commands"] += [c for c in other["commands"] if c not in data["commands"]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("command", choices=["train", "time", "report", "merge"])
    p.add_argument("--from", dest="sources", nargs="+", type=Path, default=[], metavar="JSON",
                   help="(merge) results files of studies run apart")  # fmt: skip
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="only these variants (front/label)")
    p.add_argument("--check-fraction", type=float, default=CHECK_FRACTION,
                   help="the part of the budget a JAX variant trains to check its torch twin's curve")  # fmt: skip
    p.add_argument("--steps", type=int, default=None,
                   help="train the first STEPS steps of the schedule (default: all)")  # fmt: skip
    p.add_argument("--links", nargs="+", default=LINKS, type=link_name, help="per-rank links timed; 'none': unshaped")
    p.add_argument("--repeats", type=int, default=3, help="timing phases per link and variant, interleaved")
    p.add_argument("--group", type=int, default=4, help="variants whose timing phases are interleaved")
    p.add_argument("--timed-steps", type=int, default=5, help="timed steps per phase (DiLoCo: 2 rounds)")
    p.add_argument("--max-load", type=float, default=None, help="the load gate's limit (default 0.75 per core)")
    p.add_argument("--attempts", type=int, default=3, help="runs of a phase whose load keeps it from being published")
    p.add_argument("--job-timeout", type=float, default=None,
                   help="seconds a job may run (default: 6 hours to train, paused or not; 1 hour to time)")  # fmt: skip
    p.add_argument("--seed", type=int, default=STUDY.seed, help="the model's initialization and the data's order")
    p.add_argument("--name", default="lm-study")
    p.add_argument("--out", type=Path, default=RESULTS, help="results directory (default benchmarks/results)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.settings = dataclasses.replace(STUDY, seed=args.seed)
    if args.job_timeout is None:
        args.job_timeout = 6 * 3600 if args.command == "train" else 3600
    json_path = args.out / f"{args.name}.json"
    data = json.loads(json_path.read_text()) if json_path.exists() else None
    if args.command == "report":
        lm_study_report.write(args.out, args.name, data)
        return 0
    if data is None or data["settings"] != args.settings.as_dict():
        if args.command == "merge" and args.sources:  # the machine and versions the first study ran with
            meta = json.loads(args.sources[0].read_text())["meta"]
        else:
            meta = run_meta(("torch", "jax"), argv=sys.argv[1:] if argv is None else argv)
        data = {"meta": meta, "settings": args.settings.as_dict(), "train": {}, "timing": {}, "commands": []}
    if args.command != "merge":
        require_root()
        data["meta"]["netem"] = bool(probe().get("netem"))
    command = " ".join(["python", "benchmarks/lm_study.py", *(sys.argv[1:] if argv is None else argv)])
    data["commands"].append({"command": command, "date": time.strftime("%F %T")})

    def save() -> None:
        if args.command != "merge":  # a merge measures nothing: the load after stays the studies' own
            finish_meta(data["meta"])
        args.out.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(data, indent=1) + "\n")

    {"train": train, "time": time_steps, "merge": merge}[args.command](args, data, save)
    save()
    lm_study_report.write(args.out, args.name, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())

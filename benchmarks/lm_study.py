"""The LM study: every algorithm of both front ends and the peers on the workload's GPT, over shaped links.

4 ranks, one network namespace each (:mod:`harness.links`: veth pairs to a bridge, bandwidth shaped by the
kernel's ``tbf`` on both ends of every pair; no latency where the kernel lacks ``sch_netem``), the ``small`` GPT,
``--batch`` windows of 128+1 corpus bytes per rank and step. One job per variant (4 processes; two side by side
with ``--pairs``): torch over gloo, bagua_jax algorithms in ``DataParallel`` over the native MPI engine, plain JAX
(``lax.pmean`` in ``shard_map``) over ``jax.distributed`` with gloo. A job (``lm_study_worker.py``):

1. trains ``--steps`` steps once, unshaped (asynchronous averaging, whose progress depends on the link, at
   ``--async-link``); rank 0 evaluates its own model on the held-out windows every ``--eval-every`` steps, and
   each rank's bytes sent over the whole run give the bytes per step;
2. times steps at every link of ``--links``, ``--repeats`` times, interleaved (the study changes the link between
   phases while the ranks wait): the median over the repeats of each phase's mean step time. DiLoCo's rounds
   are timed on a fresh copy with a short round of ``h_t`` steps (4, or 2P for Streaming) so that every timed
   window holds whole rounds; its time per step at the trained H is ``local + (round_mean - local) * h_t / H``
   (``local``: the median step, ``round_mean``: the mean over whole rounds), since a round's exchange costs the
   same whatever H.

``--pairs LABEL`` runs torch/LABEL and jax/LABEL as two jobs side by side, one phase at a time: both train in
turn, then their timing phases alternate (A B, B A, ...; the idle job's ranks wait, asynchronous averaging paused),
so that both meet the same load, which on a shared machine drifts over minutes. Each repeat's JAX/torch ratio
pairs two adjacent phases; the report gives their median and range.

Time to DDP fp32's final held-out loss at a link = the steps a variant needs to reach it (linear between
evaluations, from its one training run) x its time per step at that link: for the synchronous algorithms the
steps do not depend on the link. Each variant's result is kept in ``<name>.json`` as soon as it is done; a rerun
with the same settings skips the variants already there, so partial runs add up.

    python benchmarks/lm_study.py                                   # every variant not yet done
    python benchmarks/lm_study.py --only torch/ddp jax/pmean --steps 200
    python benchmarks/lm_study.py --pairs qadam powersgd --repeats 5   # JAX/torch step time, side by side
    python benchmarks/lm_study.py --report                          # md + png from the json
    python benchmarks/harness/links.py --cleanup                  # leftovers of a killed run
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import lm_study_report  # noqa: E402
from harness import links as nh  # noqa: E402
from harness.jobs import child_env  # noqa: E402
from harness.machine import load_average  # noqa: E402
from harness.options import add_out_option  # noqa: E402
from harness.results import finish_meta, run_meta  # noqa: E402

from bagua_common.job.local_launch import free_port  # noqa: E402

NRANKS, SIZE, SEED = 4, "small", 0
DEFAULT_LINKS = ["none", "1gbit", "100mbit"]


def _variant(front_end: str, algorithm: str, label: str | None = None, **options: Any) -> dict[str, Any]:
    return {
        "name": f"{front_end}/{label or algorithm}",
        "front_end": front_end,
        "algorithm": algorithm,
        "options": options,
    }


def _diloco(h: int, exchange: str, fragments: int = 1, front_end: str = "torch") -> dict[str, Any]:
    if fragments == 1:
        return _variant(front_end, "diloco", f"diloco_h{h}_{exchange}", sync_every=h, outer_exchange=exchange)
    return _variant(
        front_end,
        "diloco",
        f"streaming_p{fragments}_h{h}_{exchange}",
        sync_every=h,
        outer_exchange=exchange,
        fragments=fragments,
        fragment_sync_delay=1,
    )


def variants() -> list[dict[str, Any]]:
    """Every variant, in the order they run: the baseline, the likely best, the rest; then any registered algorithm
    not named here, with its defaults (so a new algorithm joins the study by itself)."""
    from bagua_jax.algorithms import algorithm_names as jax_names
    from bagua_torch.algorithms import available_algorithms as torch_names

    listed = [
        _variant("torch", "ddp"),
        _diloco(50, "uint8"),
        _diloco(50, "uint4", fragments=4),
        *(_variant("torch", name) for name in ("bytegrad", "onebit_adam", "powersgd")),
        _variant("jax", "bytegrad"),
        _diloco(50, "uint8", front_end="jax"),
        *(_variant("jax", name) for name in ("onebit_adam", "powersgd")),
        _variant("torch", "ddp_powersgd_rank4"),
        _variant("jax", "pmean"),
        _diloco(50, "uint4", fragments=2),
        _diloco(50, "fp32"),
        _diloco(50, "uint4"),
        *(_diloco(h, exchange) for h in (10, 200) for exchange in ("fp32", "uint8", "uint4")),
        _variant("torch", "ddp_fp16"),
        _diloco(50, "uint4", fragments=4, front_end="jax"),
    ]
    registered = [("torch", name) for name in torch_names()] + [("jax", name) for name in jax_names()]
    done = {(v["front_end"], v["algorithm"]) for v in listed}
    return listed + [_variant(fe, name) for fe, name in registered if (fe, name) not in done]


def timing_round(variant: dict[str, Any]) -> int:
    """h_t, the round length DiLoCo is timed with (0: the algorithm communicates every step)."""
    if variant["algorithm"] != "diloco":
        return 0
    return max(4, 2 * variant["options"].get("fragments", 1))


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a cached result must share with this run to be kept."""
    return {
        "size": SIZE,
        "ranks": NRANKS,
        "seed": SEED,
        "steps": args.steps,
        "batch": args.batch,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "eval_every": args.eval_every,
        "heldout_windows": args.heldout_windows,
        "async_link": args.async_link,
    }


class PhaseControl(threading.Thread):
    """Starts the phases of one or more jobs, one phase at a time: the next phase of ``schedule`` once every job is
    idle (each rank waits for its job's next phase, or has written its result), after setting the phase's link."""

    def __init__(self, net: nh.Network, jobs: list[tuple[Path, list[str]]]):
        super().__init__(daemon=True)
        self.net, self.jobs = net, jobs
        self.stop = threading.Event()

    def schedule(self) -> list[tuple[int, int]]:
        """(job, phase) in the order they run: every job's training, then the timing phases, the jobs alternating
        which goes first (A B, B A, ...) so that a drift in the machine's load falls on both alike."""
        order = [(j, 0) for j in range(len(self.jobs))]
        for phase in range(1, max(len(links) for _, links in self.jobs)):
            jobs = range(len(self.jobs)) if phase % 2 else reversed(range(len(self.jobs)))
            order += [(j, phase) for j in jobs if phase < len(self.jobs[j][1])]
        return order

    def _idle(self, job: int, next_phase: int) -> bool:
        folder, links = self.jobs[job]
        marker = f"ready-{next_phase}-{{}}" if next_phase < len(links) else "rank{}.json"
        return all((folder / marker.format(r)).exists() for r in range(self.net.ranks))

    def run(self) -> None:
        next_phase = [0] * len(self.jobs)
        for job, phase in self.schedule():
            while not all(self._idle(j, next_phase[j]) for j in range(len(self.jobs))):
                if self.stop.wait(0.05):
                    return
            folder, links = self.jobs[job]
            if nh.parse_rate(links[phase]) != self.net.rate:
                self.net.reshape(links[phase])
            (folder / f"go-{phase}").touch()
            next_phase[job] = phase + 1


def _job_file(args: argparse.Namespace, variant: dict[str, Any], tmp: Path) -> tuple[Path, list[str]]:
    """Write a variant's job file into a fresh folder; the folder and the job's links (phase 0 trains)."""
    folder = Path(tempfile.mkdtemp(prefix=variant["name"].replace("/", "-") + "-", dir=tmp))
    train_link = args.async_link if variant["algorithm"] == "async" else "none"
    links = [train_link] + [link for _ in range(args.repeats) for link in args.links]
    h_t = timing_round(variant)
    job = {
        **settings(args),
        **{k: variant[k] for k in ("front_end", "algorithm", "options")},
        "links": links,
        "timing_sync_every": h_t,
        "timed_rounds": 4 if not h_t else max(1, 8 // h_t),
        "phase_wait_s": args.job_timeout,  # a twin's whole job at most
    }
    (folder / "job.json").write_text(json.dumps(job))
    return folder, links


def run_variants(
    args: argparse.Namespace, net: nh.Network, variants: list[dict[str, Any]], tmp: Path
) -> list[dict[str, Any]]:
    """Run the variants' jobs side by side, their phases interleaved (:class:`PhaseControl`); each variant's row (the
    ranks' raw results, or the log's tail when it failed). Two variants are a pair, each timed against the other."""
    jobs = [_job_file(args, variant, tmp) for variant in variants]
    control = PhaseControl(net, jobs)
    codes: list[list[int | None]] = [[] for _ in variants]

    def launch(i: int) -> None:
        argv = [sys.executable, str(HERE / "lm_study_worker.py"), str(jobs[i][0] / "job.json")]
        timeout = args.job_timeout * len(variants)
        with open(jobs[i][0] / "log", "w") as log:
            if variants[i]["front_end"] == "jax" and variants[i]["algorithm"] != "pmean":
                codes[i] = net.run_mpi(argv, timeout, base_env=child_env(), stdout=log)
            else:
                codes[i] = net.run_all(argv, free_port(), timeout, base_env=child_env(), stdout=log)

    launchers = [threading.Thread(target=launch, args=(i,)) for i in range(len(variants))]
    load_before, start = load_average(), time.perf_counter()
    control.start()
    for launcher in launchers:
        launcher.start()
    for launcher in launchers:
        launcher.join()
    control.stop.set()
    control.join()
    common = {"wall_s": round(time.perf_counter() - start, 1), "load_before": load_before}
    common["load_after"] = load_average()
    names = [variant["name"] for variant in variants]
    return [
        _row(variant, folder, codes[i], {**common, **({"interleaved_with": names[1 - i]} if len(names) == 2 else {})})
        for i, (variant, (folder, _)) in enumerate(zip(variants, jobs))
    ]


def _row(variant: dict[str, Any], folder: Path, codes: list[int | None], common: dict[str, Any]) -> dict[str, Any]:
    job = json.loads((folder / "job.json").read_text())
    row = {
        **variant,
        "train_link": job["links"][0],
        "timing_sync_every": job["timing_sync_every"],
        **common,
        "exit_codes": codes,
    }
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    if len(ranks) != len(codes):
        tail = (folder / "log").read_text(errors="replace").strip().splitlines()[-40:]
        return {**row, "status": "timeout" if None in codes else "failed", "log_tail": tail}
    return {**row, "status": "ok", **lm_study_report.summarize(ranks, job)}


def _todo(args: argparse.Namespace, rows: dict[str, dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The jobs to run, each one variant or (``--pairs``) a torch variant and its JAX twin; without the variants already
    done (a pair: done side by side)."""
    by_name = {v["name"]: v for v in variants()}
    if args.pairs:
        pairs = [[by_name[f"torch/{label}"], by_name[f"jax/{label}"]] for label in args.pairs]
        done = {name for name, row in rows.items() if row["status"] == "ok" and row.get("interleaved_with")}
        return [pair for pair in pairs if not all(v["name"] in done for v in pair)]
    todo = [v for v in by_name.values() if (args.only is None or v["name"] in args.only)]
    return [[v] for v in todo if rows.get(v["name"], {}).get("status") != "ok"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run only these variants (front/label)")
    p.add_argument(
        "--pairs",
        nargs="+",
        default=None,
        metavar="LABEL",
        help="run torch/LABEL and jax/LABEL as one job, their phases interleaved, for the JAX/torch step time ratio "
        "(rerun unless already run so)",
    )
    p.add_argument("--steps", type=int, default=200, help="training steps per variant (default 200)")
    p.add_argument("--batch", type=int, default=1, help="windows of 129 bytes per rank and step (default 1)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--heldout-windows", type=int, default=32)
    p.add_argument("--links", nargs="+", default=DEFAULT_LINKS, help="per-rank link rates timed; 'none' = unshaped")
    p.add_argument("--async-link", default="100mbit", help="the link asynchronous averaging trains at")
    p.add_argument("--repeats", type=int, default=2, help="timing phases per link, interleaved")
    p.add_argument("--job-timeout", type=float, default=900)
    p.add_argument("--study-timeout", type=float, default=3300, help="start no variant after this many seconds")
    p.add_argument("--name", default="lm-study")
    p.add_argument("--report", action="store_true", help="only rewrite md + png from the json")
    add_out_option(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    json_path = args.out / f"{args.name}.json"
    data = json.loads(json_path.read_text()) if json_path.exists() else None
    if args.report:
        lm_study_report.write(args.out, args.name, data)
        return 0
    nh.require_root()
    if data is None or data["settings"] != settings(args):
        meta = run_meta(("torch", "jax"), argv=sys.argv[1:] if argv is None else argv)
        meta["netem"] = bool(nh.probe().get("netem"))
        data = {"meta": meta, "settings": settings(args), "rows": {}, "load_samples": []}
    todo = _todo(args, data["rows"])
    if args.pairs:
        data["meta"].setdefault("pair_runs", []).append(
            {"command": " ".join(["python", "benchmarks/lm_study.py", *sys.argv[1:]]), "date": time.strftime("%F %T")}
        )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lm-study-") as tmp, nh.Network(NRANKS, None) as net:
        for i, unit in enumerate(todo):
            if time.perf_counter() - start > args.study_timeout:
                print(f"study timeout: {len(todo) - i} jobs left", flush=True)
                break
            data["load_samples"].append([time.strftime("%H:%M:%S"), load_average()])
            for row in run_variants(args, net, unit, Path(tmp)):
                data["rows"][row["name"]] = row
                print(f"[{i + 1}/{len(todo)}] {lm_study_report.one_line(row)}", flush=True)
            finish_meta(data["meta"])
            args.out.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(data, indent=1) + "\n")
    lm_study_report.write(args.out, args.name, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())

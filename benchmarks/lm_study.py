"""The LM study: every algorithm of both front ends and the peers on the workload's GPT, over shaped links.

4 ranks, one network namespace each (:mod:`network_harness`: veth pairs to a bridge, bandwidth shaped by the
kernel's ``tbf`` on both ends of every pair; no latency where the kernel lacks ``sch_netem``), the ``small`` GPT,
``--batch`` windows of 128+1 corpus bytes per rank and step. One job per variant (4 processes): torch over gloo,
bagua_jax algorithms in ``DataParallel`` over the native MPI engine, plain JAX (``lax.pmean`` in ``shard_map``) over
``jax.distributed`` with gloo. A job (``lm_study_worker.py``):

1. trains ``--steps`` steps once, unshaped (asynchronous averaging, whose progress depends on the link, at
   ``--async-link``); rank 0 evaluates its own model on the held-out windows every ``--eval-every`` steps, and
   each rank's bytes sent over the whole run give the bytes per step;
2. times steps at every link of ``--links``, ``--repeats`` times, interleaved (the study changes the link between
   phases while the ranks wait): the median over the repeats of each phase's mean step time. DiLoCo's rounds
   are timed on a fresh copy with a short round of ``h_t`` steps (4, or 2P for Streaming) so that every timed
   window holds whole rounds; its time per step at the trained H is ``local + (round_mean - local) * h_t / H``
   (``local``: the median step, ``round_mean``: the mean over whole rounds), since a round's exchange costs the
   same whatever H.

Time to DDP fp32's final held-out loss at a link = the steps a variant needs to reach it (linear between
evaluations, from its one training run) x its time per step at that link: for the synchronous algorithms the
steps do not depend on the link. Each variant's result is kept in ``<name>.json`` as soon as it is done; a rerun
with the same settings skips the variants already there, so partial runs add up.

    python benchmarks/lm_study.py                                   # every variant not yet done
    python benchmarks/lm_study.py --only torch/ddp jax/pmean --steps 200
    python benchmarks/lm_study.py --report                          # md + png from the json
    python benchmarks/network_harness.py --cleanup                  # leftovers of a killed run
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

import _common  # noqa: E402
import lm_study_report  # noqa: E402
import network_harness as nh  # noqa: E402
from network_study import child_env  # noqa: E402

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
    """Starts each phase of a job once every rank waits for it, after setting the phase's link."""

    def __init__(self, net: nh.Network, folder: Path, links: list[str]):
        super().__init__(daemon=True)
        self.net, self.folder, self.links = net, folder, links
        self.stop = threading.Event()

    def run(self) -> None:
        for phase, link in enumerate(self.links):
            while not all((self.folder / f"ready-{phase}-{r}").exists() for r in range(self.net.ranks)):
                if self.stop.wait(0.05):
                    return
            if nh.parse_rate(link) != self.net.rate:
                self.net.reshape(link)
            (self.folder / f"go-{phase}").touch()


def run_variant(args: argparse.Namespace, net: nh.Network, variant: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Run one variant's job; its row (the ranks' raw results, or the log's tail when it failed)."""
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
    }
    (folder / "job.json").write_text(json.dumps(job))
    argv = [sys.executable, str(HERE / "lm_study_worker.py"), str(folder / "job.json")]
    net.reshape(train_link)
    control = PhaseControl(net, folder, links)
    control.start()
    load_before, start = _common.load_average(), time.perf_counter()
    with open(folder / "log", "w") as log:
        if variant["front_end"] == "jax" and variant["algorithm"] != "pmean":
            codes = net.run_mpi(argv, args.job_timeout, base_env=child_env(), stdout=log)
        else:
            codes = net.run_all(argv, _common.free_port(), args.job_timeout, base_env=child_env(), stdout=log)
    control.stop.set()
    control.join()
    row = {
        **variant,
        "train_link": train_link,
        "timing_sync_every": h_t,
        "wall_s": round(time.perf_counter() - start, 1),
        "load_before": load_before,
        "load_after": _common.load_average(),
        "exit_codes": codes,
    }
    ranks = [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
    if len(ranks) != net.ranks:
        tail = (folder / "log").read_text(errors="replace").strip().splitlines()[-40:]
        return {**row, "status": "timeout" if None in codes else "failed", "log_tail": tail}
    return {**row, "status": "ok", **lm_study_report.summarize(ranks, job)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run only these variants (front/label)")
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
    _common.add_out_option(p)
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
        meta = _common.run_meta(sys.argv[1:] if argv is None else argv, _common.device_info("cpu"), ("torch", "jax"))
        meta["netem"] = bool(nh.probe().get("netem"))
        data = {"meta": meta, "settings": settings(args), "rows": {}, "load_samples": []}
    todo = [v for v in variants() if (args.only is None or v["name"] in args.only)]
    todo = [v for v in todo if data["rows"].get(v["name"], {}).get("status") != "ok"]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lm-study-") as tmp, nh.Network(NRANKS, None) as net:
        for i, variant in enumerate(todo):
            if time.perf_counter() - start > args.study_timeout:
                print(f"study timeout: {len(todo) - i} variants left", flush=True)
                break
            data["load_samples"].append([time.strftime("%H:%M:%S"), _common.load_average()])
            row = run_variant(args, net, variant, Path(tmp))
            data["rows"][variant["name"]] = row
            _common.finish_meta(data["meta"])
            args.out.mkdir(parents=True, exist_ok=True)
            json_path.write_text(json.dumps(data, indent=1) + "\n")
            print(f"[{i + 1}/{len(todo)}] {lm_study_report.one_line(row)}", flush=True)
    lm_study_report.write(args.out, args.name, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Native-mode step time and messages per step, this tree against an earlier revision, over emulated links.

The ranks' mean loss (and aux, and the averaged model state) of a native-mode ``DataParallel.step`` cost extra
small allreduces before they rode in the gradients' allreduce (:mod:`bagua_jax.step_means`); on a latency-bound
link each costs a round trip. This study runs the same job with this tree and with ``--baseline`` (a git revision,
extracted to a temporary folder), interleaved, 2 ranks each in its own network namespace (the harness's links)
under the native MPI engine, at each ``--links`` (default unshaped and 100 Mbit/s). The model is small (a
``--width`` MLP, gradient allreduce, one bucket) so the step is latency-bound.

Each job reports, per rank: the collectives one step traces (a :class:`~bagua_jax.counting.CountingCommunicator`
around the world), the packets its namespace sent per step (``/proc/net/dev``), and the median time per step over
``--iters`` timed iterations of ``--steps`` steps (each step waits for its result). The table gives, per link and
case, the ratio this tree / baseline of each repeat's pair, its median and range. Needs root (the namespaces)::

    python benchmarks/step_messages.py --baseline d480175 --repeats 5
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
os.environ.setdefault("BAGUA_NETNS_PREFIX", "msg-")  # beside another study's namespaces

from harness import results, study  # noqa: E402
from harness.jobs import child_env, export_tree, run_ranks, write_rank_result  # noqa: E402
from harness.links import packets_sent, parse_rate, rate_label  # noqa: E402
from harness.options import add_timeout_options  # noqa: E402
from harness.repeats import paired_ratios  # noqa: E402

CASES = ("loss", "loss_aux_state")
"""``loss``: the loss only; ``loss_aux_state``: the loss, an aux value and a model state averaged over the ranks."""
TREES = ("this", "baseline")


def worker(args: argparse.Namespace) -> None:
    """One rank of one job: time ``args.steps`` native-mode steps per iteration and write the rank's result."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from bagua_jax import DataParallel, NativeCommunicator
    from bagua_jax.counting import CountingCommunicator

    comm = NativeCommunicator.mpi_world(timeout=args.comm_timeout)
    rank = int(comm.rank())
    counter = CountingCommunicator(comm)
    with_state = args.case == "loss_aux_state"

    def loss_fn(params, batch, model_state=None):
        hidden = jnp.tanh(batch["x"] @ params["w1"])
        loss = jnp.mean((hidden @ params["w2"] - batch["y"]) ** 2)
        if not with_state:
            return loss
        return loss, ({"mean": jnp.mean(batch["x"], axis=0)}, jnp.mean(hidden))

    rng = np.random.default_rng(rank)
    width = args.width
    params = {"w1": np.full((width, width), 0.01, np.float32), "w2": np.full((width, 1), 0.01, np.float32)}
    dp = DataParallel(loss_fn, optax.sgd(1e-3), "gradient_allreduce", communicator=counter, has_aux=with_state)
    state = dp.init(params, model_state={"mean": np.zeros(width, np.float32)} if with_state else None)
    batch = {"x": rng.standard_normal((32, width)).astype(np.float32), "y": rng.standard_normal((32, 1))}
    batch["y"] = batch["y"].astype(np.float32)
    counter.reset()
    for _ in range(args.warmup):
        state, value = dp.step(state, batch)
        jax.block_until_ready(value)
    calls = counter.calls_by_op
    calls["allgather"] = calls.get("allgather", 0) - 1  # the first step's check that the batches differ
    per_step, packets_before = [], packets_sent()
    for _ in range(args.iters):
        start = time.perf_counter()
        for _ in range(args.steps):
            state, value = dp.step(state, batch)
            jax.block_until_ready(value)
        per_step.append((time.perf_counter() - start) / args.steps)
    packets = (packets_sent() - packets_before) / (args.iters * args.steps)
    result = {"calls": {op: n for op, n in calls.items() if n}, "step_s": per_step, "packets_per_step": packets}
    write_rank_result(args.result, rank, result)


@functools.cache
def _baseline(revision: str) -> Path:
    """``revision``'s tree, extracted once per run (removed at exit with its temporary folder)."""
    return export_tree(revision, Path(tempfile.mkdtemp(prefix="step-messages-")))


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--baseline", help="the git revision to compare with (e.g. the commit before the change)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--width", type=int, default=64, help="the MLP's width (width**2 + width parameters)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per job")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per job")
    parser.add_argument("--steps", type=int, default=100, help="steps per timed iteration")
    add_timeout_options(parser, comm=60, job=240)


def variants(args: argparse.Namespace) -> list[study.Variant]:
    if not (args.baseline or args.report):
        raise SystemExit("step_messages: --baseline REVISION is required")
    return [study.Variant(f"{tree} {case}", {"tree": tree, "case": case}) for case in args.cases for tree in TREES]


def measure(trial: study.Trial) -> dict[str, Any]:
    """One job of the variant's tree; tried once more when a rank wrote no result (seen under load: hydra's "Broken
    pipe" to its exited proxies), standing when every rank wrote its result even if mpiexec then failed."""
    args, result = trial.args, trial.scratch()
    tree = results.ROOT if trial.variant["tree"] == "this" else _baseline(args.baseline)
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--case", trial.variant["case"]]
    argv += ["--result", str(result), "--width", str(args.width), "--warmup", str(args.warmup)]
    argv += ["--iters", str(args.iters), "--steps", str(args.steps), "--comm-timeout", str(args.comm_timeout)]
    for _ in range(2):
        outcome = run_ranks(
            trial.net, argv, result, mpi=True, timeout=args.job_timeout, env=child_env(tree), tail_lines=30
        )
        if outcome.ranks is not None:
            break
    row = outcome.row()
    if outcome.ranks is not None:
        ranks = outcome.ranks
        step = statistics.median(statistics.fmean(r["step_s"][i] for r in ranks) for i in range(args.iters))
        row.update(calls=ranks[0]["calls"], packets_per_step=ranks[0]["packets_per_step"], step_s=step)
    return row


def _rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows, those of a results file written before the harness (a row per pair) split in two."""
    out = []
    for row in data["rows"]:
        if "variant" in row:
            out.append(row)
            continue
        link = "none" if row["rate"] == "unshaped" else row["rate"].replace(" ", "").replace("/s", "").lower()
        for tree in TREES:
            out.append(
                {
                    **row[tree],
                    "variant": f"{tree} {row['case']}",
                    "tree": tree,
                    "case": row["case"],
                    "link": link,
                    "ranks": 2,
                    "repeat": row["repeat"],
                    "status": "ok",
                }
            )
    return out


def report(data: dict[str, Any]) -> list[str]:
    rows = [r for r in _rows(data) if r["status"] == "ok" and r.get("load", {}).get("published", True)]
    revision = (data.get("settings") or {}).get("baseline") or data["meta"]["command"].split("--baseline ")[1].split()[
        0
    ]
    head = [
        "link",
        "case",
        "collectives per step (this / baseline)",
        "packets per step (this / baseline)",
        "step ms (this / baseline, medians)",
        "ratio this / baseline: median [min, max]",
    ]
    cells = []
    for link in sorted({r["link"] for r in rows}, key=study.link_order):
        for case in dict.fromkeys(r["case"] for r in rows):
            mine = {
                tree: {r["repeat"]: r for r in rows if (r["link"], r["case"], r["tree"]) == (link, case, tree)}
                for tree in TREES
            }
            common = sorted(set(mine["this"]) & set(mine["baseline"]))
            if not common:
                continue
            pairs = {tree: [mine[tree][k] for k in common] for tree in TREES}
            ratio = paired_ratios([r["step_s"] for r in pairs["this"]], [r["step_s"] for r in pairs["baseline"]])
            cells.append(
                [
                    rate_label(parse_rate(link)),
                    case,
                    " / ".join(str(pairs[t][0]["calls"]) for t in TREES),
                    " / ".join(f"{statistics.median(r['packets_per_step'] for r in pairs[t]):.1f}" for t in TREES),
                    " / ".join(f"{1e3 * statistics.median(r['step_s'] for r in pairs[t]):.3f}" for t in TREES),
                    ratio.format(".3f"),
                ]
            )
    return [f"Baseline: `{revision}`.", "", *results.table(head, cells, "llllll"), ""]


def worker_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES)
    parser.add_argument("--result")
    for name in ("width", "warmup", "iters", "steps"):
        parser.add_argument(f"--{name}", type=int)
    parser.add_argument("--comm-timeout", type=float)
    worker(parser.parse_args(argv))


STUDY = study.Study(
    name="step-messages",
    title="Native-mode step: messages per step and step time, this tree against a baseline",
    description=__doc__,
    variants=variants,
    measure=measure,
    links=("none", "100mbit"),
    ranks=(2,),
    repeats=3,
    packages=("jax", "numpy"),
    add_options=add_options,
    report=report,
    plot=False,
    worker=worker_main,
)


if __name__ == "__main__":
    sys.exit(study.main(STUDY))

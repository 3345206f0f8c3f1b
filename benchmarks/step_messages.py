"""Native-mode step time and messages per step, this tree against an earlier revision, over emulated links.

The ranks' mean loss (and aux, and the averaged model state) of a native-mode ``DataParallel.step``
cost extra small allreduces before they rode in the gradients' allreduce
(:mod:`bagua_jax.step_means`); on a latency-bound link each costs a round trip. This study runs the
same job with this tree and with ``--baseline`` (a git revision, extracted to a temporary folder),
one after the other, repeated and interleaved (the order rotates each round), 2 ranks each in its
own network namespace of :mod:`harness.links` under the native MPI engine, at each ``--rates``
(default unshaped and 100 Mbit/s; no latency is added where the kernel lacks ``sch_netem``). The
model is small (a ``--width`` MLP, gradient allreduce, one bucket) so the step is latency-bound.

Each job reports, per rank: the collectives one step traces (a
:class:`~bagua_jax.counting.CountingCommunicator` around the world), the packets its namespace sent
per step (``/proc/net/dev``), and the median time per step over ``--iters`` timed iterations of
``--steps`` steps (each step waits for its result). The table gives, per rate and case, the ratio
this tree / baseline of the median step time of each round's pair, the median and the range over
rounds, and the machine's load around the run. Needs root (the namespaces)::

    python benchmarks/step_messages.py --baseline d480175 --repeats 5
    python benchmarks/harness/links.py --cleanup   # leftovers of a killed run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
os.environ.setdefault("BAGUA_NETNS_PREFIX", "msg-")  # beside another study's namespaces

from harness import links as nh  # noqa: E402
from harness.links import packets_sent  # noqa: E402
from harness.options import add_out_option, add_timeout_options  # noqa: E402
from harness.repeats import rotated  # noqa: E402
from harness.results import finish_meta, header_lines, run_meta, write_results  # noqa: E402

CASES = ("loss", "loss_aux_state")
"""``loss``: the loss only; ``loss_aux_state``: the loss, an aux value and a model state averaged over the ranks."""


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
    Path(f"{args.result}.rank{rank}").write_text(json.dumps(result))


def baseline_tree(revision: str, into: Path) -> Path:
    """``revision`` of this repository extracted into ``into`` (the Python packages only need their sources; the
    native modules come from the installed package)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def run_job(args, net: nh.Network, tree: Path, case: str, tmp: Path, label: str) -> dict[str, Any]:
    """One job of ``tree``'s code on ``net``; the ranks' results and the median time per step (mean over ranks)."""
    result = tmp / f"{label}-{case}-{time.monotonic_ns()}"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    env["PYTHONPATH"] = str(tree)
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--case", case]  # bagua from tree
    argv += ["--result", str(result), "--width", str(args.width), "--warmup", str(args.warmup)]
    argv += ["--iters", str(args.iters), "--steps", str(args.steps), "--comm-timeout", str(args.comm_timeout)]
    # A job whose ranks did not all write their results is tried once more; one whose ranks did stands even
    # when mpiexec then failed on the way out (seen under load: hydra's "Broken pipe" to its exited proxies).
    paths = [Path(f"{result}.rank{r}") for r in range(net.ranks)]
    for attempt in (1, 2):
        for path in paths:
            path.unlink(missing_ok=True)
        with open(f"{result}.log", "w") as log:
            codes = net.run_mpi(argv, args.job_timeout, base_env=env, stdout=log)
        if all(path.exists() for path in paths):
            break
        tail = Path(f"{result}.log").read_text(errors="replace").splitlines()[-30:]
        print(f"step_messages: {label} {case}, attempt {attempt}, exit codes {codes}:\n" + "\n".join(tail), flush=True)
    else:
        raise SystemExit(f"step_messages: {label} {case} failed twice")
    ranks = [json.loads(path.read_text()) for path in paths]
    step = statistics.median(statistics.fmean(r["step_s"][i] for r in ranks) for i in range(args.iters))
    return {"calls": ranks[0]["calls"], "packets_per_step": ranks[0]["packets_per_step"], "step_s": step}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    parser.add_argument("--baseline", help="the git revision to compare with (e.g. the commit before the change)")
    parser.add_argument("--rates", nargs="+", default=["max", "100mbit"], help="link rates ('max': unshaped)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES))
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every job, interleaved")
    parser.add_argument("--width", type=int, default=64, help="the MLP's width (width**2 + width parameters)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps per job")
    parser.add_argument("--iters", type=int, default=5, help="timed iterations per job")
    parser.add_argument("--steps", type=int, default=100, help="steps per timed iteration")
    add_timeout_options(parser, comm=60, job=240)
    add_out_option(parser)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if not args.baseline:
        parser.error("--baseline REVISION is required")
    meta = run_meta(("jax", "numpy"), argv=sys.argv[1:] if argv is None else argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="step-messages-") as tmp_name:
        tmp = Path(tmp_name)
        trees = {"this": ROOT, "baseline": baseline_tree(args.baseline, Path(tempfile.mkdtemp(dir=tmp)))}
        for rate in args.rates:
            with nh.Network(2, rate, verbose=False) as net:
                for case in args.cases:
                    for repeat in range(args.repeats):
                        pair = {}
                        for label in rotated(list(trees), repeat):
                            pair[label] = run_job(args, net, trees[label], case, tmp, label)
                        ratio = pair["this"]["step_s"] / pair["baseline"]["step_s"]
                        row = {"rate": nh.rate_label(net.rate), "case": case, "repeat": repeat, "ratio": ratio, **pair}
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    finish_meta(meta)
    lines = [*header_lines(meta), "", f"Baseline: `{args.baseline}`.", ""]
    lines.append(
        "| rate | case | collectives per step (this / baseline) | packets per step (this / baseline) "
        "| step ms (this / baseline, medians) | ratio this / baseline: median [min, max] |"
    )
    lines.append("|---|---|---|---|---|---|")
    for rate in dict.fromkeys(r["rate"] for r in rows):
        for case in args.cases:
            mine = [r for r in rows if r["rate"] == rate and r["case"] == case]
            ratios = [r["ratio"] for r in mine]
            calls = " / ".join(str(mine[0][k]["calls"]) for k in ("this", "baseline"))
            packets = " / ".join(
                f"{statistics.median(r[k]['packets_per_step'] for r in mine):.1f}" for k in ("this", "baseline")
            )
            ms = " / ".join(
                f"{1e3 * statistics.median(r[k]['step_s'] for r in mine):.3f}" for k in ("this", "baseline")
            )
            spread = f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}]"
            lines.append(f"| {rate} | {case} | {calls} | {packets} | {ms} | {spread} |")
    md_path, json_path = write_results(args.out, "step-messages", lines, {"meta": meta, "rows": rows})
    print("\n".join(lines))
    print(f"wrote {md_path} and {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

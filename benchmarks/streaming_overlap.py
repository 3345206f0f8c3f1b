"""Does JAX Streaming DiLoCo hide its exchanges behind the inner steps? Step times over shaped links.

The same training (an MLP of ``--layers`` x ``--width`` x ``--width`` matrices, AdamW inside, DiLoCo
outside with ``fragments`` P, ``sync_every`` H and the largest delay ``tau = H // P - 1``) runs on
``--ranks`` ranks over the emulated network of :mod:`harness.links` (``--rate`` per rank, MPI
over TCP), in two modes:

* ``in_step``: the exchanges run inside the applying step (the communicator handed to
  :func:`bagua_jax.algorithms.diloco.diloco` behind a plain wrapper, which is what a mesh or NCCL
  gets, and what JAX did for every communicator before the background exchange): every
  ``H // P``-th step waits for a fragment's whole wire time;
* ``overlapped``: the NativeCommunicator itself, so each exchange runs on the transform's thread
  during the next tau steps;
* ``local``: the inner optimizer alone, no DiLoCo and no communication: the floor that a perfect
  overlap reaches (on a machine with cores to spare for the exchanges).

Jobs alternate between the modes and fragment counts, ``--repeats`` times, so both see the same
machine. Each job trains ``--warmup-rounds`` rounds of H steps untimed, then ``--rounds`` timed
rounds; a step's time is its wall time (``block_until_ready``) averaged over the ranks. The table
gives per job the mean step time (every step of whole rounds, the exchanges' share included), the
median (a step without waiting), the mean of the applying steps, the bytes each rank sent per
step (``/proc/net/dev`` of its namespace) and the load average before the job.

    python benchmarks/streaming_overlap.py                         # 4 ranks, 100 Mbit/s, P = 2 and 4
    BAGUA_NETNS_PREFIX=bso- python benchmarks/streaming_overlap.py --repeats 3   # next to another study
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import links as nh  # noqa: E402
from harness.jobs import child_env  # noqa: E402
from harness.links import bytes_sent  # noqa: E402
from harness.machine import load_average  # noqa: E402
from harness.options import add_out_option, add_timeout_options  # noqa: E402
from harness.repeats import rotated  # noqa: E402
from harness.results import finish_meta, header_lines, run_meta, write_results  # noqa: E402

MODES = ("in_step", "overlapped", "local")


class InStepCommunicator:
    """A NativeCommunicator behind a plain wrapper: DiLoCo then exchanges inside the applying step."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)


def worker(job_path: str) -> None:
    """One rank of a job (under ``bagua-launch --mpi``): train, time every step, write ``<result>.rank<r>``."""
    import jax
    import jax.numpy as jnp
    import optax

    from bagua_jax import NativeCommunicator
    from bagua_jax.algorithms.diloco import diloco

    job = json.loads(Path(job_path).read_text())
    comm = NativeCommunicator.mpi_world(timeout=job["comm_timeout"])
    rank = int(comm.rank())
    h, p = job["sync_every"], job["fragments"]
    options = {
        "sync_every": h,
        "fragments": p,
        "fragment_sync_delay": h // p - 1,
        "outer_exchange": job["outer_exchange"],
        "round_start_memory": "device",
    }
    tx = optax.adamw(1e-3)
    if job["mode"] != "local":
        tx = optax.chain(tx, diloco(comm if job["mode"] == "overlapped" else InStepCommunicator(comm), **options))
    keys = jax.random.split(jax.random.key(0), job["layers"] + 2)
    width = job["width"]
    params = [jax.random.normal(k, (width, width), jnp.float32) / width**0.5 for k in keys[: job["layers"]]]
    x = jax.random.normal(jax.random.fold_in(keys[-2], rank), (job["batch"], width), jnp.float32)
    y = jax.random.normal(jax.random.fold_in(keys[-1], rank), (job["batch"], width), jnp.float32)

    def loss(params, x, y):
        for w in params[:-1]:
            x = jnp.tanh(x @ w)
        return jnp.mean((x @ params[-1] - y) ** 2)

    @jax.jit
    def step(params, opt_state):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    state = (params, tx.init(params))
    # The timed steps start right after a fragment was applied: no exchange is on the wire, in either mode.
    for _ in range(job["warmup_rounds"] * h + h // p - 1):
        state = jax.block_until_ready(step(*state))[:2]
    times, sent = [], bytes_sent()
    for _ in range(job["rounds"] * h):
        start = time.perf_counter()
        state = jax.block_until_ready(step(*state))[:2]
        times.append(time.perf_counter() - start)
    sent = (bytes_sent() - sent) / len(times)
    Path(f"{job['result']}.rank{rank}").write_text(json.dumps({"step_s": times, "bytes_sent_per_step": sent}))


def run_job(args, net: nh.Network, mode: str, fragments: int, tmp: Path) -> dict[str, Any]:
    """One job on ``net``; its row: the timings averaged over the ranks, or why it failed."""
    result = tmp / f"{mode}-p{fragments}-{time.monotonic_ns()}"
    job = {
        "mode": mode,
        "fragments": fragments,
        "result": str(result),
        **{k: getattr(args, k) for k in ("sync_every", "outer_exchange", "layers", "width", "batch", "comm_timeout")},
        **{k: getattr(args, k) for k in ("warmup_rounds", "rounds")},
    }
    job_path = tmp / f"{result.name}.json"
    job_path.write_text(json.dumps(job))
    row: dict[str, Any] = {"mode": mode, "fragments": fragments, "load_average_before": load_average()}
    with open(tmp / f"{result.name}.log", "w") as log:
        codes = net.run_mpi([sys.executable, __file__, "--worker", str(job_path)], args.job_timeout, child_env(), log)
    ranks = [
        json.loads(Path(f"{result}.rank{r}").read_text())
        for r in range(net.ranks)
        if Path(f"{result}.rank{r}").exists()
    ]
    if len(ranks) != net.ranks:
        row.update(status="failed", exit_codes=codes, log_tail=(tmp / f"{result.name}.log").read_text()[-1500:])
        return row
    steps = [statistics.fmean(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    # Timed step i is inner step warmup_rounds * H + period + i, and fragment p is applied after the steps t with
    # t - tau - p * period a multiple of H (tau = period - 1): the last of every period steps.
    period = args.sync_every // fragments
    applying = steps[period - 1 :: period]
    row.update(
        status="ok",
        step_s_mean=statistics.fmean(steps),
        step_s_median=statistics.median(steps),
        applying_step_s_mean=statistics.fmean(applying),
        bytes_sent_per_step=statistics.fmean(r["bytes_sent_per_step"] for r in ranks),
        step_s_all=[round(s, 4) for s in steps],
    )
    return row


def table_lines(meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    lines = ["# JAX Streaming DiLoCo: exchanges in the step vs overlapped with the next steps", ""]
    lines += header_lines(meta)
    lines += [
        f"- {meta['ranks']} ranks, {meta['rate']} per rank (MPI over TCP), MLP {meta['layers']} x "
        f"{meta['width']}x{meta['width']} ({meta['parameters'] / 1e6:.2f}M parameters), batch {meta['batch']}, "
        f"AdamW inside, H = {meta['sync_every']}, tau = H/P - 1, outer exchange {meta['outer_exchange']}",
        "",
        "| P | repeat | mode | mean step (s) | median step (s) | applying step (s) | sent/step (MB) | load before |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        head = f"| {row['fragments']} | {row['repeat']} | {row['mode']} |"
        if row["status"] != "ok":
            lines.append(f"{head} {row['status']} | | | | {row['load_average_before']} |")
            continue
        lines.append(
            f"{head} {row['step_s_mean']:.3f} | {row['step_s_median']:.3f} | {row['applying_step_s_mean']:.3f} | "
            f"{row['bytes_sent_per_step'] / 1e6:.2f} | {row['load_average_before']} |"
        )
    lines += [
        "",
        "Per repeat: mean step time of overlapped and of local over in-step's, and the share of the exchanges' time"
        " hidden, (in-step - overlapped) / (in-step - local):",
        "",
    ]
    for p in meta["fragments"]:
        cells = []
        for repeat in range(meta["repeats"]):
            jobs = {
                r["mode"]: r["step_s_mean"]
                for r in rows
                if r["fragments"] == p and r["repeat"] == repeat and r["status"] == "ok"
            }
            if len(jobs) == len(MODES):
                base, over, local = jobs["in_step"], jobs["overlapped"], jobs["local"]
                cells.append(f"{over / base:.2f} / {local / base:.2f} / {(base - over) / (base - local):.0%}")
        lines.append(f"- P = {p}: " + "; ".join(cells))
    return lines + [""]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    nh.add_link_options(parser)
    parser.add_argument("--fragments", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--outer-exchange", default="fp32", choices=("fp32", "bf16", "uint8", "uint4"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    add_timeout_options(parser, comm=120, job=300)
    add_out_option(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    meta = run_meta(
        ("jax", "optax"),
        argv=sys.argv[1:] if argv is None else argv,
        ranks=args.ranks,
        rate=args.rate,
        parameters=args.layers * args.width**2,
        **{k: getattr(args, k) for k in ("fragments", "sync_every", "outer_exchange", "layers", "width", "batch")},
        repeats=args.repeats,
    )
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="streaming-overlap-") as tmp, nh.Network(args.ranks, args.rate) as net:
        for repeat in range(args.repeats):
            for fragments in args.fragments:
                for mode in rotated(MODES, repeat):
                    row = run_job(args, net, mode, fragments, Path(tmp))
                    rows.append({**row, "repeat": repeat})
                    print(json.dumps(rows[-1]), flush=True)
    finish_meta(meta)
    stem = f"streaming-overlap-{args.ranks}ranks"
    md, js = write_results(args.out, stem, table_lines(meta, rows), {"meta": meta, "rows": rows})
    print(f"wrote {md} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Does JAX Streaming DiLoCo hide its exchanges behind the inner steps? Step times over shaped links.

The same training (an MLP of ``--layers`` x ``--width`` x ``--width`` matrices, AdamW inside, DiLoCo outside with
``fragments`` P, ``sync_every`` H and the largest delay ``tau = H // P - 1``) runs on ``--ranks`` ranks over the
harness's links (``--links``, 100 Mbit/s per rank by default; MPI over TCP), in three modes:

* ``in_step``: the exchanges run inside the applying step (the communicator handed to
  :func:`bagua_jax.algorithms.diloco.diloco` behind a plain wrapper, which is what a mesh or NCCL gets): every
  ``H // P``-th step waits for a fragment's whole wire time;
* ``overlapped``: the NativeCommunicator itself, so each exchange runs on the transform's thread during the next
  tau steps;
* ``local``: the inner optimizer alone, no DiLoCo and no communication: the floor a perfect overlap reaches.

Each job trains ``--warmup-rounds`` rounds of H steps untimed, then ``--rounds`` timed rounds; a step's time is its
wall time (``block_until_ready``) averaged over the ranks. Per job: the mean step time (every step of whole
rounds, the exchanges' share included: the table's figure), the median (a step without waiting), the mean of the
applying steps and the bytes each rank sent per step; the repeats interleave the modes and fragment counts.

    python benchmarks/streaming_overlap.py                         # 4 ranks, 100 Mbit/s, P = 2 and 4
    BAGUA_NETNS_PREFIX=bso- python benchmarks/streaming_overlap.py --repeats 3   # next to another study
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from harness import results, study  # noqa: E402
from harness.jobs import run_ranks, write_rank_result  # noqa: E402
from harness.links import bytes_sent  # noqa: E402
from harness.options import add_timeout_options  # noqa: E402
from harness.repeats import spread  # noqa: E402

MODES = ("in_step", "overlapped", "local")
JOB_FIELDS = ("sync_every", "outer_exchange", "layers", "width", "batch", "comm_timeout", "warmup_rounds", "rounds")


class InStepCommunicator:
    """A NativeCommunicator behind a plain wrapper: DiLoCo then exchanges inside the applying step."""

    def __init__(self, comm: Any) -> None:
        self._comm = comm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)


def worker(job_path: str) -> None:
    """One rank of a job (under ``bagua-launch --mpi``): train, time every step, write its result."""
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
    write_rank_result(job["result"], rank, {"step_s": times, "bytes_sent_per_step": (bytes_sent() - sent) / len(times)})


def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fragments", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--sync-every", type=int, default=16)
    parser.add_argument("--outer-exchange", default="fp32", choices=("fp32", "bf16", "uint8", "uint4"))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=2)
    add_timeout_options(parser, comm=120, job=300)


def variants(args: argparse.Namespace) -> list[study.Variant]:
    return [study.Variant(f"P={p} {mode}", {"fragments": p, "mode": mode}) for p in args.fragments for mode in MODES]


def measure(trial: study.Trial) -> dict[str, Any]:
    """One job: the step times averaged over the ranks, or why it failed."""
    args, result = trial.args, trial.scratch()
    job = {
        "mode": trial.variant["mode"],
        "fragments": trial.variant["fragments"],
        "result": str(result),
        **{k: getattr(args, k) for k in JOB_FIELDS},
    }
    job_path = Path(f"{result}.job.json")
    job_path.write_text(json.dumps(job))
    outcome = run_ranks(
        trial.net,
        [sys.executable, __file__, "--worker", str(job_path)],
        result,
        mpi=True,
        timeout=args.job_timeout,
        tail_lines=30,
    )
    row = outcome.row()
    if outcome.ranks is None:
        return row
    ranks = outcome.ranks
    steps = [statistics.fmean(r["step_s"][i] for r in ranks) for i in range(len(ranks[0]["step_s"]))]
    # Timed step i is inner step warmup_rounds * H + period + i, and fragment p is applied after the steps t with
    # t - tau - p * period a multiple of H (tau = period - 1): the last of every period steps.
    period = args.sync_every // trial.variant["fragments"]
    row.update(
        step_s=statistics.fmean(steps),
        step_s_median=statistics.median(steps),
        applying_step_s_mean=statistics.fmean(steps[period - 1 :: period]),
        bytes_sent_per_step=statistics.fmean(r["bytes_sent_per_step"] for r in ranks),
        step_s_all=[round(s, 4) for s in steps],
    )
    return row


def _upgraded(row: dict[str, Any]) -> dict[str, Any]:
    """A row of a results file written before the harness."""
    if "variant" in row or row["status"] != "ok":
        return {"variant": f"P={row['fragments']} {row['mode']}", **row}
    return {**row, "variant": f"P={row['fragments']} {row['mode']}", "step_s": row["step_s_mean"]}


def report(data: dict[str, Any]) -> list[str]:
    rows = [_upgraded(r) for r in data["rows"]]
    settings = data.get("settings") or data["meta"]
    fragments = settings["fragments"]
    lines = [
        f"- MLP {settings['layers']} x {settings['width']}x{settings['width']} "
        f"({settings['layers'] * settings['width'] ** 2 / 1e6:.2f}M parameters), batch {settings['batch']}, AdamW "
        f"inside, H = {settings['sync_every']}, tau = H/P - 1, outer exchange {settings['outer_exchange']}; "
        "seconds per step, median over the repeats [min, max]",
        "",
    ]
    ok = [r for r in rows if r["status"] == "ok" and r.get("load", {}).get("published", True)]
    cells = []
    for p in fragments:
        for mode in MODES:
            mine = [r for r in ok if (r["fragments"], r["mode"]) == (p, mode)]
            if mine:
                cells.append(
                    [
                        p,
                        mode,
                        *(
                            spread(r[k] for r in mine).format(".3f")
                            for k in ("step_s", "step_s_median", "applying_step_s_mean")
                        ),
                        f"{statistics.median(r['bytes_sent_per_step'] for r in mine) / 1e6:.2f}",
                    ]
                )
    head = ["P", "mode", "mean step (s)", "median step (s)", "applying step (s)", "sent/step (MB)"]
    lines += [*results.table(head, cells, "llrrrr"), ""]
    lines += [
        "Per repeat: mean step time of overlapped and of local over in-step's, and the share of the exchanges' time "
        "hidden, (in-step - overlapped) / (in-step - local):",
        "",
    ]
    for p in fragments:
        cells = []
        for repeat in sorted({r["repeat"] for r in ok}):
            jobs = {r["mode"]: r["step_s"] for r in ok if r["fragments"] == p and r["repeat"] == repeat}
            if len(jobs) == len(MODES):
                base, over, local = jobs["in_step"], jobs["overlapped"], jobs["local"]
                cells.append(f"{over / base:.2f} / {local / base:.2f} / {(base - over) / (base - local):.0%}")
        lines.append(f"- P = {p}: " + "; ".join(cells))
    return lines + [""]


STUDY = study.Study(
    name="streaming-overlap",
    title="JAX Streaming DiLoCo: exchanges in the step vs overlapped with the next steps",
    description=__doc__,
    variants=variants,
    measure=measure,
    metric_label="mean time per step",
    links=("100mbit",),
    ranks=(4,),
    repeats=2,
    packages=("jax", "optax"),
    add_options=add_options,
    report=report,
    worker=lambda argv: worker(argv[0]),
)


if __name__ == "__main__":
    sys.exit(study.main(STUDY))

"""Fault tolerance on the GPT workload (issue 42): the fault-free overhead, and a chaos run with replacements.

Two studies, both torch over gloo, plain processes on this machine or, with ``--rate``, one network
namespace per rank on links of that rate (``harness.links``, root only):

* ``overhead``: the same job with fault tolerance off (``init_process_group()``) and on
  (``init_process_group(fault_tolerance=True)``: a vote per step in the coordinator's store,
  heartbeats, the replica check every ``BAGUA_FT_HASH_EVERY`` steps), alternated ``--repeats``
  times (A B, B A, ...); reported: the median step time of each and their ratio, per run.
* ``chaos``: ``bagua-launch --fault-tolerant`` runs the job for ``--minutes``; every ``--every``
  seconds a random rank is killed (SIGKILL) and its slot starts a replacement that joins the
  running job. A fault-free run of the same length is the reference. Reported: the held-out
  loss against tokens of both, every failure's seconds to resume and steps lost (from the ranks'
  logs), each replacement's seconds from asking to be admitted to training.

Commands (results under ``benchmarks/results/fault_tolerance-<study>.{json,md}``)::

    python benchmarks/fault_tolerance.py overhead --ranks 4 --steps 60 --repeats 3 [--rate 100mbit]
    python benchmarks/fault_tolerance.py chaos --ranks 4 --minutes 20 --every 60 [--rate 100mbit]

A rank of either is ``python benchmarks/fault_tolerance.py rank JOB.json`` (``JOB.json``: the
settings; it appends JSON lines to ``<folder>/rank-<pid>.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HASH_EVERY = 50


def rank_main(job_file: str) -> None:
    """One rank: train the GPT ``size`` with ``algorithm``; log every step (time, loss, world) and, on the first
    member, the held-out loss every ``eval_every`` steps."""
    import torch

    import bagua_torch
    from bagua_common.workload import load_corpus
    from bagua_torch.models.gpt import GPT, next_token_loss

    job = json.loads(Path(job_file).read_text())
    log = open(Path(job["folder"]) / f"rank-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115 (whole run)

    def record(**fields: object) -> None:
        log.write(json.dumps({"time": time.time(), **fields}) + "\n")

    torch.set_num_threads(1)
    group = bagua_torch.init_process_group("gloo", fault_tolerance=job["fault_tolerant"], timeout=300)
    model = GPT(job["size"], seed=job["seed"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=job["lr"])
    wrapped = bagua_torch.with_bagua(model, [optimizer], job["algorithm"])
    corpus = load_corpus()
    length = model.config.context + 1
    heldout = torch.from_numpy(corpus.heldout_batch(32, length))
    ft = group.fault_tolerance

    def train(step: int, rank: int, world: int) -> float:
        tokens = torch.from_numpy(corpus.batch(job["seed"], step, rank, job["batch"], length))
        loss = next_token_loss(wrapped(tokens[:, :-1]), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss)

    def evaluate(step: int, world: int) -> None:
        with torch.no_grad():
            loss = float(next_token_loss(model(heldout[:, :-1]), heldout))
        record(event="heldout", step=step, tokens=step * world * job["batch"] * (length - 1), loss=loss)

    deadline = time.monotonic() + job["seconds"] if job["seconds"] else None
    if ft is None:
        for step in range(1, job["steps"] + 1):
            started = time.perf_counter()
            loss = train(step, group.rank, group.size)
            record(event="step", step=step, world=group.size, seconds=time.perf_counter() - started, loss=loss)
    else:
        for step in ft.steps(job["steps"] or 10**9):
            if deadline is not None and time.monotonic() > deadline:
                break
            started = time.perf_counter()
            with step:
                loss = train(step.number, step.rank, step.world_size)
            if ft.step == step.number:
                seconds = time.perf_counter() - started
                record(event="step", step=step.number, world=step.world_size, seconds=seconds, loss=loss)
                if step.rank == 0 and step.number % job["eval_every"] == 0:
                    evaluate(step.number, step.world_size)
        record(event="end", recoveries=ft.recoveries, joined=getattr(ft, "joined_after", None))
        ft.close()


def job_file(folder: Path, args: argparse.Namespace, fault_tolerant: bool, seconds: float = 0) -> Path:
    path = folder / "job.json"
    path.write_text(
        json.dumps(
            {
                "folder": str(folder),
                "size": args.size,
                "algorithm": args.algorithm,
                "lr": args.lr,
                "batch": args.batch,
                "seed": args.seed,
                "steps": args.steps if not seconds else 0,
                "seconds": seconds,
                "eval_every": args.eval_every,
                "fault_tolerant": fault_tolerant,
            }
        )
    )
    return path


def environment(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "BAGUA_FT_HASH_EVERY": str(HASH_EVERY), **extra}


def launch(ranks: int, job: Path, fault_tolerant: bool) -> subprocess.Popen:
    """The job's ranks under ``bagua-launch`` (``--fault-tolerant``: a slot replaces its rank when it dies)."""
    command = [sys.executable, "-m", "bagua_launch", "--nproc-per-node", str(ranks)]
    command += ["--fault-tolerant"] if fault_tolerant else []
    command += [str(Path(__file__).resolve()), "rank", str(job)]
    return subprocess.Popen(command, env=environment(), start_new_session=True)


def run_ranks(ranks: int, job: Path, rate: str | None) -> None:
    """Run the job's ranks to the end: local processes, or one per network namespace on links of ``rate``."""
    if rate is None:
        launch(ranks, job, False).wait()
        return
    from harness.links import Network

    from bagua_common.job.local_launch import free_port

    with Network(ranks, rate) as net:
        net.run_all([sys.executable, str(Path(__file__).resolve()), "rank", str(job)], free_port(), 3600, environment())


def lines(folder: Path) -> dict[str, list[dict]]:
    return {p.name: [json.loads(line) for line in p.read_text().splitlines()] for p in folder.glob("rank-*.jsonl")}


def overhead(args: argparse.Namespace) -> dict:
    runs = []
    for repeat in range(args.repeats):
        for fault_tolerant in (False, True) if repeat % 2 == 0 else (True, False):
            with tempfile.TemporaryDirectory() as scratch:
                folder = Path(scratch)
                run_ranks(args.ranks, job_file(folder, args, fault_tolerant), args.rate)
                steps = [e["seconds"] for log in lines(folder).values() for e in log if e["event"] == "step"]
                steps = steps[len(steps) // 5 :]  # the first fifth warms up
                runs.append({"fault_tolerant": fault_tolerant, "repeat": repeat, "step_s": statistics.median(steps)})
                print(json.dumps(runs[-1]), flush=True)
    on = statistics.median(r["step_s"] for r in runs if r["fault_tolerant"])
    off = statistics.median(r["step_s"] for r in runs if not r["fault_tolerant"])
    return {"runs": runs, "step_s_off": off, "step_s_on": on, "overhead": on / off - 1}


def chaos(args: argparse.Namespace) -> dict:
    result: dict = {}
    for name, kill in (("fault_free", False), ("chaos", True)):
        with tempfile.TemporaryDirectory() as scratch:
            folder = Path(scratch)
            proc = launch(args.ranks, job_file(folder, args, True, args.minutes * 60), True)
            kills, started = [], time.monotonic()
            while proc.poll() is None:
                time.sleep(args.every if kill else 1)
                if not kill or proc.poll() is not None:
                    continue
                ranks = _worker_pids(proc.pid)
                if ranks:
                    victim = random.choice(ranks)
                    os.kill(victim, signal.SIGKILL)
                    kills.append({"pid": victim, "seconds": time.monotonic() - started})
            logs = lines(folder)
            result[name] = {
                "kills": kills,
                "heldout": sorted(
                    (e for log in logs.values() for e in log if e["event"] == "heldout"), key=lambda e: e["step"]
                ),
                "recoveries": [e["recoveries"] for log in logs.values() for e in log if e["event"] == "end"],
                "joined": [e["joined"] for log in logs.values() for e in log if e["event"] == "end" and e["joined"]],
            }
    return result


def _worker_pids(launcher: int) -> list[int]:
    """The training processes under the launcher (processes running this file's ``rank``, descendants of it)."""
    parents, ranks = {}, []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        pid = int(stat.parent.name)
        parents[pid] = int(fields[1])
        if b"rank" in argv and any(a.endswith(b"fault_tolerance.py") for a in argv) and b"bagua_launch" not in argv:
            ranks.append(pid)

    def descends(pid: int) -> bool:
        while pid > 1:
            if pid == launcher:
                return True
            pid = parents.get(pid, 1)
        return False

    return [pid for pid in ranks if descends(pid)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("study", choices=("overhead", "chaos", "rank"))
    parser.add_argument("job", nargs="?", help="(rank) the job's settings")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--size", default="small", help="the GPT (bagua_common.workload.gpt_spec)")
    parser.add_argument("--algorithm", default="gradient_allreduce")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--every", type=float, default=60)
    parser.add_argument("--rate", default=None, help="(overhead) shaped links, e.g. 100mbit (harness.links, root)")
    args = parser.parse_args(argv)
    if args.study == "rank":
        rank_main(args.job)
        return
    result = overhead(args) if args.study == "overhead" else chaos(args)
    out = ROOT / "benchmarks" / "results" / f"fault_tolerance-{args.study}.json"
    out.write_text(
        json.dumps(
            {"command": " ".join(["python", "benchmarks/fault_tolerance.py", *sys.argv[1:]]), "result": result},
            indent=1,
        )
    )
    print(json.dumps(result)[:2000])


if __name__ == "__main__":
    main()

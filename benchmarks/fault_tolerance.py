"""Fault tolerance on the GPT workload (issue 42): the fault-free overhead, and a chaos run with replacements.

Four studies, torch over gloo, plain processes on this machine or, with ``--rate`` (overhead, chaos, spread), one
network namespace per rank on links of that rate (``harness.links``, root only; under chaos, each namespace is a
node with its own launcher). ``--front-end jax`` runs the chaos and spread studies with JAX ranks on a native host
engine instead (``--engine``: TCP, or MPI under ``bagua-launch --fault-tolerant --mpi``;
``benchmarks/fault_tolerance_jax.py`` has JAX's other studies):

* ``overhead``: the same job with fault tolerance off (``init_process_group()``) and on
  (``init_process_group(fault_tolerance=True)``: a vote per step in the coordinator's store,
  heartbeats, the replica check every ``BAGUA_FT_HASH_EVERY`` steps), alternated ``--repeats``
  times (A B, B A, ...); reported: the median step time of each and their ratio, per run.
* ``kill``: ``--ranks`` plain processes train fault-tolerantly; at step ``--kill-step`` the last rank SIGKILLs
  itself in its backward pass (a gradient hook of the first layer: the others wait in the step's allreduce).
  Reported per survivor: the seconds from the kill to the retried step starting, and the steps lost.
* ``chaos``: ``bagua-launch --fault-tolerant`` runs the job for ``--steps`` steps; every ``--every``
  seconds a random rank is killed (SIGKILL) and its slot starts a replacement that joins the
  running job. A fault-free run of the same steps is the reference (the steps are the members' agreed end:
  a time limit would be each rank's own, and a rank leaving mid-step is a failure). Reported: the held-out
  loss against tokens of both, every failure's seconds to resume and steps lost (from the ranks'
  logs), each replacement's seconds from asking to be admitted to training.
* ``spread``: fault-free runs of the chaos study's settings at other ``--seeds`` (initialization and data order),
  beside the chaos study's runs (read from ``--out``): the run-to-run spread the chaos run's curve is judged
  against, at equal tokens.

Commands (results under ``benchmarks/results/fault-tolerance-<front end>-<study>[-<algorithm>].{json,md}``, or
``--out``; timings with nothing else running: the header records the load before and after; ``--algorithm`` is a
name, then optionally its options as JSON, e.g. ``'diloco {"sync_every": 20}'``)::

    python benchmarks/fault_tolerance.py kill --ranks 3 --steps 8 --kill-step 5 --repeats 3
    python benchmarks/fault_tolerance.py overhead --ranks 4 --size mini --steps 60 --repeats 5 [--rate 100mbit]
    python benchmarks/fault_tolerance.py chaos --ranks 4 --size mini --steps 1500 --every 60 [--rate 100mbit]
    python benchmarks/fault_tolerance.py chaos --front-end jax --ranks 4 --size mini --steps 1500 --every 60
    python benchmarks/fault_tolerance.py spread --ranks 4 --size mini --steps 1500 --seeds 1,2 [--rate 100mbit]

``python benchmarks/fault_tolerance.py report STUDY[-ALGORITHM]`` writes a study's Markdown and chart again from its
JSON.

A rank of either is ``python benchmarks/fault_tolerance.py rank JOB.json`` (``JOB.json``: the
settings; it appends JSON lines to ``<folder>/rank-<pid>.jsonl``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from harness.results import RESULTS, finish_meta, header_lines, run_meta, table, write_results  # noqa: E402
from lm_study_report import loss_at  # noqa: E402

from bagua_common.workload import gpt_config  # noqa: E402

HASH_EVERY = 50
STUDIES = ("kill", "overhead", "chaos", "spread")
SAME_RUN = ("ranks", "size", "algorithm", "lr", "batch", "steps", "eval_every", "rate", "engine")
"""The settings two runs share for the spread study to set them side by side (all but the seed)."""


def rank_main(job_file: str) -> None:
    """One rank: train the GPT ``size`` with ``algorithm``; log every step (time, loss, world) and, on the first
    member, the held-out loss every ``eval_every`` steps."""
    job = json.loads(Path(job_file).read_text())
    log = open(Path(job["folder"]) / f"rank-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115 (whole run)

    def record(**fields: object) -> None:
        log.write(json.dumps({"time": time.time(), **fields}) + "\n")

    (jax_rank if job.get("front_end") == "jax" else torch_rank)(job, record)


def torch_rank(job: dict, record: Callable[..., None]) -> None:
    """A torch rank over gloo (:func:`rank_main`)."""
    import torch

    import bagua_torch
    from bagua_common.algorithms.registry import algorithm_facts
    from bagua_common.workload import load_corpus
    from bagua_torch.algorithms import algorithm_class, get_algorithm
    from bagua_torch.models.gpt import GPT, next_token_loss

    torch.set_num_threads(1)
    group = bagua_torch.init_process_group("gloo", fault_tolerance=job["fault_tolerant"], timeout=300)
    model = GPT(job["size"], seed=job["seed"])
    name, _, options = job["algorithm"].partition(" ")
    options = json.loads(options or "{}")
    # An algorithm that is an optimizer itself (QAdam, 1-bit Adam) brings its own (Adam, weight decay 0), warm-up steps
    # among its options (100 by default); the others train with AdamW.
    if algorithm_facts(name).is_optimizer:
        adam = algorithm_class(name)
        optimizer = adam.optimizer_class(
            model.parameters(), lr=job["lr"], warmup_steps=options.pop("warmup_steps", 100)
        )
        algorithm = adam(optimizer, **options)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=job["lr"])
        algorithm = get_algorithm(name, **options)
    wrapped = bagua_torch.with_bagua(model, [optimizer], algorithm)
    corpus = load_corpus()
    length = model.config.context + 1
    heldout = torch.from_numpy(corpus.heldout_batch(32, length))
    ft = group.fault_tolerance
    record(event="start", rank=group.rank)
    in_flight = {"step": 0}
    if job.get("kill_step") and group.rank == group.size - 1:  # the kill study's victim: dies in its backward pass

        def die(gradient: torch.Tensor) -> None:
            if in_flight["step"] == job["kill_step"]:
                (Path(job["folder"]) / "kill-time").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

        next(model.parameters()).register_hook(die)

    def train(step: int, rank: int, world: int) -> float:
        in_flight["step"] = step
        tokens = torch.from_numpy(corpus.batch(job["seed"], step, rank, job["batch"], length))
        loss = next_token_loss(wrapped(tokens[:, :-1]), tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.detach())

    def evaluate(step: int, world: int) -> None:
        with torch.no_grad():
            loss = float(next_token_loss(model(heldout[:, :-1]), heldout))
        record(event="heldout", step=step, tokens=step * world * job["batch"] * (length - 1), loss=loss)

    if ft is None:
        for step in range(1, job["steps"] + 1):
            started, cpu = time.perf_counter(), time.process_time()
            loss = train(step, group.rank, group.size)
            seconds = time.perf_counter() - started
            cpu = time.process_time() - cpu
            record(event="step", step=step, world=group.size, seconds=seconds, cpu=cpu, loss=loss, ended=time.time())
    else:
        for step in ft.steps(job["steps"] or 10**9):
            started, cpu, members = time.perf_counter(), time.process_time(), ft.epoch.size
            record(event="attempt", step=step.number)
            with step:
                loss = train(step.number, step.rank, step.world_size)
            if ft.step == step.number:
                seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
                ended = time.time()
                record(
                    event="step",
                    step=step.number,
                    world=step.world_size,
                    members=members,
                    seconds=seconds,
                    cpu=cpu,
                    loss=loss,
                    ended=ended,
                )
                # after any recovery the step ended in (DiLoCo's exchange retried): the first member then evaluates
                if ft.training_place()[0] == 0 and step.number % job["eval_every"] == 0:
                    evaluate(step.number, step.world_size)
        record(event="end", recoveries=ft.recoveries, joined=getattr(ft, "joined_after", None))
        ft.close()


def jax_rank(job: dict, record: Callable[..., None]) -> None:
    """A JAX rank on a native host engine (:func:`rank_main`, the job's ``engine``), fault-tolerant
    (``FaultTolerantTrainer``; a replacement, ``BAGUA_FT_JOIN=1``, joins the running job): the same log as a torch
    rank's. Its samples are a fixed
    set of windows, re-partitioned among the members at every change (``DataPosition``)."""
    record(event="launched")
    import jax
    import optax

    from bagua_common.fault_tolerance import DataPosition, FaultToleranceSettings, Membership
    from bagua_common.fault_tolerance.kv_store import advertised_host
    from bagua_common.workload import load_corpus
    from bagua_jax import DataParallel, NativeCommunicator
    from bagua_jax.algorithms import is_optimizer, make_algorithm
    from bagua_jax.fault_tolerance import FaultTolerantTrainer
    from bagua_jax.models.gpt import GPT, gpt_loss_fn, gpt_params

    corpus, length = load_corpus(), gpt_config(job["size"]).context + 1
    windows = corpus.batch(job["seed"], 0, 0, job["batch"] * job["ranks"] * job["steps"], length)
    heldout = {"tokens": corpus.heldout_batch(32, length)}
    loss_fn = gpt_loss_fn(job["size"])
    settings = FaultToleranceSettings.from_environment()
    master = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    data = DataPosition(len(windows), job["batch"], seed=job["seed"])

    attempt = {}  # the members and those among them training, at the step's last attempt (the committed one)

    def batch_of(indices):
        attempt.update(members=ft.epoch.size, world=ft.trainers)
        return {"tokens": windows[indices]}

    name, _, options = job["algorithm"].partition(" ")

    def trainer_over(communicator):  # an algorithm that is an optimizer itself (QAdam, 1-bit Adam) brings its own
        optimizer = None if is_optimizer(name) else optax.adamw(job["lr"])
        algorithm = make_algorithm(name, **json.loads(options or "{}"))
        return DataParallel(loss_fn, optimizer, algorithm, communicator=communicator)

    tcp = job["engine"] == "tcp"
    if os.environ.get("BAGUA_FT_JOIN") == "1":
        alone = NativeCommunicator.tcp_self(advertised_host(master[0])) if tcp else NativeCommunicator.mpi_self()
        ft = FaultTolerantTrainer.joiner(trainer_over(alone), data, settings, master)
    else:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        membership = Membership.start(settings, rank, size, *master)
        store = membership.epoch.store
        communicator = (
            NativeCommunicator.tcp_through_store(store, "world/", rank, size, membership.me.host)
            if tcp
            else NativeCommunicator.mpi_through_store(store, "world/", rank, size)
        )
        ft = FaultTolerantTrainer(trainer_over(communicator), membership, data)
    state = ft.init(gpt_params(GPT(job["size"], seed=job["seed"])), {"tokens": windows[data.indices(0, 1)]})
    evaluate = jax.jit(loss_fn)
    record(event="start", rank=ft.epoch.rank)
    first_ended = None
    while int(state.step) < job["steps"]:
        started, cpu = time.perf_counter(), time.process_time()
        record(event="attempt", step=int(state.step) + 1)
        state, loss = ft.step(state, batch_of)
        step, world = int(state.step), attempt["world"]
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
        first_ended = first_ended or time.time()
        record(event="step", step=step, world=world, members=attempt["members"], seconds=seconds, cpu=cpu,
               loss=float(loss), ended=time.time())  # fmt: skip
        if ft.epoch.rank == 0 and step % job["eval_every"] == 0:
            loss = float(evaluate(state.params, heldout))
            record(event="heldout", step=step, tokens=step * world * job["batch"] * (length - 1), loss=loss)
    ft.finished()
    joined = ft.admission and first_ended - ft.admission["asked"]  # a joiner's seconds from asking to training
    record(event="end", recoveries=[_as_torch_recovery(r) for r in ft.recoveries], joined=joined)
    ft.membership.close()


def _as_torch_recovery(recovery: dict) -> dict:
    """A JAX recovery record in a torch one's terms: the seconds from the failure seen to the retried step's start,
    and the steps lost: the step in flight at a death (the protocol abandons it; tests/test_fault_tolerance_jax.py
    checks that one is), none at an admission (between two steps)."""
    seconds = recovery.get("resume_seconds", recovery["rebuild_seconds"])
    lost = 0 if recovery["joined"] else 1
    return {"epoch": recovery["epoch"], "size": recovery["size"], "seconds": seconds, "steps_lost": lost,
            "joined": recovery["joined"]}  # fmt: skip


def job_file(folder: Path, args: argparse.Namespace, fault_tolerant: bool, kill_step: int = 0) -> Path:
    """The job's settings, written into ``folder`` with a new job secret beside them (every member needs it)."""
    from bagua_common.fault_tolerance.settings import write_job_secret

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
                "steps": args.steps,
                "eval_every": args.eval_every,
                "fault_tolerant": fault_tolerant,
                "kill_step": kill_step,
                "front_end": args.front_end,
                "engine": args.engine,
                "ranks": args.ranks,
                "secret_file": write_job_secret(str(folder)),
            }
        )
    )
    return path


def environment(job: Path, ranks: int, **extra: str) -> dict[str, str]:
    """The ranks' environment: this process's without the rank variables, the repository on the path, the job's
    secret, the replica check's interval, and the cores shared among all ``ranks`` (each runs on this machine, in a
    network namespace or not, so a launcher's own share per node would oversubscribe them), then ``extra``."""
    from bagua_common.fault_tolerance.settings import ENV_SECRET_FILE
    from bagua_common.job.rank_environment import threads_per_rank

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env |= {"PYTHONPATH": str(ROOT), ENV_SECRET_FILE: json.loads(job.read_text())["secret_file"]}
    env |= {"OMP_NUM_THREADS": str(threads_per_rank(ranks)), "BAGUA_FT_HASH_EVERY": str(HASH_EVERY)}
    return {**env, **extra}


def settings_of(published: dict) -> argparse.Namespace:
    """The settings a published study ran with, parsed from the command its results record."""
    return build_parser().parse_args(shlex.split(published["command"])[2:])


def with_changes(args: argparse.Namespace, **changes: object) -> argparse.Namespace:
    """A copy of ``args`` with ``changes``."""
    return argparse.Namespace(**{**vars(args), **changes})


def launch_options(job: Path, fault_tolerant: bool) -> list[str]:
    """``bagua-launch``'s options for the job: ``--fault-tolerant`` (a slot replaces its rank when it dies), and for JAX
    ranks on the MPI engine ``--mpi`` (each rank its own ``mpiexec -n 1`` job)."""
    options = ["--fault-tolerant"] if fault_tolerant else []
    settings = json.loads(job.read_text())
    return options + (["--mpi"] if settings["front_end"] == "jax" and settings["engine"] == "mpi" else [])


def launch(ranks: int, job: Path, fault_tolerant: bool, **extra: str) -> subprocess.Popen:
    """The job's ranks under ``bagua-launch`` (:func:`launch_options`)."""
    command = [sys.executable, "-m", "bagua_launch", "--nproc-per-node", str(ranks)]
    command += launch_options(job, fault_tolerant)
    command += [str(Path(__file__).resolve()), "rank", str(job)]
    return subprocess.Popen(command, env=environment(job, ranks, **extra), start_new_session=True)


def run_ranks(ranks: int, job: Path, rate: str | None) -> None:
    """Run the job's ranks to the end: local processes, or one per network namespace on links of ``rate``."""
    if rate is None:
        launch(ranks, job, False).wait()
        return
    from harness.links import Network

    from bagua_common.job.local_launch import free_port

    command = [sys.executable, str(Path(__file__).resolve()), "rank", str(job)]
    with Network(ranks, rate) as net:
        net.run_all(command, free_port(), 3600, environment(job, ranks))


def lines(folder: Path) -> dict[str, list[dict]]:
    return {p.name: [json.loads(line) for line in p.read_text().splitlines()] for p in folder.glob("rank-*.jsonl")}


def overhead(args: argparse.Namespace) -> dict:
    runs = []
    for repeat in range(args.repeats):
        for fault_tolerant in (False, True) if repeat % 2 == 0 else (True, False):
            with tempfile.TemporaryDirectory() as scratch:
                folder = Path(scratch)
                no_evaluation = with_changes(args, eval_every=args.steps + 1)  # as off does
                run_ranks(args.ranks, job_file(folder, no_evaluation, fault_tolerant), args.rate)
                steps = [e for log in lines(folder).values() for e in log[len(log) // 5 :] if e["event"] == "step"]
                runs.append(
                    {
                        "fault_tolerant": fault_tolerant,
                        "repeat": repeat,
                        "step_s": statistics.median(e["seconds"] for e in steps),  # the first fifth warms up
                        "cpu_s": statistics.median(e["cpu"] for e in steps),
                        "end_spread_s": end_spread(steps),
                    }
                )
                print(json.dumps(runs[-1]), flush=True)
    on = statistics.median(r["step_s"] for r in runs if r["fault_tolerant"])
    off = statistics.median(r["step_s"] for r in runs if not r["fault_tolerant"])
    paired = [
        next(r["step_s"] for r in runs if r["repeat"] == repeat and r["fault_tolerant"])
        / next(r["step_s"] for r in runs if r["repeat"] == repeat and not r["fault_tolerant"])
        for repeat in range(args.repeats)
    ]
    return {"runs": runs, "step_s_off": off, "step_s_on": on, "overhead": on / off - 1, "paired_ratios": paired}


def end_spread(steps: list[dict]) -> float:
    """The median over steps of the time between the first and the last rank ending it (fault tolerance's vote
    makes every rank wait for the last one's collectives to complete; without it, a rank goes on)."""
    ends: dict[int, list[float]] = {}
    for e in steps:
        ends.setdefault(e["step"], []).append(e["ended"])
    return statistics.median(max(t) - min(t) for t in ends.values() if len(t) > 1)


def resumed_at(log: list[dict], killed_at: float) -> float:
    """When a survivor's training resumed after the kill: its first attempt at a step it had attempted before (the
    step in flight, run again), or, having lost none (it took the step by itself), its first attempt at a step past
    those. A survivor voting one ahead may be a step past the victim's and start another step before it sees the
    death: the retry counts, not that start."""
    attempts = [(e["time"], e["step"]) for e in log if e["event"] == "attempt"]
    before = [step for started, step in attempts if started <= killed_at]
    after = [(started, step) for started, step in attempts if started > killed_at]
    seen = set(before)
    for started, step in after:
        if step in seen:
            return started
        seen.add(step)
    return next(started for started, step in after if step > max(before))


def kill(args: argparse.Namespace) -> dict:
    """``--repeats`` runs of :func:`kill_once`."""
    return {"runs": [kill_once(args) for _ in range(args.repeats)]}


def kill_once(args: argparse.Namespace) -> dict:
    """The last of ``--ranks`` plain processes SIGKILLs itself in step ``--kill-step``'s backward pass; per
    survivor, the seconds from the kill to the retried step starting (and the job's own measure: from the failure
    seen there to the step running again) and the steps lost."""
    from bagua_common.job.local_launch import free_port

    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        job = job_file(folder, args, True, kill_step=args.kill_step)
        where = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(args.ranks)}
        env = environment(job, args.ranks, **where)
        command = [sys.executable, str(Path(__file__).resolve()), "rank", str(job)]
        ranks = [subprocess.Popen(command, env={**env, "RANK": str(r)}) for r in range(args.ranks)]
        codes = [rank.wait(timeout=600) for rank in ranks]
        killed_at = float((folder / "kill-time").read_text())
        logs = lines(folder)
    survivors = []
    for log in logs.values():
        end = [e for e in log if e["event"] == "end"]
        if not end:
            continue  # the victim
        survivors.append(
            {
                "rank": next(e["rank"] for e in log if e["event"] == "start"),
                "resumed_after_kill_s": resumed_at(log, killed_at) - killed_at,
                "steps_lost": sum(r["steps_lost"] for r in end[0]["recoveries"]),
                "recoveries": end[0]["recoveries"],
            }
        )
    return {"exit_codes": codes, "kill_time": killed_at, "survivors": sorted(survivors, key=lambda s: s["rank"])}


def chaos(args: argparse.Namespace) -> dict:
    return {"fault_free": _launched_run(args, kill=False), "chaos": _launched_run(args, kill=True)}


def spread(args: argparse.Namespace) -> dict:
    """Fault-free runs at each of ``--seeds`` (the model's initialization and the data's order), beside the chaos
    study's runs read from ``--out``: the run-to-run spread the chaos run's curve is judged against."""
    chaos_file = args.out / f"{results_name(with_changes(args, study='chaos'))}.json"
    published = json.loads(chaos_file.read_text())
    theirs = settings_of(published)
    differ = [key for key in SAME_RUN if getattr(theirs, key) != getattr(args, key)]
    if differ or theirs.seed in args.seeds:
        raise SystemExit(f"spread: {chaos_file} ran seed {theirs.seed}: give the same {differ} and other seeds")
    earlier = _earlier_spread_runs(args)
    runs = {seed: earlier.get(seed) or _launched_run(with_changes(args, seed=seed), kill=False) for seed in args.seeds}
    fault_free = {theirs.seed: published["result"]["fault_free"], **runs}
    read = sorted(seed for seed in args.seeds if seed in earlier)
    chaos = published["result"]["chaos"]
    return {"chaos_command": published["command"], "fault_free": fault_free, "chaos": chaos, "read_again": read}


def _earlier_spread_runs(args: argparse.Namespace) -> dict[int, dict]:
    """The fault-free runs an earlier spread study with these settings left in ``--out``, by seed: a seed added
    later runs alone, and the report shows every seed (each run takes as long as the chaos study's fault-free one)."""
    earlier_file = args.out / f"{results_name(args)}.json"
    if not earlier_file.exists():
        return {}
    earlier = json.loads(earlier_file.read_text())
    ran = settings_of(earlier)
    if any(getattr(ran, key) != getattr(args, key) for key in SAME_RUN):
        return {}
    return {int(seed): run for seed, run in earlier["result"]["fault_free"].items()}


def _launched_run(args: argparse.Namespace, kill: bool) -> dict:
    """One run under ``bagua-launch --fault-tolerant``; with ``kill``, a random rank SIGKILLed every ``--every``
    seconds."""
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        with fault_tolerant_job(args.ranks, job_file(folder, args, True), args.rate) as launchers:
            kills, started = [], time.monotonic()
            while any(launcher.poll() is None for launcher in launchers):
                time.sleep(args.every if kill else 1)
                if not kill or all(launcher.poll() is not None for launcher in launchers):
                    continue
                ranks = [pid for launcher in launchers for pid in _worker_pids(launcher.pid)]
                if ranks:
                    victim = random.choice(ranks)
                    os.kill(victim, signal.SIGKILL)
                    kills.append({"pid": victim, "seconds": time.monotonic() - started, "time": time.time()})
        logs = lines(folder)
        last = max((e["step"] for log in logs.values() for e in log if e["event"] == "step"), default=0)
        if last < args.steps:  # the job ended early: its ranks' logs say why
            kept = args.out / f"chaos-logs-{'chaos' if kill else 'fault-free'}-{time.strftime('%Y%m%dT%H%M%S')}"
            shutil.copytree(folder, kept)
            print(f"[chaos] the job ended at step {last} of {args.steps}; its ranks' logs: {kept}", file=sys.stderr)
        run = {
            "last_step": last,
            "wall_s": time.monotonic() - started,
            "kills": kills,
            "heldout": _heldout_by_tokens(logs, args.batch, gpt_config(args.size).context),
            "recoveries": [e["recoveries"] for log in logs.values() for e in log if e["event"] == "end"],
            "joined": [e["joined"] for log in logs.values() for e in log if e["event"] == "end" and e["joined"]],
        }
        name, _, options = args.algorithm.partition(" ")
        if name == "diloco":
            run["exchange_steps"] = _exchange_steps(logs, json.loads(options or "{}").get("sync_every", 100))
        else:
            run["admission_steps"] = _admission_steps(logs)
        return run


def _admission_steps(logs: dict[str, list[dict]]) -> dict[str, list[float]]:
    """Each member's seconds from the end of a step to the end of the second one after it: across an admission
    (the first of the two had more members than the step before) and the others (the same members throughout). The
    first holds the members' wait for the joiner's state, however the state travels."""
    out: dict[str, list[float]] = {"admission": [], "other": []}
    for log in logs.values():
        steps = {e["step"]: e for e in log if e["event"] == "step"}
        for n in (n for n in steps if n - 1 in steps and n + 1 in steps):
            members = [steps[m]["members"] for m in (n - 1, n, n + 1)]
            kind = "admission" if members[1] > members[0] else "other" if len(set(members)) == 1 else None
            if kind:
                out[kind].append(steps[n + 1]["ended"] - steps[n - 1]["ended"])
    return out


def _exchange_steps(logs: dict[str, list[dict]], sync_every: int) -> dict[str, list[float]]:
    """DiLoCo's exchange steps (every ``sync_every``-th), each member's seconds: those ending a round a joiner sat out
    (some step trained by fewer than the members) and the others. A joiner's state arriving after the round's
    end would show in the first: the members wait for it in the exchange."""
    out: dict[str, list[float]] = {"sat_out": [], "other": []}
    for log in logs.values():
        steps = {e["step"]: e for e in log if e["event"] == "step"}
        for number in (n for n in steps if n % sync_every == 0):
            sat_out = any(steps[n]["world"] < steps[n]["members"] for n in range(number - sync_every + 1, number + 1)
                          if n in steps)  # fmt: skip
            out["sat_out" if sat_out else "other"].append(steps[number]["seconds"])
    return out


@contextlib.contextmanager
def fault_tolerant_job(ranks: int, job: Path, rate: str | None) -> Iterator[list[subprocess.Popen]]:
    """The job under ``bagua-launch --fault-tolerant``, as its launchers: one launching every rank on this machine,
    or, with ``rate``, one node per network namespace (``harness.links``) with one rank each, meeting at a
    rendezvous in the first namespace as the nodes of a real job do; the namespaces go when the block ends."""
    if rate is None:
        yield [launch(ranks, job, True)]
        return
    from harness.links import RANK_IF, Network, mpi_environment

    from bagua_common.job.local_launch import free_port

    env = environment(job, ranks, GLOO_SOCKET_IFNAME=RANK_IF)
    env |= mpi_environment() if "--mpi" in launch_options(job, True) else {}  # MPI's traffic on the shaped link too
    with Network(ranks, rate) as net:
        endpoint = f"{net.master_addr}:{free_port()}"
        command = [sys.executable, "-m", "bagua_launch", "--nnodes", str(ranks), "--nproc-per-node", "1"]
        command += ["--rdzv-endpoint", endpoint, *launch_options(job, True)]
        command += [str(Path(__file__).resolve()), "rank", str(job)]
        yield [net.popen(node, command, env) for node in range(ranks)]


def _heldout_by_tokens(logs: dict[str, list[dict]], batch: int, context: int) -> list[dict]:
    """The held-out evaluations in step order, each with the tokens trained up to its step: the sum over the
    committed steps of the world that trained each (the world shrinks at a death and grows at an admission)."""
    world = {e["step"]: e["world"] for log in logs.values() for e in log if e["event"] == "step"}
    evaluations = sorted((e for log in logs.values() for e in log if e["event"] == "heldout"), key=lambda e: e["step"])
    out = []
    for e in evaluations:
        tokens = sum(world.get(step, 0) for step in range(1, e["step"] + 1)) * batch * context
        out.append(
            {"step": e["step"], "time": e["time"], "tokens": tokens, "loss": e["loss"], "world": world.get(e["step"])}
        )
    return out


def chaos_lines(result: dict, out: Path, every: float) -> list[str]:
    """The chaos run's report: every kill with the survivors' recovery (seconds until training again, steps lost),
    every joiner's seconds from asking to training, and the held-out loss against tokens of both runs (a table at
    the chaos run's evaluations, and a chart beside the results)."""
    lines = []
    last, planned = result["chaos"].get("last_step"), result["fault_free"].get("last_step")
    if last is not None and last < planned:
        lines.append(f"**The chaos run's job ended at step {last} of {planned}.**\n")
    recoveries = [r for member in result["chaos"]["recoveries"] for r in member]
    lines.append(
        f"{len(result['chaos']['kills'])} ranks killed (SIGKILL) at random, each slot restarted by `bagua-launch "
        f"--fault-tolerant` into the running job. The members that finished saw {len(recoveries)} membership "
        f"changes (counted per member) and lost {sum(r['steps_lost'] for r in recoveries)} steps in all."
    )
    for kind, chosen in (("a death", [r for r in recoveries if not r["joined"]]),
                         ("an admission", [r for r in recoveries if r["joined"]])):  # fmt: skip
        seconds = sorted(r["seconds"] for r in chosen)
        if seconds:
            lines.append(
                f"At {kind}: {len(seconds)} changes, seconds from the change seen to training again: median "
                f"{statistics.median(seconds):.2f}, max {seconds[-1]:.2f}; steps lost "
                f"{sum(r['steps_lost'] for r in chosen)}."
            )
    joined = sorted(result["chaos"]["joined"])
    if joined:
        lines.append(
            f"Joiners that finished: {len(joined)}; seconds from asking to be admitted to training: median "
            f"{statistics.median(joined):.2f}, max {joined[-1]:.2f}."
        )
    for key, kind, what, others in (
        ("exchange_steps", "sat_out", "Exchange steps (the members' seconds) ending a round a joiner sat out", "the "
         "other exchange steps"),
        ("admission_steps", "admission", "Two steps in a row (the members' seconds, end to end) across an admission",
         "with the same members"),
    ):  # fmt: skip
        times = result["chaos"].get(key)
        if times and times[kind] and times["other"]:
            chosen, other = sorted(times[kind]), sorted(times["other"])
            lines.append(
                f"{what}: median {statistics.median(chosen):.2f}, max {chosen[-1]:.2f} ({len(chosen)}); {others}: "
                f"median {statistics.median(other):.2f}, max {other[-1]:.2f} ({len(other)})."
            )
    lines.append("")
    reference = result["fault_free"]["heldout"]
    rows = []
    for e in result["chaos"]["heldout"]:
        same = _loss_at(reference, e["tokens"])
        diff = "" if same is None else f"{e['loss'] - same:+.4f}"
        rows.append([e["step"], f"{e['tokens'] / 1e6:.3f}", e["world"], f"{e['loss']:.4f}", _fmt(same), diff])
    head = ["step", "tokens (M)", "world", "held-out (chaos)", "held-out (fault-free, same tokens)", "difference"]
    lines += table(head, rows)
    kills = [_tokens_at(result["chaos"]["heldout"], kill) for kill in result["chaos"]["kills"]]
    curves = {
        "fault-free": result["fault_free"]["heldout"],
        f"a rank killed every {every:g} s": result["chaos"]["heldout"],
    }
    return lines + _curves_chart(curves, kills, out)


def spread_lines(result: dict, out: Path) -> list[str]:
    """The spread study's report: at each of the chaos run's evaluations, the fault-free runs' held-out loss at
    the same tokens, seed by seed, their range, and the chaos run's difference from the run it was compared with
    against the other seeds' differences from that run (the chart beside the results draws every curve)."""
    seeds = list(result["fault_free"])
    rows, chaos_gaps, seed_gaps, compared = [], [], [], []
    for e in result["chaos"]["heldout"]:
        same = [_loss_at(result["fault_free"][seed]["heldout"], e["tokens"]) for seed in seeds]
        if None in same:
            continue
        low, high = min(same), max(same)
        compared.append((e["loss"], same))
        chaos_gaps.append(abs(e["loss"] - same[0]))
        seed_gaps.append(max(abs(loss - same[0]) for loss in same[1:]))
        rows.append([e["step"], f"{e['tokens'] / 1e6:.3f}", f"{e['loss']:.4f}", *(f"{loss:.4f}" for loss in same),
                     f"{high - low:.4f}", "yes" if low <= e["loss"] <= high else "no"])  # fmt: skip
    at_steps = []  # each step the same samples per member: fewer tokens while the world is smaller
    for e in result["chaos"]["heldout"]:
        same = [next((f["loss"] for f in result["fault_free"][seed]["heldout"] if f["step"] == e["step"]), None)
                for seed in seeds]  # fmt: skip
        at_steps += [] if None in same else [(e["loss"], same)]
    lines = [
        f"At {len(rows)} evaluations at equal tokens: the chaos run {_against_the_range(compared)} Its largest "
        f"distance from the fault-free run of seed {seeds[0]} is {max(chaos_gaps):.4f} (median "
        f"{statistics.median(chaos_gaps):.4f}); the other seeds' largest distance from that run is "
        f"{max(seed_gaps):.4f} (median {statistics.median(seed_gaps):.4f}).",
        "",
        f"At {len(at_steps)} evaluations at equal steps instead (each step trains the same samples per member, so "
        f"fewer tokens while the world is smaller): the chaos run {_against_the_range(at_steps)}",
        "",
    ]
    head = [
        "step",
        "tokens (M)",
        "held-out (chaos)",
        *(f"fault-free, seed {seed}" for seed in seeds),
        "range",
        "inside",
    ]
    lines += table(head, rows)
    ends = {f"fault-free seed {seed}": run["heldout"][-1] for seed, run in result["fault_free"].items()}
    ends["chaos"] = result["chaos"]["heldout"][-1]
    lines += ["", "Each run's last evaluation (the chaos run trained fewer tokens in its steps: a smaller world after "
              "each death): " + "; ".join(f"{name} {e['loss']:.4f} at {e['tokens'] / 1e6:.3f}M tokens"
                                          for name, e in ends.items()) + "."]  # fmt: skip
    curves = {f"fault-free, seed {seed}": run["heldout"] for seed, run in result["fault_free"].items()}
    return lines + _curves_chart({**curves, "chaos (seed 0)": result["chaos"]["heldout"]}, [], out)


def _against_the_range(compared: list[tuple[float, list[float]]]) -> str:
    """Where each of the chaos run's losses lies against the fault-free runs' range at the same point: how often
    inside, above (a higher loss) and below it, and by how much at most."""
    above = [loss - max(same) for loss, same in compared if loss > max(same)]
    below = [min(same) - loss for loss, same in compared if loss < min(same)]
    return (
        f"lies within the fault-free runs' range at {len(compared) - len(above) - len(below)}, above it (a higher "
        f"loss) at {len(above)}, by at most {max(above, default=0):.4f}, and below it at {len(below)}, by at most "
        f"{max(below, default=0):.4f}."
    )


def _fmt(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def _loss_at(curve: list[dict], tokens: float) -> float | None:
    """The curve's held-out loss at ``tokens``, linear between its evaluations (None outside them)."""
    try:
        return loss_at([(e["tokens"], e["loss"]) for e in curve], tokens)
    except (ValueError, IndexError):  # outside the curve, or no curve
        return None


def _curves_chart(curves: dict[str, list[dict]], kills: list[float], out: Path) -> list[str]:
    """Held-out loss against tokens for each curve, with a faint line at each kill's tokens, saved at ``out``; the
    report's lines that show it (none where matplotlib is missing and nothing was drawn)."""
    from harness import plots

    drawn = plots.figure()
    if drawn is None:
        return []
    fig, axes = drawn
    ax = axes[0][0]
    plots.curves(ax, {label: ([e["tokens"] / 1e6 for e in c], [e["loss"] for e in c]) for label, c in curves.items()})
    for tokens in kills:
        ax.axvline(tokens, color="C3", alpha=0.2, linewidth=1)
    ax.set_xlabel("tokens trained (M)")
    ax.set_ylabel("held-out loss (nats/byte)")
    ax.legend()
    plots.save(fig, out)
    return ["", f"![held-out loss against tokens]({out.name})"]


def _tokens_at(curve: list[dict], kill: dict) -> float:
    """Where a kill falls on the tokens axis: at the evaluation closest before it in time."""
    before = [e for e in curve if e["time"] <= kill["time"]] or curve[:1]
    return before[-1]["tokens"] / 1e6 if before else 0.0


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
        # a rank runs ``python .../fault_tolerance.py rank JOB``; its slot (bagua_launch.replacements) is not one
        if len(argv) > 2 and argv[1].endswith(b"fault_tolerance.py") and argv[2] == b"rank":
            ranks.append(pid)

    def descends(pid: int) -> bool:
        while pid > 1:
            if pid == launcher:
                return True
            pid = parents.get(pid, 1)
        return False

    return [pid for pid in ranks if descends(pid)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("study", choices=(*STUDIES, "rank", "report"))
    parser.add_argument("job", nargs="?", help="(rank) the job's settings; (report) the study to write again")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--size", default="small", help="the GPT (bagua_common.workload.gpt_spec)")
    parser.add_argument("--algorithm", default="gradient_allreduce", help="a name, then its options as JSON")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--kill-step", type=int, default=5, help="(kill) the step the last rank dies in")
    parser.add_argument("--repeats", type=int, default=3, help="(kill, overhead) how many runs")
    parser.add_argument("--every", type=float, default=60)
    parser.add_argument("--rate", default=None, help="(overhead, chaos, spread) link rate, e.g. 100mbit (root)")
    parser.add_argument("--front-end", choices=("torch", "jax"), default="torch",
                        help="(chaos, spread) jax: JAX ranks on a native host engine (--engine)")  # fmt: skip
    parser.add_argument("--engine", choices=("tcp", "mpi"), default="tcp",
                        help="(jax) the native host engine; mpi: each rank its own mpiexec -n 1 job")  # fmt: skip
    parser.add_argument("--seeds", type=lambda text: [int(seed) for seed in text.split(",")], default=[1, 2],
                        help="(spread) the fault-free runs' seeds, comma-separated")  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory (default benchmarks/results)")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.study == "rank":
        rank_main(args.job)
        return
    if args.study == "report":
        report(args)
        return
    if args.front_end == "jax" and args.study not in ("chaos", "spread"):
        raise SystemExit(f"{args.study}: torch only (benchmarks/fault_tolerance_jax.py measures JAX's)")
    meta = run_meta([args.front_end], argv=argv, ranks=args.ranks, size=args.size, algorithm=args.algorithm)
    result = {"kill": kill, "overhead": overhead, "chaos": chaos, "spread": spread}[args.study](args)
    finish_meta(meta)
    publish(args, meta, result)


def report(args: argparse.Namespace) -> None:
    """Write a study's Markdown (and chart) again from its JSON under ``--out``, with the settings it ran with."""
    if args.job is None or args.job.split("-")[0] not in STUDIES:
        raise SystemExit(f"report: which study? one of {', '.join(STUDIES)}, then -ALGORITHM for another algorithm's")
    saved = json.loads((args.out / f"fault-tolerance-{args.front_end}-{args.job}.json").read_text())
    ran = with_changes(settings_of(saved), out=args.out)
    publish(ran, {k: v for k, v in saved.items() if k != "result"}, saved["result"])


def results_name(args: argparse.Namespace) -> str:
    """The results' file name (no suffix): ``fault-tolerance-<front end>-<study>``, then ``-<algorithm>`` unless the
    algorithm is gradient allreduce."""
    algorithm = args.algorithm.partition(" ")[0]
    name = f"fault-tolerance-{args.front_end}-{args.study}"
    return name + ("" if algorithm == "gradient_allreduce" else f"-{algorithm}")


def publish(args: argparse.Namespace, meta: dict, result: dict) -> None:
    """Print and write the results of the study ``args`` ran under :func:`results_name`: ``.md``, ``.json`` and
    for the chaos and spread studies ``.png``."""
    name = results_name(args)
    engine = f"JAX on the native {args.engine.upper()} engine" if args.front_end == "jax" else "torch over gloo"
    lines = [f"# Fault tolerance, {engine}: {args.study}", "", *header_lines(meta), ""]
    if args.study == "kill":
        lines.append(
            f"{args.ranks} ranks, GPT {args.size}, {args.algorithm}; the last rank SIGKILLed in step "
            f"{args.kill_step}'s backward pass; default heartbeat (0.5 s) and dead_after (5 s): the kill is seen by "
            "its store connection closing"
        )
        lines.append("")
        rows = []
        for run, job in enumerate(result["runs"]):
            for s in job["survivors"]:
                seen = s["recoveries"][0]["seconds"]
                rows.append([run, s["rank"], f"{s['resumed_after_kill_s']:.2f}", f"{seen:.2f}", s["steps_lost"]])
        head = ["run", "rank", "resumed after the kill (s)", "from the failure seen here (s)", "steps lost"]
        lines += table(head, rows)
    elif args.study == "overhead":
        lines.append(
            f"{args.ranks} ranks, GPT {args.size}, {args.algorithm}, {args.batch} windows per rank, "
            f"{args.steps} steps a run (the first fifth not counted), link {args.rate or 'unshaped'}; "
            f"the replica check every {HASH_EVERY} steps; runs alternated off/on"
        )
        lines.append("")
        rows = [
            [r["repeat"], "on" if r["fault_tolerant"] else "off"]
            + [f"{r[key] * 1e3:.1f}" for key in ("step_s", "cpu_s", "end_spread_s")]
            for r in result["runs"]
        ]
        head = [
            "repeat",
            "fault tolerance",
            "median step (ms)",
            "CPU per step and rank (ms)",
            "ranks' step ends apart (ms)",
        ]
        lines += table(head, rows)
        paired = result["paired_ratios"]
        lines += [
            "",
            f"Median over runs: off {result['step_s_off'] * 1e3:.1f} ms, on {result['step_s_on'] * 1e3:.1f} ms: "
            f"overhead {result['overhead'] * 100:+.2f}%. Each repeat's on/off ratio: median "
            f"{statistics.median(paired):.4f} [{min(paired):.4f}, {max(paired):.4f}].",
        ]
    elif args.study == "spread":
        lines.append(
            f"{args.ranks} ranks, GPT {args.size}, {args.algorithm}, {args.batch} windows per rank, lr {args.lr}, "
            f"{args.steps} steps, links {args.rate or 'unshaped'}: fault-free runs at seeds {args.seeds} beside the "
            f"chaos study's runs (`{result['chaos_command']}`)"
            + (
                f"; seeds {result['read_again']} read from the spread study's earlier results in `--out`"
                if result.get("read_again")
                else ""
            )
        )
        lines += ["", *spread_lines(result, args.out / f"{name}.png")]
    else:
        lines.append(
            f"{args.ranks} ranks, GPT {args.size}, {args.algorithm}, {args.batch} windows per rank, lr {args.lr}; "
            f"{args.steps} steps fault-free, then {args.steps} steps with a rank killed every "
            f"{args.every:g} s; links {args.rate or 'unshaped'}; the replica check every {HASH_EVERY} steps"
        )
        lines += ["", *chaos_lines(result, args.out / f"{name}.png", args.every)]
    print("\n".join(lines))
    write_results(args.out, name, lines, {**meta, "result": result})


if __name__ == "__main__":
    main()

"""The JAX front end's fault tolerance, measured: the fault-free overhead, and the resume after a SIGKILL.

Ranks run a native host engine (``--engine``: TCP, or MPI), each its own ``mpiexec -n 1`` job joined through the
fault-tolerant membership (``bagua_jax.fault_tolerance``), training a ``--width`` MLP (or a GPT on the corpus,
``--model tiny|mini|small``: 8 windows per rank, AdamW) with gradient allreduce, ByteGrad or PowerSGD (``--algorithm
bytegrad|powersgd``, their defaults), DiLoCo (``--algorithm diloco``, ``--sync-every`` H; Streaming DiLoCo with
``--fragments`` P and ``--fragment-sync-delay`` tau, its exchanges overlapping tau steps on a thread), decentralized
SGD pairing the ranks (``decentralized``: shift_one), low-precision decentralized SGD
(``low_precision_decentralized``) or asynchronous averaging (``async``: rounds every 500 ms, no warm-up, driven by
the fault-tolerant trainer; ``kill`` and ``join`` only: ``overhead``'s plain steps would run no rounds).

* ``overhead``: every rank alternates blocks of ``--steps`` plain ``DataParallel.step`` calls and ``--steps``
  fault-tolerant ones (a commit by agreement per transaction, the replica digests every ``--hash-every``) on the same
  communicator, the order swapped each round; the table gives the ratio per round and over rounds of the steps'
  median (gradient allreduce), or of the block's mean (DiLoCo: its exchanges are a few steps of the block). The
  rounds begin once the steps the fault-tolerant trainer compiles ahead in the background are compiled (a one-time
  cost at the start and after each change, which the report gives apart).
* ``kill``: once the steps compiled ahead are compiled (as for ``overhead``: the steady state), rank ``ranks-1`` is
  SIGKILLed as step ``--kill-step`` starts, while the others are blocked in its allreduce (gradient allreduce), or
  mid-round (DiLoCo, H = 8: the others train on to the round's exchange); the table gives the seconds from the kill
  to the survivors' retried step's start and end (a step compiled again for the new world size compiles in between),
  and the steps run again. A kill while those compile costs more where ranks share too few cores:
  ``benchmarks/results/fault-tolerance-jax-kill-mpi-steady-state.md``.
* ``join``: ``ranks-1`` members train ``--rounds`` DiLoCo rounds (gradient allreduce: steps); rank ``ranks-1`` starts
  as a new process after ``--join-after`` of them, compiles its step and joins the running job (under DiLoCo it
  sits out the round in flight). The table gives each
  member's pause at the admission (from the attempt the admission interrupted to its retry), the round the joiner
  was admitted into against the round before it, and the first exchange step with the joiner against the later
  ones; then the joiner's seconds from asking to be admitted to the end of its first exchange.

With ``--rate R`` (root) each rank runs in its own network namespace on a link of rate R in each direction
(``benchmarks/harness/links.py``), its MPI traffic and its store's on that link.

Run it with nothing else running (the results' header records the load before and after)::

    python benchmarks/fault_tolerance_jax.py overhead --ranks 2 --width 1024 --steps 20 --rounds 5
    python benchmarks/fault_tolerance_jax.py kill --ranks 3
    python benchmarks/fault_tolerance_jax.py kill --ranks 3 --algorithm diloco --sync-every 8
    python benchmarks/fault_tolerance_jax.py kill --ranks 3 --model mini --algorithm diloco --sync-every 8 \
        --fragments 2 --fragment-sync-delay 3 --kill-step 5
    python benchmarks/fault_tolerance_jax.py kill --ranks 3 --model mini --algorithm powersgd
    python benchmarks/fault_tolerance_jax.py kill --ranks 4 --model mini --algorithm decentralized
    python benchmarks/fault_tolerance_jax.py kill --ranks 4 --model mini --algorithm async
    python benchmarks/fault_tolerance_jax.py join --ranks 3 --algorithm diloco --sync-every 64 --rounds 6
    python benchmarks/fault_tolerance_jax.py join --ranks 3 --rounds 40
    python benchmarks/fault_tolerance_jax.py join --ranks 3 --rounds 40 --model mini
    python benchmarks/fault_tolerance_jax.py overhead --ranks 4 --model mini --steps 10 --rounds 10 --rate 100mbit
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

from harness.results import RESULTS, finish_meta, header_lines, run_meta, table, write_results  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    """One rank: train and write ``rank<r>.json`` to ``args.workdir``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from bagua_common.fault_tolerance import DataPosition, FaultToleranceSettings, Membership
    from bagua_common.fault_tolerance.kv_store import advertised_host
    from bagua_jax import DataParallel, NativeCommunicator
    from bagua_jax.algorithms import Decentralized, DiLoCo
    from bagua_jax.fault_tolerance import FaultTolerantTrainer

    if args.model == "mlp":
        rng = np.random.default_rng(0)
        per_rank, samples = 64, 64 * args.ranks * (args.steps * 2 * args.rounds + 8)
        x = rng.standard_normal((samples, args.width)).astype(np.float32)
        y = rng.standard_normal((samples, 1)).astype(np.float32)
        params = {
            "w1": jnp.asarray(rng.standard_normal((args.width, args.width)).astype(np.float32) / args.width**0.5),
            "w2": jnp.asarray(rng.standard_normal((args.width, 1)).astype(np.float32) / args.width**0.5),
        }
        optimizer = optax.sgd(1e-3)

        def loss_fn(p, batch):
            features, targets = batch
            return jnp.mean((jnp.tanh(features @ p["w1"]) @ p["w2"] - targets) ** 2)

        def batch_of(indices):
            return x[indices], y[indices]

    else:  # a GPT on the corpus, 8 windows per rank, AdamW
        from bagua_common.workload.corpus import load_corpus
        from bagua_common.workload.gpt_spec import gpt_config
        from bagua_jax.models.gpt import GPT, gpt_loss_fn, gpt_params

        per_rank, samples = 8, 8 * args.ranks * (args.rounds * 10 + 400)
        tokens = load_corpus().batch(0, 0, 0, samples, gpt_config(args.model).context + 1)
        params, loss_fn, optimizer = gpt_params(GPT(args.model)), gpt_loss_fn(args.model), optax.adamw(1e-3)

        def batch_of(indices):
            return {"tokens": tokens[indices]}

    rank, master = int(os.environ["RANK"]), os.environ.get("MASTER_ADDR", "127.0.0.1")
    # A join loses nobody: the default heartbeats. 1 s without one took members compiling in the background on the
    # shared cores for dead (a third of the GPT runs under low-precision decentralized training lost one).
    beats = {} if args.mode == "join" else {"heartbeat_period": 0.1, "dead_after": 1.0}
    settings = FaultToleranceSettings(**beats, hash_every=args.hash_every)
    members = args.ranks - 1 if args.mode == "join" else args.ranks
    record: dict = {"rank": rank}
    period = args.sync_every if args.algorithm == "diloco" else 1  # steps per transaction
    if rank < members:
        membership = Membership.start(settings, rank, members, master, args.port, timeout=120)
        store = membership.epoch.store
        comm = (
            NativeCommunicator.tcp_through_store(store, "world/", rank, members, membership.me.host, timeout=120)
            if args.engine == "tcp"
            else NativeCommunicator.mpi_through_store(store, "world/", rank, members, timeout=120)
        )
    else:  # the joiner
        while not Path(args.workdir, "start-joiner").exists():
            time.sleep(0.01)
        record["started"] = time.time()
        comm = (
            NativeCommunicator.tcp_self(advertised_host(master), timeout=120)
            if args.engine == "tcp"
            else NativeCommunicator.mpi_self(timeout=120)
        )

    algorithm = args.algorithm
    if args.algorithm == "diloco":
        algorithm = DiLoCo(
            sync_every=args.sync_every, fragments=args.fragments, fragment_sync_delay=args.fragment_sync_delay
        )
    elif args.algorithm == "decentralized":
        algorithm = Decentralized(peer_selection_mode="shift_one")
    trainer = DataParallel(loss_fn, optimizer, algorithm, communicator=comm)
    data = DataPosition(samples, per_rank, seed=1)
    if rank < members:
        ft = FaultTolerantTrainer(trainer, membership, data)
    else:
        ft = FaultTolerantTrainer.joiner(trainer, data, settings, (master, args.port), timeout=120)
    state = ft.init(params, batch_of(data.indices(0, 1)))
    membership = ft.membership
    record.update(ft.admission or {}, ready=time.time())

    def plain_step(state):
        new, loss = trainer.step(state, batch_of(data.indices(rank, args.ranks)))
        jax.block_until_ready(new)
        return new

    def ft_step(state):
        return ft.step(state, batch_of)[0]

    if args.mode == "join":
        steps, joint = [], None  # joint: the first transaction with the joiner, the same step on every rank
        while joint is None or int(state.step) < max(args.rounds, joint // period + args.rounds - 3) * period:
            started = time.time()
            state = ft_step(state)
            steps.append({"step": int(state.step), "start": started, "end": time.time(), "size": ft.epoch.size})
            if joint is None and ft.epoch.size == args.ranks and int(state.step) % period == 0:
                joint = int(state.step)
            if rank == 0 and int(state.step) == args.join_after * period:
                Path(args.workdir, "start-joiner").write_text("")
        ft.finished()
        record.update(steps=steps, recoveries=ft.recoveries)
        Path(args.workdir, f"rank{rank}.json").write_text(json.dumps(record))
        membership.close()
        os._exit(0)
    for _ in range(2):  # compile, warm up
        state = ft_step(plain_step(state))
    record["compiled_ahead_s"] = compiles_ahead_waited()  # the rounds, or the kill, come in the steady state
    if args.mode == "overhead":
        state = plain_step(state)  # the ranks leave the wait together
        rounds = []
        for r in range(args.rounds):
            times = {}
            for name in ("plain", "ft") if r % 2 == 0 else ("ft", "plain"):
                step = plain_step if name == "plain" else ft_step
                durations = []
                for _ in range(args.steps):
                    started = time.perf_counter()
                    state = step(state)
                    durations.append(time.perf_counter() - started)
                summary = statistics.fmean if args.algorithm == "diloco" else statistics.median
                times[name] = summary(durations)
            rounds.append(times)
        record["rounds"] = rounds
    else:
        victim = args.ranks - 1

        attempts = []

        def doomed(indices, step):
            attempts.append((step, time.time()))  # every attempt, retries included
            if rank == victim and step == args.kill_step:
                time.sleep(0.5)  # the others are blocked in the allreduce (or a round's inner steps) by now
                Path(args.workdir, "kill-time").write_text(repr(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            return batch_of(indices)

        start, ends = int(state.step), {}
        while int(state.step) < start + args.kill_step + 11:
            upcoming = int(state.step) + 1 - start
            state = ft.step(state, lambda indices: doomed(indices, upcoming))[0]
            ends[upcoming] = time.time()
        record.update(
            attempts=attempts,
            ends=ends,
            recoveries=ft.recoveries,
            compiled=trainer._step_fn(False, False)._cache_size(),
        )
    ft.finished()  # every member, once its last step committed: asynchronous averaging's rounds stop together
    Path(args.workdir, f"rank{rank}.json").write_text(json.dumps(record))
    membership.close()
    os._exit(0)


def launch(args: argparse.Namespace, workdir: Path) -> list[int]:
    """Start the ranks, each under its own ``mpiexec -n 1`` (with ``--rate``, each in its own network namespace, on
    links of that rate: ``benchmarks/harness/links.py``); return their exit codes."""
    from bagua_common.job.local_launch import free_port, mpiexec

    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": str(ROOT)}
    argv = [mpiexec(), "-n", "1", sys.executable, sys.argv[0], args.mode, "--worker", "--workdir", str(workdir)]
    options = ("port", "ranks", "engine", "width", "model", "steps", "rounds", "hash_every", "algorithm", "sync_every")
    options += ("kill_step", "join_after", "fragments", "fragment_sync_delay")
    argv += [f"--{k.replace('_', '-')}={getattr(args, k) if k != 'port' else port}" for k in options]
    logs = [open(workdir / f"rank{r}.log", "w") for r in range(args.ranks)]
    if args.rate is None:
        procs = [
            subprocess.Popen(
                argv, env={**env, "RANK": str(r)}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            for r, log in enumerate(logs)
        ]
        return [p.wait(timeout=args.timeout) for p in procs]
    from harness.links import Network, mpi_environment

    with Network(args.ranks, args.rate) as net:
        procs = [
            net.popen(r, argv, {**net.env(r, port, env), **mpi_environment()}, stdout=log, stderr=subprocess.STDOUT)
            for r, log in enumerate(logs)
        ]
        return [p.wait(timeout=args.timeout) for p in procs]


def compiles_ahead_waited() -> float:
    """Wait for the steps the fault-tolerant trainer compiles from threads after its first steps (a joiner's first
    step, the world sizes one change brings: the threads named from ``COMPILING_AHEAD``); the seconds waited. They
    share the cores with the training once, at the start and after each change (the fault-tolerance guide gives
    their cost), so the overhead's rounds begin after them and time the steady state."""
    from bagua_common.fault_tolerance.background import COMPILING_AHEAD

    started = time.perf_counter()
    for thread in threading.enumerate():
        if thread.name.startswith(COMPILING_AHEAD):
            thread.join()
    return time.perf_counter() - started


def compiled_ahead_line(records: list[dict], what: str) -> str:
    """The report's line on the wait of :func:`compiles_ahead_waited` before ``what``."""
    waited = max(r["compiled_ahead_s"] for r in records)
    return (
        f"{what} after the steps compiled ahead in the background: {waited:.1f} s after the warm-up (the longest"
        " wait of a rank)"
    )


def join_table(records: list[dict], sync_every: int) -> list[str]:
    """The ``join`` table: each member's pause at the admission, the round the joiner was admitted into against the
    round before it (a round: from one exchange's end to the next one's), that round and the next against the two
    before (where a joiner sits out the first, the second pays what it deferred), and the first exchange with the
    joiner against the later ones; then the joiner's timeline from asking to be admitted."""
    *members, joiner = records
    first_exchange = next(s for s in joiner["steps"] if s["step"] % sync_every == 0)
    joint = first_exchange["step"]
    next_exchange = next(s for s in joiner["steps"] if s["step"] == joint + sync_every)
    rows = []
    for r in members:
        ends = {s["step"]: s["end"] for s in r["steps"] if s["step"] % sync_every == 0}
        exchange_steps = {s["step"]: s["end"] - s["start"] for s in r["steps"] if s["step"] % sync_every == 0}
        later = [exchange_steps[step] for step in exchange_steps if step > joint]
        rows.append([
            r["rank"], f"{r['recoveries'][0]['resume_seconds']:.3f}", f"{ends[joint] - ends[joint - sync_every]:.2f}",
            f"{ends[joint - sync_every] - ends[joint - 2 * sync_every]:.2f}",
            f"{ends[joint + sync_every] - ends[joint - sync_every]:.2f}",
            f"{ends[joint - sync_every] - ends[joint - 3 * sync_every]:.2f}", f"{exchange_steps[joint] * 1e3:.0f}",
            f"{statistics.median(later) * 1e3:.0f}" if later else "-",
        ])  # fmt: skip
    lines = table(["member", "paused at the admission (s)", "round with the admission (s)", "round before (s)",
                   "it and the next (s)", "two before (s)", "first joint exchange step (ms)",
                   "later exchange steps (ms, median)"], rows)  # fmt: skip
    asked = joiner["asked"]
    lines += [
        "",
        f"joiner: asked to be admitted {asked - joiner['started']:.2f} s after it started (its step compiled);"
        f" admitted {joiner['admitted'] - asked:.2f} s after it asked (at the next exchange), into the round"
        f" ending at step {joint}; had the state {joiner['ready'] - asked:.2f} s, started its first"
        f" step {joiner['steps'][0]['start'] - asked:.2f} s and ended that exchange {first_exchange['end'] - asked:.2f}"
        f" s and the next {next_exchange['end'] - asked:.2f} s after it asked ({len(joiner['steps'])} steps run)",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("overhead", "kill", "join"))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--engine", choices=("tcp", "mpi"), default="tcp", help="the native host engine")
    parser.add_argument("--width", type=int, default=1024, help="the MLP's width")
    parser.add_argument("--model", choices=("mlp", "tiny", "mini", "small"), default="mlp", help="an MLP, or a GPT")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hash-every", type=int, default=100)
    parser.add_argument("--kill-step", type=int, default=5, help="the step (from 1) the victim dies at (kill)")
    parser.add_argument("--join-after", type=int, default=2, help="the rounds (steps) before the joiner starts (join)")
    parser.add_argument(
        "--algorithm",
        choices=(
            "gradient_allreduce",
            "bytegrad",
            "powersgd",
            "diloco",
            "decentralized",
            "low_precision_decentralized",
            "async",
        ),
        default="gradient_allreduce",
    )
    parser.add_argument("--sync-every", type=int, default=8, help="DiLoCo's H")
    parser.add_argument("--fragments", type=int, default=1, help="Streaming DiLoCo's P")
    parser.add_argument("--fragment-sync-delay", type=int, default=0, help="Streaming DiLoCo's tau (overlapped)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--rate", help="each rank on a link of this rate (e.g. 100mbit; root): the harness's network")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode == "overhead" and args.algorithm == "async":
        parser.error("overhead: the plain steps would run no averaging rounds (the fault-tolerant trainer drives them)")
    if args.worker:
        worker(args)
        return
    meta = run_meta(
        ["jax", "mpich"], ranks=args.ranks, engine=args.engine, model=args.model, width=args.width, steps=args.steps,
        rounds=args.rounds,
        algorithm=args.algorithm, sync_every=args.sync_every if args.algorithm == "diloco" else None, rate=args.rate,
        fragments=args.fragments if args.algorithm == "diloco" else None,
        fragment_sync_delay=args.fragment_sync_delay if args.algorithm == "diloco" else None,
        kill_step=args.kill_step if args.mode == "kill" else None,
        join_after=args.join_after if args.mode == "join" else None,
    )  # fmt: skip
    from bagua_common.fault_tolerance.settings import temporary_job_secret

    with tempfile.TemporaryDirectory(prefix="bagua-ft-bench-") as folder, temporary_job_secret():
        workdir = Path(folder)
        codes = launch(args, workdir)
        records = [json.loads(p.read_text()) for p in sorted(workdir.glob("rank*.json"))]
        if not records:
            sys.exit(
                f"no rank finished (exit codes {codes}): see the logs\n" + (workdir / "rank0.log").read_text()[-3000:]
            )
        kill_time = float((workdir / "kill-time").read_text()) if args.mode == "kill" else None
        for rank, code in enumerate(codes):  # a rank that failed is named, with the end of its log
            if code != 0:
                print(
                    f"rank {rank} exited with {code}:\n" + (workdir / f"rank{rank}.log").read_text()[-3000:],
                    file=sys.stderr,
                )
    finish_meta(meta)
    title = f"# Fault tolerance, JAX native {args.engine.upper()} engine, {args.algorithm}: {args.mode}"
    lines = [title, "", *header_lines(meta), ""]
    if args.mode == "overhead":
        rows, ratios = [], []
        for index, rounds in enumerate(zip(*(r["rounds"] for r in records))):
            plain = max(t["plain"] for t in rounds)
            ft = max(t["ft"] for t in rounds)
            ratios.append(ft / plain)
            rows.append([index, f"{plain * 1e3:.2f}", f"{ft * 1e3:.2f}", f"{ft / plain:.4f}"])
        lines += table(["round", "plain step (ms)", "fault-tolerant step (ms)", "ratio"], rows)
        lines += ["", f"median ratio {statistics.median(ratios):.4f} (min {min(ratios):.4f}, max {max(ratios):.4f})"]
        lines += ["", compiled_ahead_line(records, "the rounds began")]
        payload = {**meta, "exit_codes": codes, "ratios": ratios, "records": records}
    elif args.mode == "join":
        lines += join_table(records, args.sync_every if args.algorithm == "diloco" else 1)
        payload = {**meta, "exit_codes": codes, "records": records}
    else:
        rows = []
        for r in records:
            steps = [step for step, _ in r["attempts"]]
            again = sorted({step for step in steps if steps.count(step) > 1})
            if not again:  # one step behind the others, it took that step by itself in its recovery (voting one ahead)
                rows.append([r["rank"], "-", "-", "none: took the others' step by itself", r["compiled"]])
                continue
            retried = [t for step, t in r["attempts"] if step == again[0]]
            done = r["ends"][str(again[0])] - kill_time
            rows.append([r["rank"], f"{retried[-1] - kill_time:.2f}", f"{done:.2f}", ", ".join(map(str, again))])
            rows[-1].append(r["compiled"])
        header = ["rank", "resumed after the kill (s)", "its retried step done (s)", "steps run again"]
        lines += table([*header, "step compilations"], rows)
        lines += ["", compiled_ahead_line(records, "the kill came")]
        payload = {**meta, "exit_codes": codes, "kill_time": kill_time, "records": records}
    print("\n".join(lines))
    suffix = (  # the MPI engine's results, from before the TCP engine, carry no engine
        ("" if args.engine == "mpi" else f"-{args.engine}")
        + ("" if args.algorithm == "gradient_allreduce" else f"-{args.algorithm}")
        + ("" if args.fragment_sync_delay == 0 else f"-overlapped-{args.fragments}x{args.fragment_sync_delay}")
        + ("" if args.model == "mlp" else f"-gpt-{args.model}")
        + ("" if args.rate is None else f"-{args.rate}")
        + ("" if args.mode != "kill" or args.kill_step == 5 else f"-step-{args.kill_step}")
        + ("" if args.mode != "join" or args.join_after == 2 else f"-after-{args.join_after}")
    )
    write_results(args.out, f"fault-tolerance-jax-{args.mode}{suffix}", lines, payload)


if __name__ == "__main__":
    main()

"""The fault matrix of JAX's ``FaultTolerantTrainer`` over the native TCP engine: each fault kind where tests inject it.

``python benchmarks/fault_matrix_jax.py`` runs one job per case: 3 members, each its own ``mpiexec -n 1`` job in its
own network namespace behind its own link (the network harness), training the tests' linear model
(``tests/fault_tolerance_workers_jax.py``; gradient allreduce, or DiLoCo with rounds of 4 inner steps) with heartbeats
every 0.1 s and ``dead_after`` 1.5 s. Member 2 fails:

* in step 3's collective (the others blocked in it): ``kill`` (SIGKILL), ``stop`` (SIGSTOP: a hang), ``raise`` (an
  exception), ``partition`` (its link down for 4.5 s, the process running) or ``slow`` (it starts the step past the
  others' 2-s collective timeout, alive);
* ``before_vote``: SIGKILLed once step 3's collective completed, before its vote;
* in a ``recovery``: member 1 SIGKILLed in step 3's collective, member 2 as the survivors rebuild the communicator;
* in DiLoCo's ``exchange`` of inner step 8 (the others blocked in it): each kind but ``slow``.

A process joins for each member lost for good (a partitioned member comes back by itself). Reported per case: seconds
from the fault to the survivors' step running again (DiLoCo: to the round's exchange done among them), the steps they
ran again (DiLoCo: the exchange), seconds from a joiner's request to its first step done (a partitioned member: from
its link's return), and whether the members' replicated state (DiLoCo: the round start) ended bit-identical.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import numpy as np
from harness.links import Network
from harness.matrix import lost_for_good, publish, run_matrix
from harness.results import RESULTS, finish_meta, run_meta

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fault_tolerance_workers_jax import DILOCO_ROUND, PAUSE_SECONDS, TIMING  # noqa: E402
from multiprocess import ONE_CPU_DEVICE, run_ranks  # noqa: E402

MEMBERS, VICTIM, STEP, STEPS = 3, 2, 3, 8
EXCHANGE_STEP = 2 * DILOCO_ROUND
CASES = [
    *((kind, "collective") for kind in ("kill", "stop", "raise", "partition", "slow")),
    ("kill", "before_vote"),
    ("kill", "recovery"),
    *((kind, "exchange") for kind in ("kill", "stop", "raise", "partition")),
]


def arguments(kind: str, where: str) -> tuple[str, int, tuple, dict[str, str]]:
    """The worker function, its process count, its arguments and the environment the case adds."""
    lost = lost_for_good(kind, where)
    if where == "exchange":
        faults = {EXCHANGE_STEP: (VICTIM, kind)}
        return "train_diloco", MEMBERS + lost, (faults, MEMBERS, MEMBERS, 16, {}), {}
    if where == "recovery":
        faults = {STEP: (1, "kill")}
        return "train", MEMBERS + lost, (faults, MEMBERS, MEMBERS, STEPS), {"FT_KILL_IN_REBUILD": f"{VICTIM}:start"}
    faults = {STEP: (VICTIM, "kill-before-vote" if where == "before_vote" else kind)}
    return "train", MEMBERS + lost, (faults, MEMBERS, MEMBERS, STEPS), {"FT_COMM_TIMEOUT": "2"}


def run_case(kind: str, where: str, timeout: float) -> dict:
    """One job with the case's faults; its measures."""
    function, count, args, env = arguments(kind, where)
    signals = Path(tempfile.mkdtemp(prefix="bagua-fault-matrix-jax-"))

    def end_the_hung(codes: list[int | None]) -> None:  # a stopped member never ends by itself
        if kind == "stop" and codes[VICTIM] is None and all(c is not None for r, c in enumerate(codes) if r != VICTIM):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int((signals / f"pid{VICTIM}").read_text()), signal.SIGKILL)

    try:
        with Network(count, verbose=False) as network:
            results = run_ranks(
                f"fault_tolerance_workers_jax:{function}",
                count,
                *args,
                launcher="mpiexec-per-rank",
                timeout=timeout,
                env={**ONE_CPU_DEVICE, "BAGUA_TEST_SIGNALS": str(signals), "FT_ENGINE": "tcp", **env},
                check=False,
                watch=end_the_hung,
                network=network,
            )
        return {"kind": kind, "where": where, **measures(results, kind, where, signals)}
    finally:
        shutil.rmtree(signals, ignore_errors=True)


def measures(results, kind: str, where: str, signals: Path) -> dict:
    """Seconds to resume, steps run again, joiners' seconds and replica equality, from the members' records."""
    records = {r.rank: r.value for r in results if r.returncode == 0 and r.value is not None}
    survivor = records.get(0)
    if survivor is None:
        # each rank's last lines: a rank still running at the timeout ends them with its threads' stacks
        return {"ended": False, "output": "\n".join(f"--- rank {r.rank} ---\n{r.output[-8000:]}" for r in results)}
    fault_step = EXCHANGE_STEP if where == "exchange" else STEP
    fault_file = signals / f"fault-time-{fault_step}"
    fault_time = float(fault_file.read_text()) if fault_file.exists() else None
    if where == "exchange":
        done = [a["end"] for a in survivor["steps"] if a["step"] == fault_step]
        resume = done[-1] - fault_time if done and fault_time else None
        again = [a["step"] for a in survivor["attempts"]].count(fault_step) - 1  # its inner step is not run again
    else:  # the first step run again from the fault's on (a death before the vote is seen in the next step)
        tried = [a["transaction"] for a in survivor["attempts"]]
        retried = next(t for t in sorted(set(tried)) if t >= fault_step and tried.count(t) > 1)
        attempts = [a for a in survivor["attempts"] if a["transaction"] == retried]
        began = fault_time if fault_time is not None else attempts[0]["start"]  # slow: from the step's start
        resume, again = attempts[-1]["start"] - began, len(attempts) - 1
    joiners = []
    for rank, record in records.items():
        if rank >= MEMBERS and record["asked"] is not None:
            joiners.append(record["steps"][0]["end"] - record["asked"])
        elif kind == "partition" and rank == VICTIM:  # its steps in the epoch that admitted it again
            first = [s for s in record["steps"] if s["epoch"] >= record["recoveries"][-1]["epoch"]]
            joiners.append(first[0]["end"] - fault_time - PAUSE_SECONDS if first else None)
    # the replicated state: the parameters, or DiLoCo's round start (the parameters drift apart within a round)
    replicated = [r["round_start" if where == "exchange" else "params"] for r in records.values()]
    identical = all(np.array_equal(p[k], replicated[0][k]) for p in replicated for k in replicated[0])
    return {
        "ended": True,
        "resume_s": None if resume is None else round(resume, 3),
        "steps_again": again,
        "joiner_s": [None if s is None else round(s, 3) for s in joiners],
        "members_at_end": len(records),
        "survivor_attempts": [a.get("step", a.get("transaction")) for a in survivor["attempts"]],
        "identical": identical,
    }


def row_of(case: dict) -> list[object]:
    """The case's cells in the results table."""
    if not case["ended"]:
        return [case["kind"], case["where"], "did not end", "", "", ""]
    joiners = ", ".join("-" if s is None else f"{s:.2f}" for s in case["joiner_s"]) or "-"
    resume = "-" if case["resume_s"] is None else f"{case['resume_s']:.2f}"
    equal = "yes" if case["identical"] else "no"
    return [case["kind"], case["where"], resume, case["steps_again"], joiners, f"{equal} ({case['members_at_end']})"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a case may take")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    meta = run_meta(["jax"], argv=sys.argv[1:], **vars(args) | {"out": None})
    cases, loads = run_matrix(CASES, lambda kind, where: run_case(kind, where, args.timeout), row_of)
    finish_meta(meta)
    notes = [
        f"- 3 members, each in its own network namespace; member {VICTIM} fails in step {STEP} (DiLoCo: in the "
        f"exchange of inner step {EXCHANGE_STEP}); heartbeats every {TIMING['heartbeat_period']:g} s, dead after "
        f"{TIMING['dead_after']:g} s; slow: past the others' 2-s collective timeout",
        "- resume: seconds from the fault to survivor 0's step running again (slow: from the step's start; DiLoCo: to "
        "the round's exchange done among the survivors); again: the steps it ran again (DiLoCo: the exchange); "
        f"joiner: seconds from a joiner's request to its first step done, or from a partitioned member's link "
        f"returning ({PAUSE_SECONDS:g} s after the fault) to its first step done; identical: the members that ended",
    ]
    head = ["fault", "where", "survivors resume (s)", "steps again", "joiner (s)", "bit-identical (members)"]
    title = "The fault matrix (JAX, native TCP engine): each fault kind where the tests inject it"
    return publish(args.out, "fault-matrix-jax", title, meta, loads, notes, head, cases, row_of)


if __name__ == "__main__":
    sys.exit(main())

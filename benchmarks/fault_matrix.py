"""The fault matrix (issue 42): every fault kind at every point of a step, in a fault-tolerant torch job over gloo.

``python benchmarks/fault_matrix.py`` runs one job per case: 4 ranks, each in its own network namespace behind its own
link (the network harness), training the tests' small model (``tests/fault_tolerance_workers_torch.py``: gradient
allreduce, SGD with momentum; DiLoCo with an exchange every 2 steps for the exchange's cases) with 0.1-s steps,
heartbeats every 50 ms and ``dead_after`` 3 s. Rank 2 fails at step 3:

* kinds: ``kill`` (SIGKILL), ``stop`` (SIGSTOP: a hang), ``raise`` (an exception), ``partition`` (its link down for
  6 s, the process running) and ``slow`` (1 s late, alive);
* where: in the ``forward`` pass, in the ``backward`` pass (in a gradient hook, the others already in the step's
  allreduce), ``before_vote`` (the step's collectives done, the optimizer about to step), in DiLoCo's ``exchange``,
  and in a ``recovery`` (rank 3 killed in the step's backward pass first, rank 2 failing as the survivors form the
  next epoch).

A replacement is started for each rank lost for good once the survivors train again (a partitioned rank comes back
by itself), so every job ends with 4 members. Reported per case: seconds from the fault to the survivors' step
running again (the slowest survivor), the steps they lost, seconds from each joiner's request to being ready (a
partitioned rank: from its link's return to training), and whether the replicas ended bit-identical (the job also
compares their hashes after every change and every 5 steps, and stops on a mismatch).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from harness.links import Network
from harness.matrix import lost_for_good, publish, run_matrix
from harness.results import RESULTS, finish_meta, run_meta

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from fault_tolerance_job_torch import DEAD_AFTER, Job  # noqa: E402

KINDS = ("kill", "stop", "raise", "partition", "slow")
WHERES = ("forward", "backward", "before_vote", "exchange", "recovery")
RANKS, VICTIM, STEP = 4, 2, 3
PARTITION_SECONDS = DEAD_AFTER + 3.0
SLOW_SECONDS = 1.0
DILOCO = 'diloco {"sync_every": 2}'
EXCHANGE_STEP = 4  # DiLoCo's second exchange: the first round is behind every rank


def faults_of(kind: str, where: str) -> list[dict]:
    """The case's faults: rank 2's, after rank 3's death in a recovery's case."""
    step = EXCHANGE_STEP if where == "exchange" else STEP
    fault = {"rank": VICTIM, "step": step, "where": where, "kind": kind}
    fault |= {"partition": {"seconds": PARTITION_SECONDS}, "slow": {"seconds": SLOW_SECONDS}}.get(kind, {})
    first = [{"rank": 3, "step": step, "where": "backward", "kind": "kill"}] if where == "recovery" else []
    return [*first, fault]


def run_case(kind: str, where: str, steps: int, timeout: float) -> dict:
    """One job with the case's faults; its measures (or, where it did not end in ``timeout`` seconds, why)."""
    algorithm = DILOCO if where == "exchange" else "gradient_allreduce"
    replacements = lost_for_good(kind, where)
    with Network(RANKS + replacements, verbose=False) as network:
        job = Job(RANKS, algorithm, faults_of(kind, where), steps, RANKS, step_seconds=0.1, network=network)
        try:
            job.wait_until(lambda: len(job.pids(joiner=False)) == RANKS, timeout)
            first_members = {job.rank_of(pid): pid for pid in job.pids(joiner=False)}
            if replacements:
                victim, others = first_members[VICTIM], [p for r, p in first_members.items() if r != VICTIM]

                def trains_again() -> bool:
                    return any(resumed(job, p, f) for f in job.of(victim, "fault") for p in others)

                job.wait_until(trains_again, timeout)
                for _ in range(replacements):
                    job.join()
            job.finish(timeout)
        except AssertionError as stuck:  # its output, and where each rank still running waited
            job.close()
            return {"kind": kind, "where": where, "ended": False, "output": str(stuck)}
    return {"kind": kind, "where": where, "ended": True, **measures(job, kind, first_members)}


def resumed(job: Job, pid: int, fault: dict) -> float | None:
    """When rank ``pid`` trained again after ``fault``: its retry of a step, or its second run of the fault step's
    DiLoCo exchange (the survivors retry the round's exchange among themselves, within the step); None if not yet."""
    retries = [e["t"] for e in job.of(pid, "retry") if e["t"] >= fault["time"]]
    exchanged_again = [e["t"] for e in job.of(pid, "exchange") if e["step"] == fault["step"]][1:]
    return min(retries + exchanged_again, default=None)


def measures(job: Job, kind: str, first_members: dict[int, int]) -> dict:
    """The case's seconds to resume, steps lost, joiners' seconds and replica equality, from its ranks' lines."""
    victim = first_members[VICTIM]
    (fault,) = job.of(victim, "fault")
    lost = {r for r, pid in first_members.items() if not job.of(pid, "end")}
    survivors = [pid for r, pid in first_members.items() if r not in lost and r != VICTIM]
    resumes = [resumed(job, pid, fault) for pid in survivors]
    ends = [e for e in job.events if e["event"] == "end"]
    joiners = [e["joined"] for pid in job.pids(joiner=True) for e in job.of(pid, "end")]
    if kind == "partition":  # the cut-off rank's first step once admitted again, from its link's return
        back = [e["t"] for e in job.of(victim, "step") if e["step"] > fault["step"]]
        joiners.append(back[0] - fault["time"] - PARTITION_SECONDS if back else None)
    return {
        "resume_s": None if None in resumes else round(max(resumes) - fault["time"], 3),
        "steps_lost": max(sum(r["steps_lost"] for r in job.of(pid, "end")[0]["recoveries"]) for pid in survivors),
        "joiner_s": [None if s is None else round(s, 3) for s in joiners],
        "members_at_end": len(ends),
        "identical": len(ends) == RANKS and len({e["digest"] for e in ends}) == 1,
        "lost_ranks": sorted(lost),
    }


def row_of(case: dict) -> list[str]:
    """The case's cells in the results table."""
    if not case["ended"]:
        return [case["kind"], case["where"], "did not end", "", "", ""]
    joiners = [s for s in case["joiner_s"] if s is not None]
    joined = "-" if not case["joiner_s"] else ", ".join(f"{s:.2f}" for s in joiners) or "never"
    resume = "no change" if case["resume_s"] is None and case["kind"] == "slow" else _seconds(case["resume_s"])
    equal = "yes" if case["identical"] else f"no ({case['members_at_end']} members ended)"
    return [case["kind"], case["where"], resume, case["steps_lost"], joined, equal]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--wheres", nargs="+", choices=WHERES, default=list(WHERES))
    parser.add_argument(
        "--steps", type=int, default=12, help="steps each job trains, its 4 members together at the end"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds a case may take")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    meta = run_meta(["torch"], argv=sys.argv[1:], **vars(args) | {"out": None})
    cases, loads = run_matrix(
        [(kind, where) for kind in args.kinds for where in args.wheres],
        lambda kind, where: run_case(kind, where, args.steps, args.timeout),
        row_of,
    )
    finish_meta(meta)
    resumes = [c["resume_s"] for c in cases if c["ended"] and c["resume_s"] is not None and c["kind"] == "kill"]
    notes = [
        f"- 4 ranks, each in its own network namespace; rank {VICTIM} fails at step {STEP} (DiLoCo's exchange: step "
        f"{EXCHANGE_STEP}); at a recovery, rank 3 was SIGKILLed in that step's backward pass first. Heartbeats every "
        f"50 ms, dead after {DEAD_AFTER:g} s: a hang and a partition are found by the heartbeats, a death by its "
        "closed connections",
        f"- resume: seconds from the fault to the slowest survivor's step running again (SIGKILL: median "
        f"{statistics.median(resumes) if resumes else '-'} s); steps lost: per survivor, the largest; joiner: seconds "
        f"from a replacement's request to being ready, or from a partitioned rank's link returning "
        f"({PARTITION_SECONDS:g} s after the fault) to its first step",
    ]
    head = ["fault", "where", "survivors resume (s)", "steps lost", "joiner ready (s)", "replicas bit-identical"]
    title = "The fault matrix (torch, gloo): each fault kind at each point of a step"
    return publish(args.out, "fault-matrix-torch", title, meta, loads, notes, head, cases, row_of)


if __name__ == "__main__":
    sys.exit(main())

"""The timeline of an elastic job that loses a node and gains one: step, world size, seconds lost per restart.

``python benchmarks/elastic_timeline.py --framework torch`` (or ``jax``) starts two bagua-launch
agents on 127.0.0.1 (two "nodes" of 2 workers: gradient allreduce on a small MLP, a checkpoint
every 2 steps; tests/elastic_train_*.py), SIGKILLs the second node at ``--kill-at``, starts a
third node once the survivor trains again, and reads the workers' event log. For each attempt
(a rendezvous the workers started from) it reports the restart count, the world size, the step
it resumed from, when its first step ended, and what the change cost: the seconds between the
previous attempt's last step and this one's first, and the steps trained again (those after the
last checkpoint). A 2-worker attempt waits at ``--grow-at`` for the joining node, so that the
run always grows back; that wait is part of the next attempt's gap.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from harness.results import RESULTS, finish_meta, header_lines, run_meta, write_results

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from elastic_harness import Job  # noqa: E402


def timeline(job: Job) -> list[dict]:
    """One row per attempt, from rank 0's events."""
    events = [e for e in job.events() if e["rank"] == 0]
    t0 = events[0]["time"]
    rows, previous_last = [], None
    starts = [i for i, e in enumerate(events) if e["event"] == "start"]
    for n, i in enumerate(starts):
        end = starts[n + 1] if n + 1 < len(starts) else len(events)
        steps = [e for e in events[i:end] if e["event"] == "step"]
        row = {
            "restart": events[i]["restart"],
            "world": events[i]["world"],
            "resumed_step": events[i]["step"],
            "last_step": steps[-1]["step"] if steps else events[i]["step"],
            "first_step_s": round(steps[0]["time"] - t0, 2) if steps else None,
            "last_step_s": round(steps[-1]["time"] - t0, 2) if steps else None,
        }
        if previous_last is not None and steps:
            row["seconds_lost"] = round(steps[0]["time"] - previous_last["time"], 2)
            row["steps_trained_again"] = previous_last["step"] - events[i]["step"]
        previous_last = steps[-1] if steps else previous_last
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=["torch", "jax"], required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-seconds", type=float, default=0.2)
    parser.add_argument("--kill-at", type=int, default=15, help="the step at which the second node dies")
    parser.add_argument("--grow-at", type=int, default=35, help="the step at which 2 workers wait for the new node")
    parser.add_argument("--seed", type=int, default=0, help="the model's initialization and the data's order")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    meta = run_meta(["torch", "jax"], argv=sys.argv[1:] if argv is None else argv, **vars(args) | {"out": None})
    folder = Path(tempfile.mkdtemp(prefix="bagua-elastic-timeline-"))
    settings = {"BAGUA_TEST_STEP_SECONDS": str(args.step_seconds), "BAGUA_TEST_GROW_AT": str(args.grow_at)}
    job = Job(folder, args.framework, args.steps, args.seed, **settings)
    try:
        survivor = job.start_agent("--nnodes", "1:2", "--max-restarts", "3")
        doomed = job.start_agent("--nnodes", "1:2", "--max-restarts", "3")

        def reached(step: int, world: int):
            return lambda ev: any(e["event"] == "step" and e["world"] == world and e["step"] >= step for e in ev)

        job.wait_for(f"step {args.kill_at} with 4 workers", reached(args.kill_at, 4), timeout=300)
        job.kill_node(doomed)
        job.wait_for("training with 2 workers", reached(args.kill_at, 2), timeout=300)
        joining = job.start_agent("--nnodes", "1:2", "--max-restarts", "3")
        codes = job.finish([survivor, joining], timeout=600)
        rows = timeline(job)
    finally:
        job.close()
        shutil.rmtree(folder, ignore_errors=True)
    finish_meta(meta)
    markdown = [
        f"# Elastic timeline ({args.framework}): a node dies at step {args.kill_at}, another joins",
        "",
        *header_lines(meta),
        f"- agents' exit codes: {codes}",
        f"- 2 workers wait at step {args.grow_at} for the joining node: that wait is in the last row's seconds lost",
        "",
        "| restart | world | resumed step | last step | first step at (s) | seconds lost | steps trained again |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        markdown.append(
            f"| {r['restart']} | {r['world']} | {r['resumed_step']} | {r['last_step']} | {r['first_step_s']} | "
            f"{r.get('seconds_lost', '')} | {r.get('steps_trained_again', '')} |"
        )
    md, _ = write_results(args.out, f"elastic-timeline-{args.framework}", markdown, {**meta, "rows": rows})
    print(md.read_text())
    return 0 if codes == [0, 0] else 1


if __name__ == "__main__":
    sys.exit(main())

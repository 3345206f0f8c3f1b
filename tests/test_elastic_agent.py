"""Elastic jobs under torch's elastic agent: nodes leave and join, workers die, training goes on.

Each test starts real ``bagua-launch --nnodes 1:2`` agents on 127.0.0.1 (two agents stand
for two nodes of two workers each) with short rendezvous timeouts, running
elastic_train_torch.py or elastic_train_jax.py (gradient allreduce on a small MLP, a
checkpoint every 2 steps, an event log). Every wait is bounded, and every process a test
started is killed when it ends.

* A node dies (its agent and workers get SIGKILL mid-run): the survivor restarts from the
  last checkpoint with 2 workers instead of 4 and finishes; replaying the logged sequence of
  (resumed step, world size) with plain, non-elastic ``bagua-launch`` runs gives the same
  final parameters bit for bit.
* A node joins later: the job grows from 2 to 4 workers without spending a restart
  (``--max-restarts 0``).
* A worker dies (one agent, 2 workers): all workers restart from the last checkpoint with the
  same world size; under torch with DiLoCo, from the middle of a round, and the result is that of
  a run without a death bit for bit.
* The elastic timeline study (``benchmarks/elastic_timeline.py``) runs a node's death and another's
  arrival and reports one row per attempt (34 s; its call into the test harness's job had
  fallen behind a new argument, unseen).

Startup dominates their time (an agent, then each attempt's workers import torch or JAX):
about 7 minutes for the first six on the 2-core machine shared by several jobs (load ~16).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from elastic_harness import TESTS, Job

pytest.importorskip("torch")

STEPS = 12


@pytest.fixture
def job_factory(tmp_path, seed):
    jobs = []

    def make(framework: str, name: str = "job", **settings: str) -> Job:
        folder = tmp_path / name
        folder.mkdir()
        jobs.append(Job(folder, framework, STEPS, seed, **settings))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


def replay(job_factory, framework: str, attempts: list[dict], **settings: str) -> dict[str, np.ndarray]:
    """Train again without the agent: plain bagua-launch runs with each attempt's world size, from its resumed step
    up to the next attempt's, through checkpoints of their own; returns the final parameters."""
    reference = job_factory(framework, "reference", **settings)
    for i, attempt in enumerate(attempts):
        end = attempts[i + 1]["step"] if i + 1 < len(attempts) else STEPS
        if end == attempt["step"]:
            continue  # an attempt that reached no new checkpoint
        command = [sys.executable, "-m", "bagua_launch", "--nproc-per-node", str(attempt["world"]), "--timeout", "300"]
        run = subprocess.run(
            [*command, reference.script],
            env={**reference.env, "BAGUA_TEST_STOP_AT": str(end)},
            capture_output=True,
            text=True,
            timeout=360,
            cwd=reference.folder,
        )
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return reference.final()


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_node_dies_the_survivor_finishes_and_matches_the_replay(framework, job_factory):
    job = job_factory(framework, BAGUA_TEST_STEP_SECONDS="0.3")
    survivor = job.start_agent("--nnodes", "1:2", "--max-restarts", "3")
    doomed = job.start_agent("--nnodes", "1:2", "--max-restarts", "3")
    job.wait_for(
        "step 5 with 4 workers", lambda ev: any(e["event"] == "step" and e["world"] == 4 and e["step"] >= 5 for e in ev)
    )
    job.kill_node(doomed)
    assert job.finish([survivor]) == [0], job.output()
    attempts = job.attempts()
    last = attempts[-1]
    assert last["world"] == 2 and last["restart"] >= 1, attempts
    assert last["step"] >= 4 and last["step"] % 2 == 0, attempts  # a checkpoint of the 4-worker run
    assert any(a["world"] == 4 for a in attempts[:-1]), attempts
    assert [e["step"] for e in job.events() if e["event"] == "done"] == [STEPS]
    got, want = job.final(), replay(job_factory, framework, attempts)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_node_joins_and_the_job_grows_without_spending_a_restart(framework, job_factory):
    job = job_factory(framework, BAGUA_TEST_GROW_AT="5")
    first = job.start_agent("--nnodes", "1:2", "--max-restarts", "0")
    job.wait_for("step 5 with 2 workers", lambda ev: any(e["event"] == "waiting" for e in ev))
    second = job.start_agent("--nnodes", "1:2", "--max-restarts", "0")
    assert job.finish([first, second]) == [0, 0], job.output()
    attempts = job.attempts()
    assert attempts[0]["world"] == 2 and attempts[-1]["world"] == 4, attempts
    assert all(a["restart"] == 0 for a in attempts), attempts
    assert attempts[-1]["step"] == 4, attempts  # the checkpoint before the 2 workers waited at step 5
    assert [e["step"] for e in job.events() if e["event"] == "done"] == [STEPS]


# torch trains with DiLoCo here: the checkpoint of step 4 is taken in the middle of a round (steps 4 to 6), and the
# restart must resume that round exactly: the result is that of a run without a death.
DILOCO = json.dumps({"name": "diloco", "sync_every": 3})


@pytest.mark.parametrize("framework, algorithm", [("torch", DILOCO), ("jax", "")], ids=["torch-diloco", "jax"])
def test_a_worker_dies_and_the_job_restarts_with_the_same_world_size(framework, algorithm, job_factory):
    kill = json.dumps({"rank": 1, "step": 5, "restart": 0})
    job = job_factory(framework, BAGUA_TEST_KILL=kill, BAGUA_TEST_ALGORITHM=algorithm)
    agent = job.start_agent("--nnodes", "1:2", "--max-restarts", "1")
    assert job.finish([agent]) == [0], job.output()
    assert [e["step"] for e in job.events() if e["event"] == "killed"] == [5]
    attempts = [(a["restart"], a["world"], a["step"]) for a in job.attempts()]
    assert attempts == [(0, 2, 0), (1, 2, 4)], attempts
    assert [e["step"] for e in job.events() if e["event"] == "done"] == [STEPS]
    if algorithm:
        # One run straight through, with no death and no restore.
        straight = replay(job_factory, framework, [{"step": 0, "world": 2}], BAGUA_TEST_ALGORITHM=algorithm)
        got = job.final()
        for name in straight:
            np.testing.assert_array_equal(got[name], straight[name], err_msg=name)


def test_the_elastic_timeline_study_reports_each_attempt_of_a_job_that_loses_a_node_and_gains_one(tmp_path):
    # benchmarks/elastic_timeline.py (the README's seconds lost per change) on the same jobs: a node killed at step 6,
    # another started once the survivor trains again; one row per attempt, each later one with its cost
    sys.path.insert(0, str(TESTS.parent / "benchmarks"))
    import elastic_timeline

    options = ["--framework", "torch", "--steps", "30", "--kill-at", "6", "--grow-at", "16", "--out", str(tmp_path)]
    assert elastic_timeline.main(options) == 0
    saved = json.loads((tmp_path / "elastic-timeline-torch.json").read_text())
    rows = saved["rows"]
    assert [r["world"] for r in rows] == [4, 2, 4] and saved["kill_at"] == 6, saved
    for before, after in zip(rows, rows[1:]):
        assert after["seconds_lost"] > 0 and after["resumed_step"] <= before["last_step"], rows
        assert after["steps_trained_again"] == before["last_step"] - after["resumed_step"] <= 2, rows  # saved every 2

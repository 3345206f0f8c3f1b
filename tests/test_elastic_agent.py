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
* A worker dies: all workers restart from the last checkpoint with the same world size.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from multiprocess import free_port

pytest.importorskip("torch")

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
STEPS = 12
# Heartbeats every second, a node lost after 5 missed (2 would flag a healthy agent on a loaded machine).
RDZV_CONF = "join_timeout=60,last_call_timeout=2,close_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=5"
SCRIPTS = {"torch": "elastic_train_torch.py", "jax": "elastic_train_jax.py"}


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class Job:
    """The agents of one elastic job, its folder and its event log."""

    def __init__(self, folder: Path, framework: str, **settings: str):
        self.folder = folder
        self.script = str(TESTS / SCRIPTS[framework])
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.env = {
            **{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},  # one CPU device per JAX process
            "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "JAX_PLATFORMS": "cpu",
            "BAGUA_TEST_DIR": str(folder),
            "BAGUA_TEST_STEPS": str(STEPS),
            **settings,
        }
        self.agents: list[subprocess.Popen] = []
        self.workers: set[int] = set()

    def start_agent(self, *options: str) -> subprocess.Popen:
        index = len(self.agents)
        # On one machine every agent matches the endpoint's host; the first one alone hosts the store (a second
        # one binding the same port too would split the agents into two jobs).
        conf = f"{RDZV_CONF},is_host={int(index == 0)}"
        command = [sys.executable, "-m", "bagua_launch", "--nproc-per-node", "2", "--rdzv-endpoint", self.endpoint]
        command += ["--rdzv-id", "test", "--rdzv-conf", conf, *options, self.script]
        with open(self.folder / f"agent{index}.log", "w") as log:
            agent = subprocess.Popen(
                command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.folder
            )
        self.agents.append(agent)
        return agent

    def events(self) -> list[dict]:
        path = self.folder / "events.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def output(self) -> str:
        return "\n".join(
            f"--- agent {i} ---\n{(self.folder / f'agent{i}.log').read_text()[-6000:]}" for i in range(len(self.agents))
        )

    def wait_for(self, what: str, predicate, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not predicate(self.events()):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.output()}")
            if all(a.poll() is not None for a in self.agents):
                raise AssertionError(f"every agent exited while waiting for {what}\n{self.output()}")
            time.sleep(0.1)

    def kill_node(self, agent: subprocess.Popen) -> None:
        """SIGKILL an agent and its workers at once, as if its node had died."""
        workers = _children(agent.pid)
        self.workers.update(workers)
        for pid in [agent.pid, *workers]:
            _kill(pid)
        agent.wait()

    def finish(self, agents: list[subprocess.Popen], timeout: float = 150) -> list[int]:
        deadline = time.monotonic() + timeout
        for agent in agents:
            try:
                agent.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"the job did not finish in {timeout} s\n{self.output()}") from None
        return [a.returncode for a in agents]

    def close(self) -> None:
        for agent in self.agents:
            self.workers.update(_children(agent.pid))
            _kill(agent.pid)
        for pid in self.workers | {e["pid"] for e in self.events()}:
            _kill(pid)
        for agent in self.agents:
            agent.wait()

    def attempts(self) -> list[dict]:
        """Rank 0's start events: one per attempt that got going (restart count, world size, resumed step)."""
        return [e for e in self.events() if e["event"] == "start" and e["rank"] == 0]

    def final(self) -> dict[str, np.ndarray]:
        with np.load(self.folder / "final.npz") as data:
            return {k: data[k] for k in data.files}


@pytest.fixture
def job_factory(tmp_path):
    jobs = []

    def make(framework: str, name: str = "job", **settings: str) -> Job:
        folder = tmp_path / name
        folder.mkdir()
        jobs.append(Job(folder, framework, **settings))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


def replay(job_factory, framework: str, attempts: list[dict]) -> dict[str, np.ndarray]:
    """Train again without the agent: plain bagua-launch runs with each attempt's world size, from its resumed step
    up to the next attempt's, through the same checkpoints; returns the final parameters."""
    reference = job_factory(framework, "reference")
    for i, attempt in enumerate(attempts):
        end = attempts[i + 1]["step"] if i + 1 < len(attempts) else STEPS
        if end == attempt["step"]:
            continue  # an attempt that reached no new checkpoint
        command = [sys.executable, "-m", "bagua_launch", "--nproc-per-node", str(attempt["world"]), "--timeout", "120"]
        run = subprocess.run(
            [*command, reference.script],
            env={**reference.env, "BAGUA_TEST_STOP_AT": str(end)},
            capture_output=True,
            text=True,
            timeout=150,
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


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_a_worker_dies_and_the_job_restarts_with_the_same_world_size(framework, job_factory):
    job = job_factory(framework, BAGUA_TEST_KILL=json.dumps({"rank": 1, "step": 5, "restart": 0}))
    agent = job.start_agent("--nnodes", "1:2", "--max-restarts", "1")
    assert job.finish([agent]) == [0], job.output()
    assert [e["step"] for e in job.events() if e["event"] == "killed"] == [5]
    attempts = [(a["restart"], a["world"], a["step"]) for a in job.attempts()]
    assert attempts == [(0, 2, 0), (1, 2, 4)], attempts
    assert [e["step"] for e in job.events() if e["event"] == "done"] == [STEPS]

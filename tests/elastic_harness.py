"""Elastic jobs of real bagua-launch agents on 127.0.0.1 (test_elastic_agent.py, benchmarks/elastic_timeline.py).

:class:`Job` starts agents (``--nproc-per-node 2``, the c10d rendezvous with short heartbeats),
reads the workers' event log (see elastic_job.py), kills a "node" (an agent and its workers)
and, in :meth:`Job.close`, every process it started.
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
from multiprocess import free_port

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
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

    def __init__(self, folder: Path, framework: str, steps: int, seed: int, **settings: str):
        self.folder = folder
        self.script = str(TESTS / SCRIPTS[framework])
        self.endpoint = f"127.0.0.1:{free_port()}"
        self.env = {
            **{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},  # one CPU device per JAX process
            "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "JAX_PLATFORMS": "cpu",
            "BAGUA_TEST_SEED": str(seed),
            "BAGUA_TEST_DIR": str(folder),
            "BAGUA_TEST_STEPS": str(steps),
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

    def wait_for(self, what: str, predicate, timeout: float = 300) -> None:
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

    def finish(self, agents: list[subprocess.Popen], timeout: float = 300) -> list[int]:
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

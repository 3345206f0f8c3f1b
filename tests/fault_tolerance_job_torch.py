"""A fault-tolerant torch job's processes for the tests and the fault matrix: ``fault_tolerance_workers_torch.py`` on
each rank (forked with torch imported, under ``bagua-launch --fault-tolerant``, or in the network harness's namespaces),
the JSON lines they print, and the joiners started into it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TextIO

from fork_server import ForkedRank, start_rank
from multiprocess import TESTS, free_port, rank_import_path
from stack_dumps import request_dump

from bagua_common.job.rank_environment import threads_per_rank

WORKER = str(TESTS / "fault_tolerance_workers_torch.py")
DEAD_AFTER = 3.0


class Job:
    """One job's processes (plain ones, ``bagua-launch --fault-tolerant``, or, given the network harness's
    ``network``, each rank in its own namespace behind its own link) and the JSON lines its ranks print, by process
    id (a replacement is a new process). Plain ranks are forked from a process with torch imported, quick to start,
    unless ``forked`` is False: each then starts an interpreter of its own, whose exit handlers run as it ends (a
    forked rank ends with ``os._exit``)."""

    def __init__(
        self,
        ranks: int,
        algorithm: str,
        faults: list[dict],
        steps: int,
        world: int,
        launcher: bool = False,
        nodes: int = 1,
        step_seconds: float = 0.0,
        fused: bool = False,
        env: dict[str, str] | None = None,
        max_restarts: int = 0,
        network=None,
        forked: bool = True,
    ):
        self.env = {
            **{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")},
            "PYTHONPATH": rank_import_path(),
            "BAGUA_FAULT_TOLERANCE": "1",
            "BAGUA_FT_HEARTBEAT": "0.05",
            "BAGUA_FT_DEAD_AFTER": str(DEAD_AFTER),
            "BAGUA_FT_HASH_EVERY": "5",
            "BAGUA_COMM_TIMEOUT": "60",
            "FT_ALGORITHM": algorithm,
            "FT_STEPS": str(steps),
            "FT_WORLD": str(world),
            "FT_STEP_SECONDS": str(step_seconds),
            "FT_FUSED": str(int(fused)),
            "FT_FAULTS": json.dumps(faults),
            "FT_MARKS": tempfile.mkdtemp(prefix="bagua-ft-faults-"),
            # every node's ranks run on this machine: the cores are shared among all of them
            "OMP_NUM_THREADS": str(threads_per_rank(ranks)),
            **(env or {}),
        }
        self.procs: list[subprocess.Popen | ForkedRank] = []
        self.events: list[dict] = []
        self.text: list[str] = []
        self._threads: list[threading.Thread] = []
        self.forked = forked
        if launcher:  # one per node, meeting at a rendezvous on this machine as a multi-node job's launchers do
            command = [sys.executable, "-m", "bagua_launch", "--fault-tolerant"]
            command += ["--nproc-per-node", str(ranks // nodes), "--max-restarts", str(max_restarts)]
            if nodes > 1:
                command += ["--nnodes", str(nodes), "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
            for _ in range(nodes):
                self._start(command, {})
        elif network:
            self.network, self.namespaces = network, iter(range(network.ranks))
            self.where = {"MASTER_ADDR": network.master_addr, "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(ranks)}
            for rank in range(ranks):
                self._start_in_namespace({"RANK": str(rank)})
        else:
            self.where = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(ranks)}
            for rank in range(ranks):
                self._start_rank({**self.where, "RANK": str(rank)})

    def join(self) -> None:
        """Start a process that joins the job (as a replacement does; in the next free namespace of a network)."""
        if hasattr(self, "network"):
            self._start_in_namespace({"BAGUA_FT_JOIN": "1"})
        else:
            self._start_rank({**self.where, "BAGUA_FT_JOIN": "1"})

    def _start_in_namespace(self, extra: dict[str, str]) -> None:
        namespace = next(self.namespaces)
        env = {**self.network.env(namespace, int(self.where["MASTER_PORT"]), self.env), **self.where, **extra}
        if "RANK" not in extra:
            del env["RANK"]
        proc = self.network.popen(
            namespace, [sys.executable, WORKER], env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._follow(proc, proc.stdout)

    def _start_rank(self, extra: dict[str, str]) -> None:
        if not self.forked:
            self._start([sys.executable], extra)
            return
        output = Path(self.env["FT_MARKS"]) / f"output-{len(self.procs)}"
        os.mkfifo(output)
        self._follow(start_rank([str(WORKER)], {**self.env, **extra}, output), output)

    def _start(self, command: list[str], extra: dict[str, str]) -> None:
        proc = subprocess.Popen(
            [*command, WORKER],
            env={**self.env, **extra},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its group: a launcher's workers and slots go with it
        )
        self._follow(proc, proc.stdout)

    def _follow(self, proc: subprocess.Popen | ForkedRank, output: Path | TextIO) -> None:
        self.procs.append(proc)
        thread = threading.Thread(target=self._read, args=(output,), daemon=True)
        thread.start()
        self._threads.append(thread)

    def _read(self, source: Path | TextIO) -> None:
        """Collect a process's lines from its FIFO (opened here: opening blocks until the rank opens it too) or its
        stdout pipe, until the process ends."""
        with open(source) if isinstance(source, Path) else source as output:
            for line in output:
                self.text.append(line)
                try:
                    self.events.append(json.loads(_body(line)))
                except json.JSONDecodeError:
                    pass

    def of(self, pid: int, kind: str) -> list[dict]:
        return [e for e in list(self.events) if e["pid"] == pid and e["event"] == kind]

    def pids(self, **match) -> list[int]:
        """The processes whose ``start`` event has ``match``'s fields, in start order."""
        return [e["pid"] for e in list(self.events) if e["event"] == "start" and match.items() <= e.items()]

    def rank_of(self, pid: int) -> int:
        return self.of(pid, "start")[0]["rank"]

    def wait_until(self, condition, timeout: float = 90) -> None:
        """Wait for ``condition``; past ``timeout`` seconds, fail with the output and every live rank's stacks."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(self.output() + self.stacks())
            time.sleep(0.05)

    def stacks(self) -> str:
        """Every thread's stack in each of the job's ranks still running (:mod:`stack_dumps`), rank by rank: those
        started that did not end (a rank a launcher started has no handle here: its end event alone tells)."""
        dumps, handles = [], {proc.pid: proc for proc in self.procs}
        for pid in self.pids():
            if self.of(pid, "end") or (pid in handles and handles[pid].poll() is not None):
                continue  # its pid may be another process's by now
            mark = len(self.text)
            request_dump(pid)
            dump = "".join(line for line in self.text[mark:] if not _body(line).startswith("{"))  # no events
            dumps.append(f"--- stacks of process {pid} ---\n{dump}" if dump else "")
        return "".join(dumps)

    def finish(self, timeout: float = 120) -> None:
        """Wait for every process to exit (or stop: a stopped one never will), then kill what is left."""
        self.wait_until(lambda: all(p.poll() is not None or _stopped(p.pid) for p in self.procs), timeout)
        self.close()
        for thread in self._threads:
            thread.join(5)

    def close(self) -> None:
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        shutil.rmtree(self.env["FT_MARKS"], ignore_errors=True)

    def output(self) -> str:
        """The lines that are not steps, and the last steps."""
        others = [line for line in self.text if '"event": "step"' not in line]
        steps = [line for line in self.text if '"event": "step"' in line]
        return "".join(line[:400].rstrip("\n") + "\n" for line in others[-80:] + steps[-8:])


def _body(line: str) -> str:
    """A rank's line without the ``[rank N]`` prefix bagua-launch gives it."""
    return line.split("] ", 1)[1] if line.startswith("[rank ") else line


def _stopped(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (FileNotFoundError, ProcessLookupError):
        return False

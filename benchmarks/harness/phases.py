"""Jobs that run in phases, one phase of one job at a time, each timed phase behind the load gate.

A job whose ranks keep running between measurements (they train once, then time steps at several links) is
driven through files in its folder, which every rank sees whatever its network namespace. Before each phase a
rank writes ``ready-<s>-<rank>`` (``s`` counts the phases it was given so far) and waits for ``go-<s>``, which
names the phase to run (an index into the job's links) or ends the job. :class:`PhaseRunner`, a thread of the
study, gives the phases out in the order of :func:`schedule` once every job is idle, after setting the phase's
link; a timed phase runs inside :meth:`~harness.load.LoadGate.phase` and is given again (up to the gate's
``attempts``) while its load keeps it from being published. The ranks (:func:`phases`) just run what they are
given; :func:`kept` picks each phase's last attempt from what a rank recorded, with its load.

Several jobs side by side (a pair) take turns: every job's first phase, then the later ones alternating which job
goes first (A B, B A, ...), so that a drift in the machine's load falls on both alike. A waiting job's ranks sleep
on the file system (asynchronous averaging paused, if the worker pauses it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .links import Network, parse_rate
from .load import LoadGate
from .repeats import alternated

POLL_S = 0.02


@dataclasses.dataclass
class PhasedJob:
    """One job's folder and its phases: the link of each and whether it is timed (gated)."""

    folder: Path
    links: Sequence[str]
    timed: Sequence[bool]

    def __post_init__(self) -> None:
        if len(self.links) != len(self.timed):
            raise ValueError(
                f"a PhasedJob needs a link and a timed flag per phase, got {len(self.links)} links and "
                f"{len(self.timed)} flags"
            )


def schedule(jobs: Sequence[PhasedJob]) -> list[tuple[int, int]]:
    """(job, phase) in the order they run: every job's phase 0, then each later phase of every job, the jobs in
    order for phase 1, reversed for phase 2, and so on."""
    order = [(j, 0) for j in range(len(jobs))]
    for phase in range(1, max(len(job.links) for job in jobs)):
        order += [(j, phase) for j in alternated(range(len(jobs)), phase - 1) if phase < len(jobs[j].links)]
    return order


class PhaseRunner(threading.Thread):
    """Gives out the phases of ``jobs`` (ranked by ``net``'s ranks) in :func:`schedule`'s order, one at a time;
    :attr:`records` keeps, per phase given, ``{"job", "phase", "seq", "attempt", "load"}``, the load (a
    :meth:`~harness.load.PhaseLoad.as_dict`) for timed phases only. Set :attr:`stop` to end it early."""

    def __init__(self, net: Network, jobs: Sequence[PhasedJob], gate: LoadGate) -> None:
        super().__init__(daemon=True, name="phase-runner")
        self.net, self.jobs, self.gate = net, list(jobs), gate
        self.stop = threading.Event()
        self.records: list[dict[str, Any]] = []
        self._seq = [0] * len(self.jobs)

    def _idle(self, job: int) -> bool:
        folder, seq = self.jobs[job].folder, self._seq[job]
        return all((folder / f"ready-{seq}-{r}").exists() for r in range(self.net.ranks))

    def _wait_idle(self) -> bool:
        """Wait until every job's ranks wait for their next phase; False when stopped."""
        while not all(self._idle(j) for j in range(len(self.jobs))):
            if self.stop.wait(POLL_S):
                return False
        return True

    def _give(self, job: int, order: dict[str, Any]) -> int:
        seq = self._seq[job]
        go = self.jobs[job].folder / f"go-{seq}"
        # Written whole, then renamed: a rank polling for the file never reads it half written.
        partial = go.with_name(go.name + ".partial")
        partial.write_text(json.dumps(order))
        os.replace(partial, go)
        self._seq[job] += 1
        return seq

    def completed(self, job: int) -> bool:
        """Whether every phase of ``job`` ran to its end: given, and if timed, published or out of attempts (a job
        of an aborted group that had finished before the abort keeps its figures)."""
        last: dict[int, dict[str, Any]] = {}
        for record in self.records:
            if record["job"] == job:
                last[record["phase"]] = record
        return all(
            phase in last
            and (not timed or self.gate.settled(last[phase]["load"]["published"], last[phase]["attempt"] + 1))
            for phase, timed in enumerate(self.jobs[job].timed)
        )

    def abort(self) -> None:
        """Stop giving phases and end every job at its next phase (when a job of the group failed, the others would
        otherwise wait for a phase that never comes)."""
        self.stop.set()
        self.join()
        for job in range(len(self.jobs)):
            self._give(job, {"end": True})

    def run(self) -> None:
        for job, phase in schedule(self.jobs):
            link, timed = self.jobs[job].links[phase], self.jobs[job].timed[phase]
            attempt = 0
            while True:
                if not self._wait_idle():
                    return
                if parse_rate(link) != self.net.rate:
                    self.net.reshape(link)
                if not timed:
                    seq = self._give(job, {"phase": phase})
                    self.records.append({"job": job, "phase": phase, "seq": seq, "attempt": attempt, "load": None})
                    break
                self.gate.quiet()
                with self.gate.phase() as load:
                    seq = self._give(job, {"phase": phase})
                    if not self._wait_idle():
                        return
                record = {"job": job, "phase": phase, "seq": seq, "attempt": attempt, "load": load.as_dict()}
                self.records.append(record)
                attempt += 1
                if self.gate.settled(load.published, attempt):
                    break
                self.gate.say(f"load gate: job {job} phase {phase} ({link}): {load.describe()}; again")
        if self._wait_idle():
            for job in range(len(self.jobs)):
                self._give(job, {"end": True})


def phases(folder: Path, rank: int, timeout: float) -> Iterator[tuple[int, int]]:
    """A rank's side: (seq, phase) for each phase the study gives this job, until it ends the job. Each phase waits
    at most ``timeout`` seconds to be given (a twin's whole phase, or the gate's wait, may come first)."""
    seq = 0
    while True:
        (folder / f"ready-{seq}-{rank}").touch()
        go, deadline = folder / f"go-{seq}", time.monotonic() + timeout
        while not go.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}: the study gave no phase {seq} within {timeout:.0f} s")
            time.sleep(POLL_S)
        order = json.loads(go.read_text())
        if order.get("end"):
            return
        yield seq, order["phase"]
        seq += 1


def kept(recorded: Sequence[dict[str, Any]], records: Sequence[dict[str, Any]], job: int) -> list[dict[str, Any]]:
    """Of what a rank ``recorded`` (a dict per phase it ran, with its ``seq``), the last attempt of each phase of
    ``job`` in phase order, each with the ``load`` and ``attempt`` of :attr:`PhaseRunner.records`, and the loads
    of the attempts set aside under ``set_aside``."""
    mine = [r for r in records if r["job"] == job]
    by_seq = {entry["seq"]: entry for entry in recorded}
    out = []
    for phase in sorted({r["phase"] for r in mine}):
        attempts = [r for r in mine if r["phase"] == phase]
        last = attempts[-1]
        aside = [r["load"] for r in attempts[:-1]]
        out.append(
            {
                **by_seq[last["seq"]],
                "phase": phase,
                "attempt": last["attempt"],
                "load": last["load"],
                "set_aside": aside,
            }
        )
    return out

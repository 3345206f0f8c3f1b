"""The load gate: a timed phase counts only when the machine was quiet around it.

Two figures describe a phase's load. The machine's 1-minute load average, read before and after the phase, is
what a reader knows; but a job of several ranks on a 2-core machine makes its own load (4 busy ranks hold it near
4), so it cannot tell whether anything *else* ran. :class:`ThreadSampler` therefore counts, a few times a second
from ``/proc``, the runnable threads that are not the job's own: own is this process and every process descended
from it (the ranks, their launchers and ``ip netns exec`` wrappers), foreign is everything else but kernel threads
(which mostly serve the job's own traffic). It keeps their mean over each phase and a running 1-minute average
shaped like the kernel's load average.

:class:`LoadGate` puts that to use: before a phase it waits until the foreign 1-minute average is at most
``limit`` (1.5 on 2 cores: 0.75 per core), and after it the phase is *published* only if the foreign threads'
mean during the phase stayed at most ``limit`` too; otherwise the caller waits and runs the phase again (see
:meth:`LoadGate.measure`). Every attempt's :class:`PhaseLoad` is kept with its result, published or not.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from .machine import cores, load_average

T = TypeVar("T")

LIMIT_PER_CORE = 0.75
"""The gate's default limit per core: a 1-minute load (or a phase's mean of foreign runnable threads) of 1.5 on the
2-core machine the studies were built on."""

KTHREADD = 2
"""The kernel threads' parent: they are neither the job's nor another user's work."""


def default_limit() -> float:
    """:data:`LIMIT_PER_CORE` times the cores this process may use."""
    return LIMIT_PER_CORE * cores()


@dataclasses.dataclass
class Census:
    """One look at ``/proc``: the runnable threads of this process's tree (``own``) and of everything else
    (``foreign``), and the foreign processes' names, one entry per runnable thread."""

    own: int
    foreign: int
    foreign_names: list[str]


def _stat_fields(text: str) -> tuple[str, str, list[str]]:
    """(name, state, the fields after the state) of a ``/proc/.../stat`` line; the name may hold spaces and
    parentheses, so it is cut at the last ``)``."""
    head, _, tail = text.rpartition(")")
    fields = tail.split()
    return head.partition("(")[2], fields[0], fields[1:]


def census(root: int, proc: Path = Path("/proc")) -> Census:
    """Count the runnable threads under ``proc``: those of process ``root`` and its descendants, and the rest
    (kernel threads left out)."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    running: dict[int, int] = collections.Counter()
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        with contextlib.suppress(OSError):  # processes end while they are read
            for task in os.scandir(f"{entry.path}/task"):
                name, state, rest = _stat_fields(Path(task.path, "stat").read_text())
                parents[pid] = int(rest[0])
                if task.name == entry.name:  # the process's name is its first thread's
                    names[pid] = name
                running[pid] += state == "R"
    own_pids = {root}
    grew = True
    while grew:  # descendants: a few passes over the parent map (process trees are shallow)
        size = len(own_pids)
        own_pids |= {pid for pid, parent in parents.items() if parent in own_pids}
        grew = len(own_pids) > size
    own = foreign = 0
    foreign_names: list[str] = []
    for pid, count in running.items():
        if not count:
            continue
        if pid in own_pids:
            own += count
        elif pid != KTHREADD and parents.get(pid) != KTHREADD:
            foreign += count
            foreign_names += [names.get(pid, str(pid))] * count
    return Census(own, foreign, foreign_names)


@dataclasses.dataclass
class PhaseLoad:
    """The load around one phase: the machine's 1-minute load average before and after; the foreign runnable
    threads' 1-minute average before, their mean and largest count during the phase, over ``samples`` looks;
    the foreign processes seen running most often; the gate's ``limit`` and whether the phase is ``published``."""

    load_before: float
    foreign_before: float
    limit: float
    load_after: float = math.nan
    foreign_mean: float = math.nan
    foreign_max: int = 0
    samples: int = 0
    foreign_top: list[tuple[str, int]] = dataclasses.field(default_factory=list)
    published: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The record as JSON-ready values, rounded."""
        out = dataclasses.asdict(self)
        for key in ("load_before", "load_after", "foreign_before", "foreign_mean"):
            out[key] = None if math.isnan(out[key]) else round(out[key], 2)
        out["foreign_top"] = [list(item) for item in self.foreign_top]
        return out

    def describe(self) -> str:
        """One line: the loads and the verdict."""
        verdict = "published" if self.published else f"not published (limit {self.limit:g})"
        return (
            f"load {self.load_before:.2f} -> {self.load_after:.2f}, foreign threads {self.foreign_before:.2f} before,"
            f" {self.foreign_mean:.2f} mean / {self.foreign_max} max during: {verdict}"
        )


class ThreadSampler(threading.Thread):
    """Looks at ``/proc`` every ``interval`` seconds in the background (see the module docstring): the foreign
    runnable threads' 1-minute average (:attr:`foreign_average`, started from the machine's 1-minute load) and,
    between :meth:`begin` and :meth:`end`, every look's counts."""

    def __init__(self, interval: float = 0.5, root: int | None = None, proc: Path = Path("/proc")) -> None:
        super().__init__(daemon=True, name="load-sampler")
        self.interval, self.root, self.proc = interval, os.getpid() if root is None else root, proc
        self.foreign_average = load_average()[0]
        self._decay = math.exp(-interval / 60.0)
        self._phase: list[Census] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def sample(self) -> Census:
        """Take one look now; fold it into the average and the phase under way."""
        seen = census(self.root, self.proc)
        with self._lock:
            self.foreign_average = self._decay * self.foreign_average + (1 - self._decay) * seen.foreign
            if self._phase is not None:
                self._phase.append(seen)
        return seen

    def begin(self) -> None:
        """Start keeping the looks of a phase."""
        with self._lock:
            self._phase = []

    def end(self) -> list[Census]:
        """Stop keeping the phase's looks; return them."""
        with self._lock:
            looks, self._phase = self._phase or [], None
        return looks

    def close(self) -> None:
        """Stop the background looks."""
        self._stop.set()


class LoadGate:
    """Waits for a quiet machine before each phase and judges each phase by its load (the module docstring).

    ``limit``: the largest foreign load a published phase may meet (default :func:`default_limit`); ``wait_s``:
    how long :meth:`quiet` waits before it lets a phase run anyway (it will not be published); ``attempts``:
    how often :meth:`measure` runs a phase that met too much load; ``say``: where waiting is reported.
    """

    def __init__(
        self,
        limit: float | None = None,
        wait_s: float = 1800.0,
        attempts: int = 3,
        sampler: ThreadSampler | None = None,
        say: Callable[[str], None] = print,
    ) -> None:
        self.limit = default_limit() if limit is None else float(limit)
        self.wait_s, self.attempts, self.say = wait_s, attempts, say
        self.sampler = sampler or ThreadSampler()
        if not self.sampler.is_alive() and sampler is None:
            self.sampler.start()

    def quiet(self) -> None:
        """Wait until the foreign threads' 1-minute average is at most the limit (or ``wait_s`` has passed)."""
        deadline, told = time.monotonic() + self.wait_s, False
        while self.sampler.foreign_average > self.limit and time.monotonic() < deadline:
            if not told:
                self.say(
                    f"load gate: {self.sampler.foreign_average:.2f} foreign threads (limit {self.limit:g}): waiting"
                )
                told = True
            time.sleep(max(self.sampler.interval, 1.0))

    @contextlib.contextmanager
    def phase(self) -> Iterator[PhaseLoad]:
        """Around one phase: record the loads before, keep the sampler's looks during it, and on leaving fill in
        the loads after and the verdict of the :class:`PhaseLoad` it yields. It does not wait (see :meth:`quiet`)."""
        record = PhaseLoad(load_average()[0], self.sampler.foreign_average, self.limit)
        self.sampler.begin()
        try:
            yield record
        finally:
            looks = self.sampler.end() or [self.sampler.sample()]
            record.load_after = load_average()[0]
            record.samples = len(looks)
            record.foreign_mean = sum(look.foreign for look in looks) / len(looks)
            record.foreign_max = max(look.foreign for look in looks)
            names = collections.Counter(name for look in looks for name in look.foreign_names)
            record.foreign_top = names.most_common(3)
            record.published = record.foreign_before <= self.limit and record.foreign_mean <= self.limit

    def settled(self, published: bool, attempts_made: int) -> bool:
        """Whether a phase is run no more: its last attempt was published, or it had its ``attempts``."""
        return published or attempts_made >= self.attempts

    def measure(self, run: Callable[[], T], label: str = "phase") -> tuple[T, PhaseLoad, list[PhaseLoad]]:
        """Run ``run`` once the machine is quiet, again (up to ``attempts`` times) while its load keeps it from being
        published; return the last result, its load, and the loads of the attempts set aside."""
        rejected: list[PhaseLoad] = []
        while True:
            self.quiet()
            with self.phase() as load:
                result = run()
            if self.settled(load.published, len(rejected) + 1):
                return result, load, rejected
            rejected.append(load)
            self.say(f"load gate: {label}: {load.describe()}; again")

    def close(self) -> None:
        """Stop the sampler."""
        self.sampler.close()

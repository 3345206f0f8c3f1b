"""Multi-process test jobs as tables of scenarios, run once per test session.

A worker module (``<concept>_workers_<front end>.py``) registers its rank bodies with a
:class:`Registry` and runs the scenarios a job names with :meth:`Registry.run`; its test module
describes its jobs as :class:`Job` values in a :class:`JobTable`, which starts the ranks through
``multiprocess.run_ranks`` (one job per configuration, several scenarios each), caches the
results for the session and skips MPI jobs where there is no MPI. A scenario is a name and its
options as Python values (pickled to the ranks); its result is keyed by :attr:`Scenario.label`.
"""

from __future__ import annotations

import inspect
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Scenario:
    """A rank body ``name`` registered by the worker module, called with ``options``."""

    name: str
    options: dict[str, Any] = field(default_factory=dict, hash=False)

    @property
    def label(self) -> str:
        """The key of its result and its test id: ``name`` or ``name(key=value, ...)``."""
        if not self.options:
            return self.name
        return f"{self.name}({', '.join(f'{k}={v!r}' for k, v in self.options.items())})"

    def __str__(self) -> str:
        return self.label


class Registry:
    """The scenarios of one worker module, by function name."""

    def __init__(self) -> None:
        self._bodies: dict[str, Callable[..., Any]] = {}

    def __call__(self, body: Callable[..., Any]) -> Callable[..., Any]:
        """Register ``body`` (a decorator) under its name."""
        self._bodies[body.__name__] = body
        return body

    def run(self, scenarios: list[Scenario], **context: Any) -> dict[str, Any]:
        """Run each scenario in order; ``{label: result}`` plus ``"timings"`` (seconds per label).

        Each body gets its options and, of ``context`` (``seed``, ``rank``, ``group``...), the
        names its signature asks for.
        """
        out: dict[str, Any] = {"timings": {}}
        for scenario in scenarios:
            body = self._bodies.get(scenario.name)
            if body is None:
                raise ValueError(f"unknown scenario {scenario.name!r}; registered: {sorted(self._bodies)}")
            wanted = inspect.signature(body).parameters
            start = time.perf_counter()
            out[scenario.label] = body(**{k: v for k, v in context.items() if k in wanted}, **scenario.options)
            out["timings"][scenario.label] = time.perf_counter() - start
        return out


def raised(call: Callable[[], Any]) -> str:
    """What ``call()`` raised, as ``"Type: message"`` for a test to check, or ``"no error"``."""
    try:
        call()
    except Exception as error:  # noqa: BLE001 (reported to the test)
        return f"{type(error).__name__}: {error}"
    return "no error"


@dataclass(frozen=True)
class Job:
    """One multi-process run: ``ranks`` processes started by ``launcher``, running ``scenarios``;
    ``local_world_size`` lays the ranks out as nodes of that many ranks; ``env`` adds to their environment."""

    ranks: int
    launcher: Literal["python", "mpiexec"]
    scenarios: tuple[Scenario, ...]
    local_world_size: int | None = None
    env: dict[str, str] = field(default_factory=dict, hash=False)


def has_mpi(build_info: dict[str, Any]) -> bool:
    """Whether jobs under mpiexec can run: the native engine was built with MPI (``build_info``
    of the front end) and an mpiexec is beside this interpreter or on PATH."""
    from multiprocess import has_mpiexec

    return bool(build_info.get("mpi")) and has_mpiexec()


class JobTable:
    """The jobs of one test module, run by ``worker`` (``"module:function"``, called on each rank
    with ``(seed, scenarios, local_world_size)``) once per session each."""

    def __init__(self, worker: str, jobs: dict[str, Job], mpi: bool, timeout: float = 300.0) -> None:
        self.worker, self.jobs, self.mpi, self.timeout = worker, jobs, mpi, timeout
        self._results: dict[str, tuple[int, list[dict[str, Any]]]] = {}
        self._failures: dict[str, str] = {}  # a failed job is not run again for each test that reads it

    def run(self, name: str) -> tuple[int, list[dict[str, Any]]]:
        """Job ``name``'s seed and its ranks' results (sorted by rank), run on first use; skips
        the test when the job needs MPI and there is none. Once the job has failed, later tests
        fail at once with the end of its report."""
        import numpy as np
        import pytest
        from conftest import SEED
        from multiprocess import run_ranks

        if name in self._failures:
            pytest.fail(f"job {name!r} failed in an earlier test of this session:\n{self._failures[name]}")
        if name not in self._results:
            job = self.jobs[name]
            if job.launcher == "mpiexec" and not self.mpi:
                pytest.skip("built without the MPI engine, or no mpiexec")
            # The session's seed (BAGUA_TEST_SEED in the report header) reproduces every job's data.
            seed = int(np.random.default_rng([SEED, zlib.crc32(f"{self.worker}:{name}".encode())]).integers(2**20))
            try:
                results = run_ranks(
                    self.worker,
                    job.ranks,
                    seed,
                    list(job.scenarios),
                    job.local_world_size,
                    launcher=job.launcher,
                    timeout=self.timeout,
                    env=job.env,
                )
            except Exception as error:
                self._failures[name] = str(error)[-4000:]
                raise
            self._results[name] = (seed, sorted((r.value for r in results), key=lambda v: v["rank"]))
        return self._results[name]

    def _pairs(self, scenario: str | Scenario) -> list[tuple[str, Scenario]]:
        return [
            (name, s) for name, job in self.jobs.items() for s in job.scenarios if s == scenario or s.name == scenario
        ]

    def cases(self, scenario: str | Scenario) -> list[Any]:
        """For ``pytest.mark.parametrize("name,scenario", ...)``: every (job name, scenario) pair
        whose scenario is ``scenario`` or is called so, with the test id ``name-label``."""
        import pytest

        return [pytest.param(name, s, id=f"{name}-{s.label}") for name, s in self._pairs(scenario)]

    def jobs_with(self, scenario: str | Scenario) -> list[str]:
        """The jobs that run ``scenario`` (or a scenario called so)."""
        return list(dict.fromkeys(name for name, _ in self._pairs(scenario)))

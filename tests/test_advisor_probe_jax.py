"""The advisor's probe: each topology level's latency (ping-pong) and bandwidth (allreduce sweep).

Against known answers, with fake communicators whose calls advance a fake clock by an injected
latency plus bytes over an injected bandwidth, different on every level; and live, on a loopback
job of 2 ranks and of 4 ranks grouped as 2 nodes of 2, where the numbers are unknown but must be finite and
positive and every level and each codec's kernel throughput must be in the table.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import io_callback

import bagua_jax.advisor as advisor
from bagua_common.tuning.advisor import INTER, INTRA, WORLD, Link, NoisyTimings
from bagua_jax.algorithms.base import Communicators

ROOT = Path(__file__).resolve().parent.parent


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class FakeLevel:
    """A level of ``size`` ranks seen from rank ``rank``: each allreduce takes ``allreduce_latency_s`` plus the
    ring's ``2 (n-1)/n`` of the bytes over the bandwidth, each exchange ``link.latency_s`` plus its bytes."""

    def __init__(self, clock: FakeClock, size: int, rank: int, link: Link, allreduce_latency_s: float) -> None:
        self.clock, self.size, self._rank, self.link = clock, size, rank, link
        self.allreduce_latency_s = allreduce_latency_s

    def rank(self) -> jax.Array:
        return jnp.int32(self._rank)

    def _after(self, seconds: float, result: np.ndarray) -> np.ndarray:
        self.clock.now += seconds
        return result

    def allreduce(self, x: jax.Array, op: str = "sum") -> jax.Array:
        seconds = self.allreduce_latency_s + 2 * (self.size - 1) / self.size * x.nbytes / self.link.bytes_per_s
        return io_callback(lambda v: self._after(seconds, np.asarray(v)), jax.ShapeDtypeStruct(x.shape, x.dtype), x)

    def send_recv(self, x: jax.Array, peers: jax.Array) -> jax.Array:
        seconds = self.link.latency_s + x.nbytes / self.link.bytes_per_s
        shape = jax.ShapeDtypeStruct((peers.shape[0], *x.shape), x.dtype)
        return io_callback(lambda v: self._after(seconds, np.stack([np.asarray(v)] * shape.shape[0])), shape, x)


def test_probe_recovers_each_levels_injected_latency_and_bandwidth(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(advisor, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    injected = {WORLD: Link(40e-6, 2e9), INTRA: Link(3e-6, 2e10), INTER: Link(150e-6, 1.25e8)}
    comms = Communicators(
        world=FakeLevel(clock, 8, 5, injected[WORLD], 500e-6),
        intra=FakeLevel(clock, 4, 1, injected[INTRA], 20e-6),
        inter=FakeLevel(clock, 2, 1, injected[INTER], 900e-6),
    )
    measured = advisor.probe(comms, repeats=3, round_trips=4)
    assert list(measured) == [WORLD, INTRA, INTER]
    for level, link in injected.items():
        # The ping-pong message's own bytes add a few nanoseconds: within 1%.
        assert measured[level].latency_s == pytest.approx(link.latency_s, rel=1e-2), level
        assert measured[level].bytes_per_s == pytest.approx(link.bytes_per_s, rel=1e-6), level


def test_probe_of_a_flat_job_has_the_world_level_alone(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(advisor, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    measured = advisor.probe(Communicators(FakeLevel(clock, 2, 0, Link(10e-6, 1e9), 50e-6)), repeats=2, round_trips=2)
    assert list(measured) == [WORLD]
    assert measured[WORLD].latency_s == pytest.approx(10e-6, rel=1e-2)


class LoadedLevel(FakeLevel):
    """A level whose first ``noisy_sweeps`` allreduce sweeps meet a burst of load: every allreduce under 1 MiB
    takes 0.1 s more, so time seems to fall with size. A sweep ends at the ranks' agreement on the timings
    (the allreduce with op ``max``)."""

    def __init__(self, *args, noisy_sweeps: int) -> None:
        super().__init__(*args)
        self.noisy_sweeps = noisy_sweeps
        self.sweeps = 0

    def allreduce(self, x: jax.Array, op: str = "sum") -> jax.Array:
        def at_run_time(v):
            if op == "max":
                self.sweeps += 1
            elif self.sweeps < self.noisy_sweeps and x.nbytes < 2**20:
                self.clock.now += 0.1
            return np.asarray(v)

        x = io_callback(at_run_time, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
        return super().allreduce(x, op)


def test_probe_sweeps_again_when_load_hides_the_bandwidth_and_fails_clearly_when_it_never_shows(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(advisor, "time", SimpleNamespace(perf_counter=clock.perf_counter))
    level = LoadedLevel(clock, 2, 0, Link(10e-6, 1e9), 50e-6, noisy_sweeps=1)
    measured = advisor.probe(Communicators(level), repeats=2, round_trips=2)
    assert level.sweeps == 2
    assert measured[WORLD].bytes_per_s == pytest.approx(1e9, rel=1e-6)
    always_loaded = LoadedLevel(clock, 2, 0, Link(10e-6, 1e9), 50e-6, noisy_sweeps=99)
    with pytest.raises(NoisyTimings, match="does not grow with size"):
        advisor.probe(Communicators(always_loaded), repeats=2, round_trips=2)
    assert always_loaded.sweeps == 3


def test_probe_refuses_a_level_of_one_rank():
    with pytest.raises(ValueError, match="at least 2 ranks"):
        advisor.probe(Communicators(FakeLevel(FakeClock(), 1, 0, Link(1e-6, 1e9), 1e-6)))


class SplittableWorld:
    def __init__(self, size: int, rank: int) -> None:
        self.size, self._rank, self.splits = size, rank, []

    def rank(self) -> jax.Array:
        return jnp.int32(self._rank)

    def split(self, color: int, key: int, name: str) -> tuple[int, int]:
        self.splits.append((color, key))
        return color, key


def test_job_communicators_group_ranks_into_nodes_as_the_launcher_places_them():
    world = SplittableWorld(6, 4)  # 3 nodes of 2: rank 4 is local rank 0 of node 2
    comms = advisor.job_communicators(world, 2)
    assert comms.intra == (2, 0) and comms.inter == (0, 2)
    assert not advisor.job_communicators(SplittableWorld(6, 4), 6).hierarchical
    assert not advisor.job_communicators(SplittableWorld(6, 4), 1).hierarchical
    with pytest.raises(ValueError, match="do not divide"):
        advisor.job_communicators(SplittableWorld(6, 4), 4)
    with pytest.raises(ValueError, match="at least 1"):
        advisor.job_communicators(SplittableWorld(6, 4), 0)


@pytest.mark.parametrize(
    ("ranks", "layout", "levels", "ranked"),
    [
        (2, [], {WORLD}, set(advisor.CANDIDATES)),
        (4, ["--ranks-per-node", "2"], {WORLD, INTRA, INTER}, {*advisor.CANDIDATES, *advisor.HIERARCHICAL_CANDIDATES}),
    ],
    ids=["flat-2-ranks", "2-nodes-of-2"],
)
def test_the_command_line_probes_every_level_of_a_loopback_job(ranks, layout, levels, ranked):
    run = subprocess.run(
        [sys.executable, "-m", "bagua_launch", "--nproc-per-node", str(ranks), "--mpi", "-m", "bagua_jax.advisor"]
        + ["--params", "20000", *layout],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = {}
    for line in run.stdout.splitlines():
        words = line.split()  # "[rank 0] intra 4.22 188": level, Gbit/s, one-way latency in us
        if len(words) == 5 and words[2] in (WORLD, INTRA, INTER):
            rows[words[2]] = (float(words[3]), float(words[4]))
    assert set(rows) == levels, run.stdout
    for level, (gbit_s, latency_us) in rows.items():
        assert math.isfinite(gbit_s) and gbit_s > 0 and math.isfinite(latency_us) and latency_us > 0, (level, rows)
    codecs = {}
    for line in run.stdout.splitlines():
        words = line.split()  # "[rank 0] codec minmax: 21.7 GB/s coded"
        if len(words) > 4 and words[2] == "codec":
            codecs[words[3].rstrip(":")] = float(words[4])
    assert set(codecs) == {"minmax", "sign"}, run.stdout
    assert all(math.isfinite(rate) and rate > 0 for rate in codecs.values()), codecs
    assert {line.split()[2] for line in run.stdout.splitlines() if line.endswith("x")} == ranked, run.stdout

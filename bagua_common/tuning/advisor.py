"""The advisor: which algorithm fits this network, predicted from measured links and traffic.

A step's time is modelled as compute, plus for every message a latency and its bytes over the
bandwidth of the topology level it travels on (``world``; and ``intra``, the ranks of one node,
and ``inter``, across nodes, when the job has two levels), plus the bytes each codec's compression
kernels code at that codec's measured throughput. Algorithms that average in the background
(asynchronous model averaging) keep communication off the step, so their step is compute alone.
Each level's link comes from :func:`level_link`: the latency from a ping-pong between neighbouring
ranks, the bandwidth from :func:`fit_link` over allreduces of several sizes (each front end times
them on the run's own communicators); the traffic from counting what each algorithm sends on each
level in one step and the bytes its kernels code. The advisor ranks; it never switches the
algorithm itself, because every algorithm but gradient allreduce changes the numbers.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bagua_common.comm.topology import Communicators

BASELINE = "gradient_allreduce"
WORLD, INTRA, INTER = "world", "intra", "inter"


@dataclasses.dataclass(frozen=True)
class Link:
    """One topology level's link: ``latency_s`` per message and ``bytes_per_s`` of bandwidth."""

    latency_s: float
    bytes_per_s: float

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(f"link latency must be a finite number of seconds >= 0, got {self.latency_s!r}")
        if not (self.bytes_per_s > 0):
            raise ValueError(f"link bandwidth must be > 0 bytes per second, got {self.bytes_per_s!r}")


Topology = Mapping[str, Link]
"""Each topology level's measured link, by level name: :data:`WORLD`, and :data:`INTRA` and :data:`INTER`
when the job has two levels."""

CodecThroughput = Mapping[str, float]
"""Each codec's measured kernel throughput, by codec name (``minmax``, ``sign``): coded bytes per second, the
bytes counted as :attr:`Traffic.codec_bytes` counts them."""


@dataclasses.dataclass(frozen=True)
class Wire:
    """What one step puts on one topology level, per rank: ``bytes_sent`` in ``messages`` collectives; ``by_op``
    splits them by collective (``allreduce``, ``alltoall``, ...) into (calls, bytes sent), for a cost model that
    prices each collective by its own algorithm (ring, tree, all-to-all)."""

    bytes_sent: float
    messages: int
    by_op: Mapping[str, tuple[int, float]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What one steady-state step of an algorithm costs besides compute, per rank.

    ``wire`` maps each topology level the algorithm communicates on to what it sends there;
    ``codec_bytes`` maps each codec the step uses to the bytes its kernels code: the float bytes
    a compression encodes plus those a decompression decodes; ``blocking`` is False when the
    communication runs beside the step (asynchronous averaging).
    """

    wire: Mapping[str, Wire]
    codec_bytes: Mapping[str, float] = dataclasses.field(default_factory=dict)
    blocking: bool = True

    @property
    def bytes_sent(self) -> float:
        """Bytes sent per step over all levels."""
        return sum(w.bytes_sent for w in self.wire.values())

    @property
    def messages(self) -> int:
        """Messages per step over all levels."""
        return sum(w.messages for w in self.wire.values())


@dataclasses.dataclass(frozen=True)
class Prediction:
    """An algorithm's predicted step time and its speed-up over the baseline (gradient allreduce)."""

    algorithm: str
    step_s: float
    speedup: float


class NoisyTimings(ValueError):
    """Collective timings in which time does not grow with size: too noisy to fit a bandwidth."""


def fit_link(sizes: Sequence[float], seconds: Sequence[float]) -> Link:
    """The link that best explains collective timings: least squares of ``seconds = latency + size / bandwidth``.

    ``sizes`` are the bytes each timed collective put on this rank's link (at least two distinct
    sizes). A fitted negative latency (noise at small sizes) is clamped to zero.
    """
    x = np.asarray(sizes, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or len(np.unique(x)) < 2:
        raise ValueError("fit_link needs matching 1-d sizes and seconds with at least two distinct sizes")
    slope, intercept = np.polyfit(x, y, 1)
    if slope <= 0:
        raise NoisyTimings(f"fit_link: time does not grow with size (slope {slope:.3g} s/byte): timings too noisy")
    return Link(latency_s=max(float(intercept), 0.0), bytes_per_s=float(1.0 / slope))


def level_link(round_trips_s: Sequence[float], sizes: Sequence[float], seconds: Sequence[float]) -> Link:
    """One level's link: the latency is half the median ping-pong round trip, the bandwidth the slope of
    :func:`fit_link` over the allreduce timings ``seconds`` of ``sizes`` bytes on this rank's link.

    The allreduce fit's intercept is not the latency: it counts the ``2 (n-1)`` ring steps and the
    dispatch of a collective, where the ping-pong times one message.
    """
    if len(round_trips_s) == 0:
        raise ValueError("level_link needs at least one ping-pong round trip")
    return Link(latency_s=float(np.median(round_trips_s)) / 2, bytes_per_s=fit_link(sizes, seconds).bytes_per_s)


def topology_levels(comms: Communicators) -> dict[str, Any]:
    """The communicator of each topology level of ``comms``: world, and intra and inter when both are set."""
    if comms.hierarchical:
        return {WORLD: comms.world, INTRA: comms.intra, INTER: comms.inter}
    return {WORLD: comms.world}


def predict_step_s(traffic: Traffic, topology: Topology, compute_s: float, codec_bytes_per_s: CodecThroughput) -> float:
    """The predicted wall time of one step of an algorithm with ``traffic``: each level's wire on its link, each
    codec's bytes at its throughput."""
    if not traffic.blocking:
        return compute_s
    unmeasured = sorted(set(traffic.wire) - set(topology))
    if unmeasured:
        raise ValueError(f"traffic on levels {unmeasured} but no link measured for them (have {sorted(topology)})")
    untimed = sorted(set(traffic.codec_bytes) - set(codec_bytes_per_s))
    if untimed:
        raise ValueError(
            f"codec bytes of {untimed} but no throughput measured for them (have {sorted(codec_bytes_per_s)})"
        )
    wire = sum(
        w.messages * topology[level].latency_s + w.bytes_sent / topology[level].bytes_per_s
        for level, w in traffic.wire.items()
    )
    codec = sum(coded / codec_bytes_per_s[name] for name, coded in traffic.codec_bytes.items())
    return compute_s + wire + codec


def rank_algorithms(
    traffic: Mapping[str, Traffic], topology: Topology, compute_s: float, codec_bytes_per_s: CodecThroughput
) -> list[Prediction]:
    """Every algorithm's predicted step time, fastest first, with its speed-up over gradient allreduce."""
    if BASELINE not in traffic:
        raise ValueError(f"rank_algorithms needs the baseline {BASELINE!r} among the algorithms")
    times = {name: predict_step_s(t, topology, compute_s, codec_bytes_per_s) for name, t in traffic.items()}
    base = times[BASELINE]
    return sorted((Prediction(name, s, base / s) for name, s in times.items()), key=lambda p: p.step_s)


def format_ranking(
    predictions: Sequence[Prediction], topology: Topology, compute_s: float, codec_bytes_per_s: CodecThroughput
) -> str:
    """The ranking as a table a user reads: each level's link, each codec's throughput, then predicted step time
    and speed-up."""
    lines = [f"{'level':<8}{'Gbit/s':>10}{'latency (us)':>14}   (latency: ping-pong; bandwidth: allreduce sweep)"]
    lines += [
        f"{level:<8}{link.bytes_per_s * 8 / 1e9:>10.3g}{link.latency_s * 1e6:>14.3g}"
        for level, link in topology.items()
    ]
    lines += [f"codec {name}: {rate / 1e9:.3g} GB/s coded" for name, rate in codec_bytes_per_s.items()]
    lines += [
        f"compute {compute_s * 1e3:.1f} ms per step",
        f"{'algorithm':<42}{'step (ms)':>12}{'speed-up':>10}",
    ]
    lines += [f"{p.algorithm:<42}{p.step_s * 1e3:>12.1f}{p.speedup:>9.2f}x" for p in predictions]
    lines.append("async averages in the background: its step is compute alone, its replicas drift between rounds.")
    lines.append(
        "Predicted, not measured: every algorithm but gradient_allreduce changes the numbers; check convergence."
    )
    return "\n".join(lines)


def kendall_tau(x: Sequence[float], y: Sequence[float]) -> float:
    """Kendall's tau-b between two orderings of the same items (ties in either count for neither side)."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError("kendall_tau needs two sequences of the same length, at least 2")
    concordant = discordant = ties_x = ties_y = 0
    for i, j in itertools.combinations(range(len(x)), 2):
        dx, dy = x[i] - x[j], y[i] - y[j]
        if dx == 0 and dy == 0:
            continue
        if dx == 0:
            ties_x += 1
        elif dy == 0:
            ties_y += 1
        elif (dx > 0) == (dy > 0):
            concordant += 1
        else:
            discordant += 1
    denominator = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denominator if denominator else 0.0

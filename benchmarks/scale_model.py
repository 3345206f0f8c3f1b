"""The scale model: each algorithm's step on 8 to 1024 ranks, from what was measured on 2 and 4.

An alpha-beta model of one data-parallel step, per rank:

* **compute**: the measured single-rank step of the workload (``benchmarks/results/single-rank-step.json``, one
  process with no communication); where ``n`` ranks share ``c`` cores (the 2-core machine the points were
  measured on), times ``max(1, n / c)``;
* **each collective** the algorithm's step issues, with the bytes its interface puts on the wire: counted once by
  tracing a step of every algorithm on 8 ranks (``bagua_jax.advisor.algorithm_traffic`` over a counting
  communicator, ``--count``; kept in ``scale-model-traffic.json``) and carried to ``n`` ranks as each collective's
  cost model carries them. With ``alpha`` the link's latency and ``beta`` its bandwidth in bytes/s, for a payload
  of ``B`` bytes: allreduce the faster of a ring, ``2 (n-1) (alpha + B / (n beta))``, and a tree,
  ``2 ceil(log2 n) alpha + 2 B / beta``; allgather and reduce-scatter the faster of a ring,
  ``(n-1) (alpha + B / (n beta))``, and recursive doubling, ``ceil(log2 n) alpha + (n-1)/n B / beta``; all-to-all
  the faster of a pairwise exchange, ``(n-1) alpha + (n-1)/n B / beta``, and Bruck's,
  ``ceil(log2 n) (alpha + B / (2 beta))``; a point-to-point exchange ``alpha + p B / beta`` to ``p`` peers;
  broadcast and reduce a pipelined tree, ``ceil(log2 n) alpha + B / beta`` (the choices MPI libraries make by size);
* **the compression kernels**: the float bytes the step codes (counted in the same trace) at the kernels' measured
  throughput (``kernels-cpu.json``, GB/s at 4 and 16 MiB);
* asynchronous averaging keeps communication off the step (compute only); DiLoCo exchanges once every ``H`` steps
  (its exchange over ``H``), Streaming DiLoCo a fragment every ``H/P`` steps, hidden behind ``tau`` steps of
  compute where it overlaps.

**Calibration and validation.** The measured points (the network study's MLP and the LM study's GPT, 2 and 4
ranks, links of 100 Mbit/s to unshaped) ran over TCP in network namespaces, whose per-message cost and unshaped
bandwidth nobody set: per front end (gloo / MPI) the model fits ``alpha`` and the unshaped ``beta`` on the 2-rank
points of the network study (shaped links: ``beta`` is the tbf rate less the headers' share, measured from the
study's own byte counts) and is then judged on every point, 2 and 4 ranks, both studies; the table gives each
point's error and which points the fit saw.

**Time to a target.** The steps each algorithm needed in the LM study's 4000-step run (``lm-study-4000-steps.json``,
the ``mini`` GPT) to reach its target (a): DDP fp32's held-out loss at 80% of its budget; times its predicted time
per step (QAdam's, 1-bit Adam's and PowerSGD's uncompressed first steps at gradient allreduce's), assuming that the
steps to the target do not change with the rank count (the global batch held fixed). Asynchronous averaging, which
trains at the link rather than in steps of a fixed cost, is judged on the LM study's page by its own clock.

**Which algorithm to pick.** For 8 to 1024 ranks, links of 1 to 400 Gbit/s and latencies of 0.1 to 100 ms: the
algorithm with the shortest predicted time to the target, with its speed-up over gradient allreduce; a table and a
chart. ``--params N --compute-ms T`` answers it for another model (traffic scaled from the GPT's by its size).

    python benchmarks/scale_model.py --count        # count each algorithm's traffic (traced, 8 CPU devices)
    python benchmarks/scale_model.py                # calibrate, validate, recommend: scale-model.{md,json,png}
    python benchmarks/scale_model.py --params 125e6 --compute-ms 300 --ranks 64 --gbits 10 --latency-ms 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import lm_study_report  # noqa: E402
import network_study  # noqa: E402
from harness import plots, results  # noqa: E402
from harness.links import parse_rate  # noqa: E402
from harness.repeats import spread  # noqa: E402

TRAFFIC = results.RESULTS / "scale-model-traffic.json"
COUNTED_RANKS = 8
CORES = 2  # the cores of the machine the measured points ran on

ALGORITHMS: dict[str, tuple[str, dict[str, Any]]] = {
    "gradient_allreduce": ("gradient_allreduce", {}),
    "bytegrad": ("bytegrad", {}),
    "decentralized": ("decentralized", {}),
    "decentralized_shift_one": ("decentralized", {"peer_selection_mode": "shift_one"}),
    "low_precision_decentralized": ("low_precision_decentralized", {}),
    "qadam": ("qadam", {}),
    "onebit_adam": ("onebit_adam", {}),
    "async": ("async", {}),
    "powersgd_rank1": ("powersgd", {"rank": 1}),
    "powersgd_rank4": ("powersgd", {"rank": 4}),
    "diloco_fp32": ("diloco", {"sync_every": 1, "outer_exchange": "fp32"}),
    "diloco_uint8": ("diloco", {"sync_every": 1, "outer_exchange": "uint8"}),
    "diloco_uint4": ("diloco", {"sync_every": 1, "outer_exchange": "uint4"}),
}
"""What is counted: each algorithm of the model by name, as the registry builds it (DiLoCo: one exchange)."""
LM_STUDY = "lm-study-4000-steps"
"""The LM study whose timings the model is judged on and whose curves give the steps to the target."""
GPT = "gpt-mini"
"""The LM study's model, for which the recommendation is made."""
WORKLOADS = ("mlp", GPT)
LOCAL_STEPS = ("async", "diloco")
"""Algorithms whose steps are local steps (averaging in the background, or every H steps): judged by the time to the
target only, since a local step and a synchronous one do not make the same progress."""

RECOMMEND_RANKS = (8, 32, 128, 1024)
RECOMMEND_GBITS = (1, 10, 100, 400)
RECOMMEND_LATENCY_MS = (0.1, 1, 10, 100)
RECOMMENDED = (
    "gradient_allreduce",
    "bytegrad",
    "decentralized",
    "low_precision_decentralized",
    "qadam",
    "onebit_adam",
    "powersgd",
    "diloco",
    "diloco_h20_uint8",
    "streaming_p4_h20_uint4",
)
"""The candidates of the recommendation: the LM study's torch variants of Bagua's algorithms by their labels (each
needs the steps it took to the target there)."""


# ------------------------------------------------------------------ traffic: counted once, carried to n ranks


def count(workload: str) -> dict[str, Any]:
    """Trace one step of every algorithm of :data:`ALGORITHMS` on :data:`COUNTED_RANKS` CPU devices: per algorithm
    the calls and bytes of each collective, the bytes each codec codes, whether the step waits for them."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh

    from bagua_jax import LaxCommunicator
    from bagua_jax.advisor import algorithm_traffic

    width, layers, image_size = network_study.MODELS.get(workload, (0, 0, 0))
    arrays = network_study.synthetic.init_params(workload, image_size, width, layers)
    params = [jax.ShapeDtypeStruct(a.shape, jnp.float32) for a in arrays]
    mesh = Mesh(np.array(jax.devices()[:COUNTED_RANKS]), ("ranks",))
    comm = LaxCommunicator("ranks", COUNTED_RANKS)
    out = {"parameters": int(sum(a.size for a in arrays)), "ranks": COUNTED_RANKS, "algorithms": {}}
    for name, (algorithm, options) in ALGORITHMS.items():
        traffic = algorithm_traffic(algorithm, options, params, comm, mesh=mesh)
        wire = traffic.wire.get("world")
        out["algorithms"][name] = {
            "by_op": {op: list(counts) for op, counts in (wire.by_op if wire else {}).items()},
            "codec_bytes": dict(traffic.codec_bytes),
            "blocking": traffic.blocking,
        }
    return out


def _ring_share(n: int) -> float:
    return (n - 1) / n


def _ring_peers(n: int) -> float:
    from bagua_common.comm.topology import ring_neighbours

    return float(len(set(ring_neighbours(0, n))))


RING_PEERS = ("low_precision_decentralized",)
"""Algorithms whose point-to-point exchange goes to the ring neighbours: one peer on 2 ranks, two from 3 (their
exchange is priced as ``send_recv_ring``)."""


PAYLOAD_FACTOR = {
    "allreduce": lambda n: 2 * _ring_share(n),
    "reduce_scatter": _ring_share,
    "allgather": _ring_share,
    "alltoall": _ring_share,
    "scatter": _ring_share,
    "gather": _ring_share,
    "send_recv": lambda n: 1.0,
    "send_recv_ring": _ring_peers,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "alltoall_v": lambda n: 1.0,
    "barrier": lambda n: 1.0,
}
"""Bytes a rank sends per byte of a collective's payload on ``n`` ranks, as the counting communicator counts
(an allgather's payload is everything gathered, a point-to-point exchange's what goes to one peer)."""


@dataclasses.dataclass(frozen=True)
class Link:
    """A link: ``latency_s`` per message and ``bytes_per_s`` each way per rank."""

    latency_s: float
    bytes_per_s: float


def collective_s(op: str, payload: float, n: int, link: Link) -> float:
    """Seconds of one collective of ``payload`` bytes on ``n`` ranks over ``link`` (the module docstring)."""
    a, b, steps = link.latency_s, link.bytes_per_s, math.ceil(math.log2(n)) if n > 1 else 0
    if n < 2 or op == "barrier":
        return 2 * steps * a
    if op == "allreduce":
        return min(2 * (n - 1) * (a + payload / (n * b)), 2 * steps * a + 2 * payload / b)
    if op in ("allgather", "reduce_scatter", "gather", "scatter"):
        return min((n - 1) * (a + payload / (n * b)), steps * a + _ring_share(n) * payload / b)
    if op == "alltoall":
        return min((n - 1) * a + _ring_share(n) * payload / b, steps * (a + payload / (2 * b)))
    if op in ("broadcast", "reduce"):
        return steps * a + payload / b
    return a + PAYLOAD_FACTOR.get(op, lambda n: 1.0)(n) * payload / b  # send_recv (to its peers), alltoall_v


@dataclasses.dataclass(frozen=True)
class Step:
    """What one algorithm's step costs besides compute: ``collectives`` (op, calls, payload bytes of one call), the
    ``codec_bytes`` coded per codec, ``every`` steps (DiLoCo's H), whether the step ``blocks`` on them, and for
    Streaming DiLoCo ``fragments`` and the ``overlap_steps`` an exchange hides behind."""

    collectives: tuple[tuple[str, int, float], ...]
    codec_bytes: Mapping[str, float]
    every: int = 1
    blocks: bool = True
    fragments: int = 1
    overlap_steps: int = 0

    def scaled(self, factor: float) -> Step:
        """The same step for a model ``factor`` times as large."""
        return dataclasses.replace(
            self,
            collectives=tuple((op, calls, payload * factor) for op, calls, payload in self.collectives),
            codec_bytes={codec: n * factor for codec, n in self.codec_bytes.items()},
        )


def payload_steps(traffic: dict[str, Any]) -> dict[str, Step]:
    """Each counted algorithm's :class:`Step`, with each collective's payload recovered from the bytes counted on
    ``traffic["ranks"]`` ranks (so that :data:`PAYLOAD_FACTOR` carries it to any rank count)."""
    n, out = traffic["ranks"], {}
    for name, counted in traffic["algorithms"].items():
        ops = {
            (f"{op}_ring" if op == "send_recv" and name in RING_PEERS else op): c for op, c in counted["by_op"].items()
        }
        collectives = tuple(
            (op, calls, sent / calls / PAYLOAD_FACTOR[op](n)) for op, (calls, sent) in ops.items() if calls
        )
        out[name] = Step(collectives, counted["codec_bytes"], blocks=counted["blocking"])
    return out


def steps_of(traffic: dict[str, Any]) -> dict[str, Step]:
    """:func:`payload_steps` of every algorithm of :data:`ALGORITHMS`, PowerSGD without its traced warm-up, and the
    peers (DDP, its hooks, plain JAX) as the Bagua algorithm that sends what they send."""
    out = payload_steps(traffic)
    # PowerSGD's exact warm-up (one allreduce of the whole gradient) is traced beside its two factor allreduces.
    gradient = sum(calls * payload for _, calls, payload in out["gradient_allreduce"].collectives)
    for name in ("powersgd_rank1", "powersgd_rank4"):
        ((op, calls, payload),) = out[name].collectives
        out[name] = dataclasses.replace(out[name], collectives=((op, calls - 1, (calls * payload - gradient) / 2),))
    # DDP's hooks and plain JAX send what their Bagua twin sends (fp16: half of it).
    out["ddp"] = out["pmean"] = out["gradient_allreduce"]
    out["ddp_fp16"] = out["gradient_allreduce"].scaled(0.5)
    out["ddp_powersgd_rank1"], out["ddp_powersgd_rank4"] = out["powersgd_rank1"], out["powersgd_rank4"]
    return out


def diloco_step(steps: Mapping[str, Step], exchange: str, sync_every: int, fragments: int, delay: int) -> Step:
    """DiLoCo with ``exchange`` every ``sync_every`` steps; Streaming (``fragments`` > 1) a fragment every
    ``sync_every / fragments`` steps, overlapping ``delay`` steps."""
    one = steps[f"diloco_{exchange}"]
    if fragments == 1:
        return dataclasses.replace(one, every=sync_every)
    fragment = one.scaled(1 / fragments)
    return dataclasses.replace(fragment, every=sync_every // fragments, fragments=fragments, overlap_steps=delay)


def algorithm_step(steps: Mapping[str, Step], name: str, options: Mapping[str, Any] | None = None) -> Step:
    """The :class:`Step` of a study's variant: its algorithm (a name of :func:`steps_of`, an LM study name) and
    options."""
    options = options or {}
    if name == "diloco":
        return diloco_step(
            steps,
            options.get("outer_exchange", "fp32"),
            options.get("sync_every", 100),
            options.get("fragments", 1),
            options.get("fragment_sync_delay", 0),
        )
    if name == "powersgd":
        return steps[f"powersgd_rank{options.get('rank', 4)}"]
    return steps[name]


def step_s(
    step: Step, compute_s: float, n: int, link: Link, codec_bytes_per_s: Mapping[str, float], cores: int | None = None
) -> float:
    """Predicted seconds of one step on ``n`` ranks (``cores``: the cores they share, None: a device each)."""
    share = max(1.0, n / cores) if cores else 1.0
    compute = compute_s * share
    if not step.blocks:
        return compute
    wire = sum(calls * collective_s(op, payload, n, link) for op, calls, payload in step.collectives)
    coded = share * sum(b / codec_bytes_per_s[codec] for codec, b in step.codec_bytes.items())
    exposed = max(0.0, wire - step.overlap_steps * compute) if step.overlap_steps else wire
    return compute + (exposed + coded) / step.every


# ------------------------------------------------------------------ inputs


def codec_throughput(kernels: dict[str, Any]) -> dict[str, float]:
    """Float bytes per second each codec's kernels code: the median native GB/s of its compression and
    decompression at 4 and 16 MiB (``kernels-cpu.json``), each converted from logical bytes (read + written) to the
    float bytes it codes."""
    float_share = {"minmax": 4 / 5, "sign": 4 / (4 + 1 / 8)}
    out = {}
    for codec, share in float_share.items():
        rates = [
            m["gbps"]
            for m in kernels["measurements"]
            if m["impl"] == "native"
            and m["size_mib"] in (4, 16)
            and m["kernel"] in (f"{codec}_compress", f"{codec}_decompress")
        ]
        out[codec] = statistics.median(rates) * 1e9 * share
    out["minmax_uint4"] = out["minmax"]  # not in the kernel study: taken as fast as the 8-bit codes
    return out


def computes(single: dict[str, Any]) -> dict[tuple[str, str], float]:
    """(front end, model) -> the single-rank step's seconds: the median over the published repeats."""
    values: dict[tuple[str, str], list[float]] = {}
    for row in single["rows"]:
        if row.get("status") == "ok" and row["load"]["published"]:
            values.setdefault((row["front_end"], row["model"]), []).append(row["step_s"])
    return {key: spread(v).median for key, v in values.items()}


def header_share(network: dict[str, Any], steps: Mapping[str, Step]) -> float:
    """The share of a shaped link's rate that carries payload: the counted bytes of gradient allreduce's step over
    the bytes its interface sent (the network study's own counters), median over its rows."""
    counted = sum(
        calls * payload * PAYLOAD_FACTOR[op](2) for op, calls, payload in steps["gradient_allreduce"].collectives
    )
    ratios = [
        counted / r["bytes_sent_per_step"]
        for r in network["rows"]
        if r["algorithm"] == "gradient_allreduce"
        and r["ranks"] == 2
        and r.get("status") == "ok"
        and r.get("bytes_sent_per_step")
    ]
    return statistics.median(ratios) if ratios else 0.95


def measured_points(network: dict[str, Any], lm: dict[str, Any]) -> list[dict[str, Any]]:
    """Every measured step time at 2 and 4 ranks: study, front end, engine, model, algorithm, options, ranks, link,
    ms and load. ``compute_ms``, where the study has one, is its local step (:func:`is_local_step`) on the unshaped
    link at the same rank count: a step that waits for (almost) no communication, measured on the study's own machine
    the same day."""
    points = []
    for row in network["rows"]:
        row = network_study.upgraded(row)
        if row.get("status") == "ok":
            points.append(
                {
                    "study": "network",
                    "front_end": row["framework"],
                    "model": row["model"],
                    "algorithm": row["algorithm"],
                    "options": {},
                    "ranks": row["ranks"],
                    "link": row["link"],
                    "ms": row["step_s"] * 1e3,
                    "load": None,
                }
            )
    for row in lm["timing"].values():
        if row.get("status") == "ok":
            points += [
                {
                    "study": "lm",
                    "front_end": row["front_end"],
                    "model": f"gpt-{lm['settings']['size']}",
                    "algorithm": row["algorithm"],
                    "options": row["options"],
                    "ranks": lm["settings"]["ranks"],
                    "link": link,
                    "ms": entry["ms_per_step"]["median"],
                    "load": statistics.median(p["load"]["load_before"] for p in entry["phases"]),
                }
                for link, entry in row["links"].items()
                if "ms_per_step" in entry and entry["published"]
            ]
    local = {(p["study"], p["front_end"], p["model"], p["ranks"]): p["ms"] for p in points if is_local_step(p)}
    for p in points:
        p["engine"] = "gloo" if p["front_end"] == "torch" or p["algorithm"] == "pmean" else "mpi"
        p["compute_ms"] = local.get((p["study"], p["front_end"], p["model"], p["ranks"]))
    return points


# ------------------------------------------------------------------ calibration, validation


def is_local_step(point: dict[str, Any]) -> bool:
    """Whether a measured point is a study's compute: asynchronous averaging (the network study), or DiLoCo with its
    defaults (the LM study, which times no asynchronous step: one fp32 exchange every 100 steps, under 1% of a step
    on the unshaped link), on the unshaped link."""
    local = point["algorithm"] == "async" or (point["algorithm"] == "diloco" and not point["options"])
    return local and point["link"] == "none"


def link_of(link: str, unshaped: float, latency_s: float, payload_share: float) -> Link:
    rate = parse_rate(link)
    return Link(latency_s, unshaped if rate is None else rate / 8 * payload_share)


def predict(
    point: dict[str, Any],
    steps: Mapping[str, Step],
    compute: Mapping[tuple[str, str], float],
    engines: Mapping[str, tuple[float, float]],
    codecs: Mapping[str, float],
    payload_share: float,
) -> float:
    """The predicted ms of a measured point: its study's compute where it has one (:func:`measured_points`), else
    the single-rank step ``compute`` shared by the ranks on :data:`CORES` cores."""
    latency, unshaped = engines[point["engine"]]
    step = algorithm_step(steps[point["model"]], point["algorithm"], point["options"])
    link = link_of(point["link"], unshaped, latency, payload_share)
    if point["compute_ms"] is not None:
        return 1e3 * step_s(step, point["compute_ms"] / 1e3, point["ranks"], link, codecs)
    return 1e3 * step_s(step, compute[(point["front_end"], point["model"])], point["ranks"], link, codecs, CORES)


def calibrate(
    points: list[dict[str, Any]],
    steps: Mapping[str, Step],
    compute: Mapping[tuple[str, str], float],
    codecs: Mapping[str, float],
    payload_share: float,
) -> dict[str, tuple[float, float]]:
    """Per engine, the latency and unshaped bandwidth that minimize the squared log errors of ``points`` (a grid
    search: 1 us to 10 ms, 0.1 to 100 Gbit/s)."""
    import numpy as np

    latencies = np.geomspace(1e-6, 1e-2, 41)
    bandwidths = np.geomspace(0.1e9 / 8, 100e9 / 8, 31)
    out = {}
    for engine in sorted({p["engine"] for p in points}):
        mine = [p for p in points if p["engine"] == engine]
        best = None
        for a in latencies:
            for b in bandwidths:
                engines = {engine: (float(a), float(b))}
                loss = sum(
                    math.log(predict(p, steps, compute, engines, codecs, payload_share) / p["ms"]) ** 2 for p in mine
                )
                if best is None or loss < best[0]:
                    best = (loss, float(a), float(b))
        out[engine] = best[1:]
    return out


# ------------------------------------------------------------------ time to the target, recommendation


def target_steps(lm: dict[str, Any]) -> tuple[float, dict[str, tuple[float | None, str, dict[str, Any]]]]:
    """The LM study's target (a), DDP fp32's held-out loss at 80% of its budget, and per torch variant trained over
    the whole budget, the steps it needed (None: not reached), its algorithm and options."""
    target = lm_study_report.loss_at(
        lm["train"][lm_study_report.BASELINE]["curve"],
        lm_study_report.BASELINE_FRACTION * lm["train"][lm_study_report.BASELINE]["steps"],
    )
    return target, {
        name.split("/", 1)[1]: (lm_study_report.steps_to(row["curve"], target), row["algorithm"], row["options"])
        for name, row in lm["train"].items()
        if row.get("status") == "ok" and row["front_end"] == "torch"
    }


def unreached(targets: Mapping[str, tuple[float | None, str, dict[str, Any]]]) -> list[str]:
    """The candidates of the recommendation that did not reach the target in the LM study's budget."""
    return [name for name in RECOMMENDED if targets[name][0] is None]


def time_to_target(
    variant: tuple[float, str, dict[str, Any]],
    steps: Mapping[str, Step],
    compute_s: float,
    n: int,
    link: Link,
    codecs: Mapping[str, float],
    cores: int | None = None,
) -> float:
    """Seconds to the target: the steps needed times the predicted step, the uncompressed first steps at gradient
    allreduce's."""
    needed, algorithm, options = variant
    own = step_s(algorithm_step(steps, algorithm, options), compute_s, n, link, codecs, cores)
    first = min(needed, lm_study_report.uncompressed_steps({"algorithm": algorithm, "options": options}))
    if not first:
        return needed * own
    exact = step_s(steps["gradient_allreduce"], compute_s, n, link, codecs, cores)
    return first * exact + (needed - first) * own


def recommend(
    targets: Mapping[str, tuple[float | None, str, dict[str, Any]]],
    steps: Mapping[str, Step],
    compute_s: float,
    ranks: Sequence[int],
    gbits: Sequence[float],
    latencies_ms: Sequence[float],
    codecs: Mapping[str, float],
) -> list[dict[str, Any]]:
    """For every (ranks, Gbit/s, latency): each candidate's predicted time per step (``per_step``) and, for those that
    reached the target, to the target (``to_target``), the fastest first, with the best's speed-up over gradient
    allreduce."""
    out = []
    for n in ranks:
        for latency in latencies_ms:
            for g in gbits:
                link = Link(latency / 1e3, g * 1e9 / 8)
                names = [name for name in RECOMMENDED if name in targets]
                per_step = {  # of the algorithms that communicate every step: the others' steps are local steps
                    name: step_s(algorithm_step(steps, *targets[name][1:]), compute_s, n, link, codecs)
                    for name in names
                    if targets[name][1] not in LOCAL_STEPS
                }
                to_target = {
                    name: time_to_target(targets[name], steps, compute_s, n, link, codecs)
                    for name in names
                    if targets[name][0] is not None
                }
                cell = {"ranks": n, "gbits": g, "latency_ms": latency}
                for key, times in (("per_step", per_step), ("to_target", to_target)):
                    ranked = sorted(times.items(), key=lambda kv: kv[1])
                    cell[key] = {"ranking": ranked, "speedup": times["gradient_allreduce"] / ranked[0][1]}
                out.append(cell)
    return out


# ------------------------------------------------------------------ report


def validation_lines(points: list[dict[str, Any]], fitted_on: set[int]) -> list[str]:
    errors = [p["predicted_ms"] / p["ms"] - 1 for p in points]
    lines = ["## Validation: every measured point at 2 and 4 ranks", ""]
    groups: dict[tuple[str, int, str], list[float]] = {}
    for p, e in zip(points, errors):
        groups.setdefault((p["study"], p["ranks"], _load_class(p["load"])), []).append(abs(e))
    lines += results.table(
        ["study", "ranks", "1-minute load", "points", "median |error|", "mean |error|", "within 25%", "within 50%"],
        [
            [
                study,
                n,
                load,
                len(v),
                f"{100 * statistics.median(v):.0f}%",
                f"{100 * statistics.fmean(v):.0f}%",
                f"{sum(x <= 0.25 for x in v)}",
                f"{sum(x <= 0.5 for x in v)}",
            ]
            for (study, n, load), v in sorted(groups.items())
        ],
        "lrlrrrrr",
    )
    lines += ["", "Every point (`fit`: used to calibrate the engine's latency and unshaped bandwidth):", ""]
    lines += results.table(
        [
            "study",
            "model",
            "front end",
            "algorithm",
            "ranks",
            "link",
            "load",
            "measured ms",
            "predicted ms",
            "error",
            "fit",
        ],
        [
            [
                p["study"],
                p["model"],
                p["front_end"],
                p["algorithm"] + _options(p["options"]),
                p["ranks"],
                p["link"],
                "" if p["load"] is None else f"{p['load']:g}",
                f"{p['ms']:.0f}",
                f"{p['predicted_ms']:.0f}",
                f"{100 * e:+.0f}%",
                "fit" if i in fitted_on else "",
            ]
            for i, (p, e) in enumerate(zip(points, errors))
        ],
        "llllllrrrrl",
    )
    return lines + [""]


def _load_class(load: float | None) -> str:
    """The 1-minute load a point was measured at, in classes: not recorded, <= 8 (the LM study's jobs are 4 ranks on
    2 cores, timed on an otherwise idle machine), above."""
    if load is None:
        return "not recorded"
    return "<= 8" if load <= 8 else "> 8"


def _options(options: Mapping[str, Any]) -> str:
    short = {"sync_every": "H", "outer_exchange": "", "fragments": "P"}
    text = " ".join(f"{short.get(k, k)}{'=' if short.get(k, k) else ''}{v}" for k, v in options.items() if k in short)
    return f" ({text})" if text else ""


VIEWS = {
    "per_step": "time per step, of the algorithms that communicate every step (as if each took as many steps as "
    "gradient allreduce)",
    "to_target": "time to the LM study's target (the steps each needed there, times its step)",
}


def recommendation_lines(grid: list[dict[str, Any]], view: str) -> list[str]:
    """The table of ``view`` (a key of :data:`VIEWS`): per rank count and latency, per bandwidth, the fastest
    algorithm, its speed-up over gradient allreduce and the second fastest."""
    head = ["ranks", "latency", *(f"{g:g} Gbit/s" for g in RECOMMEND_GBITS)]
    cells = []
    for n in RECOMMEND_RANKS:
        for latency in RECOMMEND_LATENCY_MS:
            row: list[Any] = [n, f"{latency:g} ms"]
            for g in RECOMMEND_GBITS:
                cell = next(c for c in grid if (c["ranks"], c["gbits"], c["latency_ms"]) == (n, g, latency))[view]
                (best, _), (second, _) = cell["ranking"][:2]
                row.append(f"{best} {cell['speedup']:.1f}x ({second})")
            cells.append(row)
    return [
        f"Fastest by {VIEWS[view]}, its speed-up over gradient allreduce, the second fastest in brackets:",
        "",
        *results.table(head, cells, "ll" + "l" * len(RECOMMEND_GBITS)),
        "",
    ]


def plot(grid: list[dict[str, Any]], path: Path, title: str) -> Path | None:
    """A row per view of :data:`VIEWS`, a panel per rank count: bandwidth x latency coloured by the fastest
    algorithm, with its speed-up over gradient allreduce."""
    drawn = plots.figure(len(VIEWS), len(RECOMMEND_RANKS), size=(4.2, 3.8))
    if drawn is None:
        return None
    fig, axes = drawn
    names = sorted({c[view]["ranking"][0][0] for c in grid for view in VIEWS})
    colour = {name: f"C{i}" for i, name in enumerate(names)}
    for ax, (view, n) in zip(axes.flat, [(view, n) for view in VIEWS for n in RECOMMEND_RANKS]):
        for cell in (c for c in grid if c["ranks"] == n):
            x, y = RECOMMEND_GBITS.index(cell["gbits"]), RECOMMEND_LATENCY_MS.index(cell["latency_ms"])
            best = cell[view]["ranking"][0][0]
            ax.add_patch(plots.rectangle((x - 0.5, y - 0.5), 1, 1, color=colour[best]))
            ax.text(x, y, f"{cell[view]['speedup']:.1f}x", ha="center", va="center", fontsize=8)
        ax.set_xlim(-0.5, len(RECOMMEND_GBITS) - 0.5)
        ax.set_ylim(-0.5, len(RECOMMEND_LATENCY_MS) - 0.5)
        ax.set_xticks(range(len(RECOMMEND_GBITS)), [f"{g:g}" for g in RECOMMEND_GBITS])
        ax.set_yticks(range(len(RECOMMEND_LATENCY_MS)), [f"{v:g}" for v in RECOMMEND_LATENCY_MS])
        ax.set_xlabel("link (Gbit/s)")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"{n} ranks, {view.replace('_', ' ')}")
    handles = [plots.rectangle((0, 0), 1, 1, color=colour[name]) for name in names]
    fig.legend(handles, names, loc="lower center", ncol=min(5, len(names)), fontsize=8)
    fig.suptitle(title)
    return plots.save(fig, path, bottom=0.05)


def load_inputs(args: argparse.Namespace) -> dict[str, Any]:
    read = {
        name: json.loads((args.results / f"{name}.json").read_text())
        for name in ("network-study", LM_STUDY, "single-rank-step", "kernels-cpu")
    }
    read["traffic"] = json.loads(TRAFFIC.read_text())
    return read


def model(args: argparse.Namespace) -> int:
    inputs = load_inputs(args)
    steps = {w: steps_of(t) for w, t in inputs["traffic"].items()}
    codecs = codec_throughput(inputs["kernels-cpu"])
    compute = computes(inputs["single-rank-step"])
    share = header_share(inputs["network-study"], steps["mlp"])
    points = measured_points(inputs["network-study"], inputs[LM_STUDY])
    points = [p for p in points if p["compute_ms"] is not None or (p["front_end"], p["model"]) in compute]
    points = [p for p in points if not is_local_step(p)]  # the compute itself
    fit = [i for i, p in enumerate(points) if p["study"] == "network" and p["ranks"] == 2]
    engines = calibrate([points[i] for i in fit], steps, compute, codecs, share)
    for p in points:
        p["predicted_ms"] = predict(p, steps, compute, engines, codecs, share)
    target, targets = target_steps(inputs[LM_STUDY])
    gpt_compute = compute[("torch", GPT)]
    grid = recommend(targets, steps[GPT], gpt_compute, RECOMMEND_RANKS, RECOMMEND_GBITS, RECOMMEND_LATENCY_MS, codecs)
    meta = results.run_meta(("jax", "torch"), inputs=[f"benchmarks/results/{n}.json" for n in inputs])
    errors = [abs(p["predicted_ms"] / p["ms"] - 1) for p in points]
    lines = [
        "# The scale model: each algorithm's step and time to the target on 8 to 1024 ranks",
        "",
        *results.header_lines(meta),
        "",
        "- compute of a measured point: its study's local step on the unshaped link at the same rank count "
        "(asynchronous averaging in the network study, DiLoCo with its defaults in the LM study); the predictions' "
        "compute is the single-rank step (single-rank-step.json, measured on "
        f"{inputs['single-rank-step']['meta']['device']['name']})",
        f"- calibrated per engine on the network study's {len(fit)} 2-rank points: "
        + "; ".join(
            f"{e}: latency {a * 1e6:.0f} us, unshaped {b * 8 / 1e9:.2f} Gbit/s" for e, (a, b) in engines.items()
        ),
        f"- payload share of a shaped link's rate (the study's counted / interface bytes): {share:.3f}",
        "- codec throughput (float bytes coded per second, from kernels-cpu.json): "
        + ", ".join(f"{c} {v / 1e9:.1f} GB/s" for c, v in codecs.items()),
        "- single-rank compute per step: "
        + ", ".join(f"{fe} {m} {s * 1e3:.1f} ms" for (fe, m), s in sorted(compute.items())),
        f"- error over all {len(points)} points: median {100 * statistics.median(errors):.0f}%, "
        f"{sum(e <= 0.25 for e in errors)} within 25%, {sum(e <= 0.5 for e in errors)} within 50%",
        f"- time to the target: the LM study's target (a) {target:.4f} (DDP fp32's held-out loss at "
        f"{lm_study_report.BASELINE_FRACTION:.0%} of its {inputs[LM_STUDY]['settings']['steps']} steps of "
        f"{inputs[LM_STUDY]['settings']['windows']} window(s) per rank, {LM_STUDY}.json), the steps each torch "
        "variant needed, held fixed at every rank count; did not reach it: "
        + (", ".join(unreached(targets)) or "none"),
        "",
        f"## Which algorithm to pick: the GPT {GPT.removeprefix('gpt-')} ({inputs['traffic'][GPT]['parameters']:,} "
        "parameters), "
        f"{gpt_compute * 1e3:.0f} ms of compute per step (torch, one rank: single-rank-step.json)",
        "",
        *recommendation_lines(grid, "per_step"),
        *recommendation_lines(grid, "to_target"),
        *validation_lines(points, set(fit)),
    ]
    payload = {
        "meta": meta,
        "engines": engines,
        "payload_share": share,
        "codecs": codecs,
        "compute": {f"{fe} {m}": s for (fe, m), s in compute.items()},
        "points": points,
        "target": target,
        "targets": targets,
        "recommendation": grid,
    }
    for path in results.write_results(args.out, "scale-model", lines, payload):
        print(f"wrote {path}")
    chart = plot(
        grid,
        args.out / "scale-model.png",
        f"The fastest algorithm per step and to the target, GPT {GPT.removeprefix('gpt-')}",
    )
    if chart:
        print(f"wrote {chart}")
    return 0


def advise(args: argparse.Namespace) -> int:
    """``--params``: the ranking for one cluster and model."""
    inputs = load_inputs(args)
    traffic = inputs["traffic"][GPT]
    steps = {name: s.scaled(args.params / traffic["parameters"]) for name, s in steps_of(traffic).items()}
    _, targets = target_steps(inputs[LM_STUDY])
    grid = recommend(
        targets,
        steps,
        args.compute_ms / 1e3,
        [args.ranks],
        [args.gbits],
        [args.latency_ms],
        codec_throughput(inputs["kernels-cpu"]),
    )
    print(
        f"{args.params:.3g} parameters, {args.compute_ms:g} ms compute, {args.ranks} ranks, {args.gbits:g} Gbit/s, "
        f"{args.latency_ms:g} ms: predicted speed-up over gradient allreduce"
    )
    for view, words in VIEWS.items():
        ranking = grid[0][view]["ranking"]
        base = dict(ranking)["gradient_allreduce"]
        print(f"by {words}:")
        for name, seconds in ranking:
            print(f"  {name:<30} {base / seconds:6.2f}x")
    print(f"did not reach the target in the LM study's budget: {', '.join(unreached(targets)) or 'none'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--count", action="store_true", help="count each algorithm's traffic (traced on 8 CPU devices)")
    p.add_argument("--results", type=Path, default=results.RESULTS, help="where the measured results are read")
    p.add_argument("--out", type=Path, default=results.RESULTS)
    p.add_argument("--params", type=float, default=None, help="advise for a model of this many parameters")
    p.add_argument("--compute-ms", type=float, default=100.0, help="its compute per step (with --params)")
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--gbits", type=float, default=10.0)
    p.add_argument("--latency-ms", type=float, default=1.0)
    p.add_argument("--worker-count", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker_count:
        print(json.dumps(count(args.worker_count)))
        return 0
    if args.count:
        env = {
            **os.environ,
            "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={COUNTED_RANKS}",
        }
        counted = {}
        for workload in WORKLOADS:
            done = subprocess.run(
                [sys.executable, __file__, "--worker-count", workload],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            )
            counted[workload] = json.loads(done.stdout.splitlines()[-1])
        TRAFFIC.write_text(json.dumps(counted, indent=1) + "\n")
        print(f"wrote {TRAFFIC}")
        return 0
    return advise(args) if args.params else model(args)


if __name__ == "__main__":
    sys.exit(main())

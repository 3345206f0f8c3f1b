"""The advisor on a live JAX job: measure the links and the step, count each algorithm's traffic, rank them.

Run it on the job's own ranks, started as the training job is::

    bagua-launch --nproc-per-node 4 --mpi -m bagua_jax.advisor --params 2000000

It probes every topology level of the job (world; intra- and inter-node when the job spans
several nodes of several ranks each) with a ping-pong for the latency and allreduces of several
sizes for the bandwidth, times the compute of a synthetic step of the given size and each codec's
kernels on a buffer of a few MiB, counts what one steady-state step of every algorithm sends on each
level and the bytes its compression kernels code (traced, not run), and rank 0 prints the ranking of
:func:`bagua_common.tuning.advisor.rank_algorithms`. It never switches an algorithm.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import Jaxpr, JaxprEqn, jaxprs_in_params
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from bagua_common.algorithms.configs import GradientAllReduceConfig
from bagua_common.algorithms.registry import CONFIGS
from bagua_common.comm.topology import Communicators, ring_neighbours
from bagua_common.job.rank_environment import environment_int
from bagua_common.tuning.advisor import (
    CodecThroughput,
    Link,
    NoisyTimings,
    Prediction,
    Topology,
    Traffic,
    Wire,
    format_ranking,
    level_link,
    rank_algorithms,
    topology_levels,
)
from bagua_jax import ops
from bagua_jax.algorithms import algorithm_names, make_algorithm
from bagua_jax.algorithms.base import check_communicators
from bagua_jax.communicator import Communicator
from bagua_jax.counting import CountingCommunicator
from bagua_jax.native_communicator import NativeCommunicator


def _flat_candidates() -> dict[str, tuple[str, dict[str, Any]]]:
    # Each algorithm that declares itself advised, flat, and its further variants, by candidate name.
    table = {}
    for name in algorithm_names():
        config_class = CONFIGS[name]
        if config_class.advised:
            flat = (
                {"hierarchical": False} if "hierarchical" in {f.name for f in dataclasses.fields(config_class)} else {}
            )
            table[name] = (name, flat)
            for suffix, options in config_class.advisor_variants.items():
                table[f"{name}_{suffix}"] = (name, {**options, **flat})
    return table


CANDIDATES: dict[str, tuple[str, dict[str, Any]]] = _flat_candidates()
"""The algorithms the advisor ranks, with the options that make them the named variant; all flat."""
HIERARCHICAL_CANDIDATES: dict[str, tuple[str, dict[str, Any]]] = {
    f"{name}_hierarchical": (algorithm, {**options, "hierarchical": True})
    for name, (algorithm, options) in CANDIDATES.items()
    if name == algorithm and "hierarchical" in options
}
"""Ranked beside :data:`CANDIDATES` when the job has two levels (reduce inside the node, communicate across nodes):
each algorithm with the option, without its variants."""
# A ping-pong message: small, so it times the latency alone.
_PING_ELEMENTS = 2
# Sweeps to try, each with twice the repeats of the one before, before timings too noisy to fit are an error.
_SWEEP_ATTEMPTS = 3
# The compression kernels' FFI targets (registered by the native module, called by bagua_jax.ops):
# ``bagua_<codec>_<kernel>``.
_CODEC_KERNEL = re.compile(r"bagua_(?P<codec>\w+?)_(?P<kernel>compress|compress_ef|decompress|decompress_reduce)")
# The kernels' timed round trip: a buffer of 4 MiB of float32, compressed into a few chunks and decoded.
_CODEC_ELEMENTS = 2**20
_CODEC_CHUNKS = 4


def candidates(comms: Communicators) -> dict[str, tuple[str, dict[str, Any]]]:
    """The algorithms to rank on ``comms``: :data:`CANDIDATES`, and :data:`HIERARCHICAL_CANDIDATES` with two levels."""
    return {**CANDIDATES, **HIERARCHICAL_CANDIDATES} if comms.hierarchical else dict(CANDIDATES)


def _kernel_coded_bytes(eqn: JaxprEqn) -> tuple[str, int] | None:
    # The codec and float bytes one equation codes, or None when it calls no compression kernel.
    kernel = _CODEC_KERNEL.fullmatch(eqn.params["target_name"]) if eqn.primitive.name == "ffi_call" else None
    if kernel is None:
        return None
    if kernel["kernel"] in ("compress", "compress_ef"):
        aval, buffers = eqn.invars[0].aval, 1
    else:
        aval = eqn.outvars[0].aval
        buffers = int(dict(eqn.params["attributes"])["k"]) if kernel["kernel"] == "decompress_reduce" else 1
    return kernel["codec"], buffers * aval.size * aval.dtype.itemsize


def codec_bytes(jaxpr: Jaxpr) -> dict[str, float]:
    """The bytes the compression kernels called in ``jaxpr`` code, by codec (``minmax``, ``sign``).

    A call counts the float bytes it encodes (a compression's input) or decodes (a decompression's
    output; a decompress-reduce decodes ``k`` buffers into its output, so ``k`` times its output).
    Nested programs (``pjit``, ``cond`` branches, ``shard_map``, custom derivatives) are walked; both
    branches of a ``cond`` count, and a call inside a loop body counts once.
    """
    coded: Counter[str] = Counter()
    for eqn in jaxpr.eqns:
        kernel = _kernel_coded_bytes(eqn)
        if kernel is not None:
            coded[kernel[0]] += kernel[1]
        for inner in jaxprs_in_params(eqn.params):
            coded.update(codec_bytes(inner))
    return {codec: float(nbytes) for codec, nbytes in coded.items()}


def _counted_step(
    name: str, options: Mapping[str, Any], params: Any, comms: Communicators, mesh: Mesh | None
) -> tuple[dict[str, Wire], dict[str, float]]:
    counters = {level: CountingCommunicator(comm) for level, comm in topology_levels(comms).items()}
    algorithm = make_algorithm(name, learning_rate=1e-3, **options)
    optimizer = None if CONFIGS[name].is_optimizer else optax.sgd(0.1)
    tx = algorithm.transformation(optimizer, Communicators(**counters))

    def step(params, grads):
        return tx.update(grads, tx.init(params), params)[0]

    if mesh is not None:
        step = jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P(mesh.axis_names), check_vma=False)
    traced = jax.make_jaxpr(step)(params, params)
    wire = {
        level: Wire(
            c.bytes_sent, sum(c.calls_by_op.values()), {op: (n, c.bytes_by_op[op]) for op, n in c.calls_by_op.items()}
        )
        for level, c in counters.items()
    }
    return wire, codec_bytes(traced.jaxpr)


def _without(wire: Wire, warmup: Wire) -> Wire:
    # What a step sends beyond its traced warm-up branch, in all and per collective.
    by_op = {
        op: (calls - warmup.by_op.get(op, (0, 0.0))[0], sent - warmup.by_op.get(op, (0, 0.0))[1])
        for op, (calls, sent) in wire.by_op.items()
    }
    return Wire(
        wire.bytes_sent - warmup.bytes_sent,
        wire.messages - warmup.messages,
        {op: counts for op, counts in by_op.items() if counts[0]},
    )


def measure_traffic(
    candidate: str, params: Any, comms: Communicators | Communicator, *, mesh: Mesh | None = None
) -> Traffic:
    """What one steady-state step of ``candidate`` (a key of :func:`candidates`) sends on each level and codes
    through the compression kernels (:func:`codec_bytes`), traced, not run.

    ``comms`` is the job's :class:`Communicators` (or its one world communicator); each level's
    traffic is counted on its own communicator, and levels a step sends nothing on are left out.
    ``params`` may be arrays or ``jax.ShapeDtypeStruct``s. With :class:`~bagua_jax.LaxCommunicator` members,
    pass the ``mesh`` whose axes they name. For QAdam and 1-bit Adam, whose warm-up (a gradient
    allreduce of the same hierarchy) is traced beside the compressed exchange, the warm-up's traffic
    and coded bytes are subtracted.
    """
    comms = check_communicators(comms, "measure_traffic")
    table = candidates(comms)
    if candidate not in table:
        raise ValueError(f"unknown candidate {candidate!r} on this topology; choose one of {sorted(table)}")
    name, options = table[candidate]
    return algorithm_traffic(name, options, params, comms, mesh=mesh)


def algorithm_traffic(
    name: str, options: Mapping[str, Any], params: Any, comms: Communicators | Communicator, *, mesh: Mesh | None = None
) -> Traffic:
    """:func:`measure_traffic` of any registered algorithm ``name`` with ``options`` (advised or not: PowerSGD,
    DiLoCo), traced, not run. QAdam's and 1-bit Adam's warm-up, a gradient allreduce traced beside their steady
    state, is subtracted; any other branch a step traces is counted (PowerSGD's exact warm-up, one allreduce of the
    whole gradient, with its two factor allreduces); an algorithm that communicates every few steps (DiLoCo) is
    counted for the step that communicates."""
    comms = check_communicators(comms, "algorithm_traffic")
    wire, coded = _counted_step(name, options, params, comms, mesh)
    if CONFIGS[name].is_optimizer:  # its warm-up is traced beside the steady state (lax.cond)
        hierarchy = {key: options[key] for key in ("hierarchical",) if key in options}
        warmup_wire, warmup_coded = _counted_step(GradientAllReduceConfig.name, hierarchy, params, comms, mesh)
        wire = {level: _without(w, warmup_wire[level]) for level, w in wire.items()}
        coded = {codec: nbytes - warmup_coded.get(codec, 0.0) for codec, nbytes in coded.items()}
    wire = {level: w for level, w in wire.items() if w.messages}
    return Traffic(
        wire=wire, codec_bytes={codec: n for codec, n in coded.items() if n}, blocking=not CONFIGS[name].background
    )


def _timed(fn: Callable[[Any], Any], arg: Any, repeats: int) -> list[float]:
    # Once to compile, then ``repeats`` timed calls.
    jax.block_until_ready(fn(arg))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(arg))
        times.append(time.perf_counter() - start)
    return times


def _probe_level(comm: Communicator, sizes: tuple[int, ...], repeats: int, round_trips: int) -> Link:
    n = comm.size
    if n < 2:
        raise ValueError(f"probe needs at least 2 ranks on every level, got a {n}-rank communicator")
    # Ping-pong with the ring neighbours (one peer when there are two ranks); each exchange waits for the
    # previous one's data, and ``round_trips`` of them run in one call so its dispatch is amortized.
    peers = jnp.asarray(sorted(set(ring_neighbours(int(comm.rank()), n))), jnp.int32)

    def ping_pong(x):
        for _ in range(round_trips):
            x = comm.send_recv(comm.send_recv(x, peers)[0], peers)[0]
        return x

    ping = jnp.zeros(_PING_ELEMENTS, jnp.float32)
    round_trip_s = [t / round_trips for t in _timed(jax.jit(ping_pong), ping, repeats)]
    # A ring allreduce of ``B`` bytes puts ``2 (n-1)/n B`` on each rank's link: the size the fit uses.
    wire = [2 * (n - 1) / n * size for size in sizes]
    # Every rank fits the slowest rank's timings (a collective takes as long as its slowest member), so all
    # ranks agree on the link and on whether to sweep again when load made the timings too noisy to fit.
    slowest = jax.jit(lambda seconds: comm.allreduce(seconds, "max"))
    attempt = 0
    while True:
        seconds = np.asarray(slowest(jnp.asarray(_allreduce_sweep(comm, sizes, repeats << attempt), jnp.float32)))
        try:
            return level_link(round_trip_s, wire, seconds.tolist())
        except NoisyTimings:
            attempt += 1
            if attempt == _SWEEP_ATTEMPTS:
                raise


def _allreduce_sweep(comm: Communicator, sizes: tuple[int, ...], repeats: int) -> list[float]:
    # Median seconds of an allreduce of each size. The sizes take turns, so that a burst of load on the
    # machine slows every size alike (timed one size after another, a burst during the small sizes can
    # make time appear not to grow with size).
    allreduce = jax.jit(comm.allreduce)
    buffers = [jnp.ones(size // 4, jnp.float32) for size in sizes]
    for buffer in buffers:
        jax.block_until_ready(allreduce(buffer))
    times: list[list[float]] = [[] for _ in sizes]
    for _ in range(repeats):
        for size_times, buffer in zip(times, buffers):
            start = time.perf_counter()
            jax.block_until_ready(allreduce(buffer))
            size_times.append(time.perf_counter() - start)
    return [statistics.median(size_times) for size_times in times]


def probe(
    comms: Communicators | Communicator,
    sizes: tuple[int, ...] = (2**16, 2**19, 2**22),
    repeats: int = 5,
    round_trips: int = 16,
) -> Topology:
    """Every topology level's link, measured on its communicator: world, and intra and inter with two levels.

    The latency is half the median round trip of a ping-pong of small messages between each rank
    and its ring neighbours (``round_trips`` per timed call, ``repeats`` calls); the bandwidth is fitted
    to float32 allreduces of ``sizes`` bytes (median of ``repeats`` each). Call it on every rank at
    once with per-process communicators (e.g. :class:`~bagua_jax.NativeCommunicator`): it runs collectives.
    """
    comms = check_communicators(comms, "probe")
    return {level: _probe_level(comm, sizes, repeats, round_trips) for level, comm in topology_levels(comms).items()}


def measure_compute(grad_fn: Callable[[Any], Any], params: Any, repeats: int = 5) -> float:
    """Median seconds of this rank's compute for one step: ``grad_fn(params)``, jitted, without communication."""
    return statistics.median(_timed(jax.jit(grad_fn), params, repeats))


def measure_codec_throughput(repeats: int = 5) -> CodecThroughput:
    """Each codec's kernel throughput on this rank: the bytes :func:`codec_bytes` counts in a compress-decompress
    round trip of 4 MiB of float32 (through :mod:`bagua_jax.ops`), over its median time of ``repeats`` calls."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal(_CODEC_ELEMENTS, np.float32))
    throughput = {}
    for compress, decompress in (
        (ops.minmax_uint8_compress, ops.minmax_uint8_decompress),
        (ops.sign_compress, ops.sign_decompress),
    ):

        def round_trip(x, compress=compress, decompress=decompress):
            return decompress(compress(x, _CODEC_CHUNKS), x.size, _CODEC_CHUNKS)

        ((codec, coded),) = codec_bytes(jax.make_jaxpr(round_trip)(x).jaxpr).items()
        throughput[codec] = coded / statistics.median(_timed(jax.jit(round_trip), x, repeats))
    return throughput


def recommend(
    grad_fn: Callable[[Any], Any], params: Any, comms: Communicators | Communicator
) -> tuple[list[Prediction], str]:
    """Probe, time and count on every rank, then rank the algorithms; returns the ranking and its table."""
    comms = check_communicators(comms, "recommend")
    topology = probe(comms)
    compute_s = measure_compute(grad_fn, params)
    codec_bytes_per_s = measure_codec_throughput()
    traffic = {name: measure_traffic(name, params, comms) for name in candidates(comms)}
    ranking = rank_algorithms(traffic, topology, compute_s, codec_bytes_per_s)
    return ranking, format_ranking(ranking, topology, compute_s, codec_bytes_per_s)


def job_communicators(world: Any, ranks_per_node: int) -> Communicators:
    """``world`` with its two levels when ``ranks_per_node`` groups it into several nodes of several ranks.

    World rank ``r`` is local rank ``r % ranks_per_node`` of node ``r // ranks_per_node`` (the launcher's
    layout); ``intra`` splits by node, ``inter`` by local rank. One node, or one rank per node, is flat.
    Every rank must call it (the splits are collective).
    """
    if ranks_per_node < 1:
        raise ValueError(f"ranks per node must be at least 1, got {ranks_per_node}")
    if world.size % ranks_per_node:
        raise ValueError(f"{ranks_per_node} ranks per node do not divide a {world.size}-rank job")
    if not 1 < ranks_per_node < world.size:
        return Communicators(world=world)
    node, local = divmod(int(world.rank()), ranks_per_node)
    return Communicators(
        world=world,
        intra=world.split(node, local, f"bagua/advisor/intra{node}"),
        inter=world.split(local, node, f"bagua/advisor/inter{local}"),
    )


def main(argv: list[str] | None = None) -> None:
    """Rank the algorithms for a synthetic MLP of ``--params`` parameters on the running job."""
    parser = argparse.ArgumentParser(prog="python -m bagua_jax.advisor", description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=2_000_000, help="parameters of the synthetic model")
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=environment_int("LOCAL_WORLD_SIZE") or None,
        help="ranks per node, for the intra- and inter-node levels (default: the launcher's LOCAL_WORLD_SIZE; "
        "a smaller value on one host groups its ranks as if they were nodes)",
    )
    args = parser.parse_args(argv)
    if args.params < 1024:
        parser.error(f"--params must be at least 1024, got {args.params}")
    width = int(np.sqrt(args.params / 2))
    rng = np.random.default_rng(0)
    params = {f"w{i}": jnp.asarray(rng.standard_normal((width, width), np.float32) / width) for i in range(2)}
    x = jnp.asarray(rng.standard_normal((64, width), np.float32))

    def grad_fn(p):
        return jax.grad(lambda q: jnp.mean(jnp.tanh(x @ q["w0"]) @ q["w1"]) ** 2)(p)

    world = NativeCommunicator.world()
    try:
        comms = job_communicators(world, world.size if args.ranks_per_node is None else args.ranks_per_node)
    except ValueError as e:
        parser.error(f"--ranks-per-node: {e}")
    _, table = recommend(grad_fn, params, comms)
    if int(world.rank()) == 0:
        print(table, flush=True)


if __name__ == "__main__":
    main()

"""The advisor on a live JAX job: measure the link and the step, count each algorithm's traffic, rank them.

Run it on the job's own ranks, started as the training job is::

    bagua-launch --nproc-per-node 4 --mpi -m bagua_jax.advisor --params 2000000

It probes the link with allreduces of several sizes over the native communicator, times the
compute of a synthetic step of the given size, counts what one steady-state step of every
algorithm sends (traced, not run), and rank 0 prints the ranking of
:func:`bagua_common.advisor.rank_algorithms`. It never switches an algorithm.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from bagua_common.advisor import Link, Prediction, Traffic, fit_link, format_ranking, rank_algorithms
from bagua_jax.algorithms import make_algorithm
from bagua_jax.algorithms.base import Communicators
from bagua_jax.communicator import Communicator
from bagua_jax.counting import CountingCommunicator

# The algorithms the advisor ranks, with the options that make them the named variant.
CANDIDATES: dict[str, tuple[str, dict[str, Any]]] = {
    "gradient_allreduce": ("gradient_allreduce", {}),
    "bytegrad": ("bytegrad", {}),
    "decentralized": ("decentralized", {}),
    "decentralized_shift_one": ("decentralized", {"peer_selection_mode": "shift_one"}),
    "low_precision_decentralized": ("low_precision_decentralized", {}),
    "qadam": ("qadam", {}),
    "onebit_adam": ("onebit_adam", {}),
    "async": ("async", {}),
}
# Optimizers themselves: their warm-up is a gradient allreduce traced beside the steady state (lax.cond).
_WARMUP_THEN_COMPRESSED = frozenset({"qadam", "onebit_adam"})
# Averaging runs beside the step, on its own communicator.
_BACKGROUND = frozenset({"async"})


def _counted_step(name: str, options: Mapping[str, Any], params: Any, comm: Communicator, mesh: Mesh | None):
    counter = CountingCommunicator(comm)
    algorithm = make_algorithm(name, learning_rate=1e-3, **options)
    optimizer = None if name in _WARMUP_THEN_COMPRESSED else optax.sgd(0.1)
    tx = algorithm.transformation(optimizer, Communicators(world=counter))

    def step(params, grads):
        return tx.update(grads, tx.init(params), params)[0]

    if mesh is not None:
        axis = mesh.axis_names[0]
        step = jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P(axis), check_vma=False)
    jax.eval_shape(step, params, params)
    return counter


def measure_traffic(candidate: str, params: Any, comm: Communicator, *, mesh: Mesh | None = None) -> Traffic:
    """What one steady-state step of ``candidate`` (a key of :data:`CANDIDATES`) sends, traced, not run.

    ``params`` may be arrays or ``jax.ShapeDtypeStruct``s. With a :class:`~bagua_jax.LaxCommunicator`,
    pass the ``mesh`` whose axis it names. For QAdam and 1-bit Adam, whose warm-up (a gradient
    allreduce) is traced beside the compressed exchange, the warm-up's traffic is subtracted.
    """
    name, options = CANDIDATES[candidate]
    counter = _counted_step(name, options, params, comm, mesh)
    bytes_sent, messages = counter.bytes_sent, sum(counter.calls_by_op.values())
    if name in _WARMUP_THEN_COMPRESSED:
        warmup = _counted_step("gradient_allreduce", {}, params, comm, mesh)
        bytes_sent -= warmup.bytes_sent
        messages -= sum(warmup.calls_by_op.values())
    return Traffic(bytes_sent=bytes_sent, messages=messages, blocking=name not in _BACKGROUND)


def probe(comm: Communicator, sizes: tuple[int, ...] = (2**16, 2**19, 2**22), repeats: int = 5) -> Link:
    """The link as measured by float32 allreduces of ``sizes`` bytes over ``comm`` (median of ``repeats``).

    Call it on every rank at once (it runs collectives); a ring allreduce of ``B`` bytes puts
    ``2 (n-1)/n B`` on each rank's link, which is the size the fit uses.
    """
    n = comm.size
    seconds, wire = [], []
    for size in sizes:
        allreduce = jax.jit(comm.allreduce)
        x = jnp.ones(size // 4, jnp.float32)
        allreduce(x).block_until_ready()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            allreduce(x).block_until_ready()
            times.append(time.perf_counter() - start)
        seconds.append(statistics.median(times))
        wire.append(2 * (n - 1) / n * size)
    return fit_link(wire, seconds)


def measure_compute(grad_fn: Callable[[Any], Any], params: Any, repeats: int = 5) -> float:
    """Median seconds of this rank's compute for one step: ``grad_fn(params)``, jitted, without communication."""
    grad = jax.jit(grad_fn)
    jax.block_until_ready(grad(params))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(grad(params))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def recommend(
    grad_fn: Callable[[Any], Any], params: Any, comm: Communicator, *, codec_bytes_per_s: float = 1e10
) -> tuple[list[Prediction], str]:
    """Probe, time and count on every rank, then rank the algorithms; returns the ranking and its table."""
    link = probe(comm)
    compute_s = measure_compute(grad_fn, params)
    traffic = {name: measure_traffic(name, params, comm) for name in CANDIDATES}
    ranking = rank_algorithms(traffic, link, compute_s, codec_bytes_per_s)
    return ranking, format_ranking(ranking, link, compute_s)


def main(argv: list[str] | None = None) -> None:
    """Rank the algorithms for a synthetic MLP of ``--params`` parameters on the running job."""
    from bagua_jax import NativeCommunicator

    parser = argparse.ArgumentParser(prog="python -m bagua_jax.advisor", description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=int, default=2_000_000, help="parameters of the synthetic model")
    args = parser.parse_args(argv)
    if args.params < 1024:
        parser.error(f"--params must be at least 1024, got {args.params}")
    width = int(np.sqrt(args.params / 2))
    rng = np.random.default_rng(0)
    params = {f"w{i}": jnp.asarray(rng.standard_normal((width, width), np.float32) / width) for i in range(2)}
    x = jnp.asarray(rng.standard_normal((64, width), np.float32))

    def grad_fn(p):
        return jax.grad(lambda q: jnp.mean(jnp.tanh(x @ q["w0"]) @ q["w1"]) ** 2)(p)

    comm = NativeCommunicator.world()
    _, table = recommend(grad_fn, params, comm)
    if int(comm.rank()) == 0:
        print(table, flush=True)


if __name__ == "__main__":
    main()

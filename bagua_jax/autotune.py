"""Bucket-size tuning for :class:`~bagua_jax.trainer.DataParallel`, in the job, before the first step.

Under ``jit`` a bucket layout is compiled into the step, so measuring candidates with the user's
own step would recompile the whole model once per candidate. Instead each candidate is timed on
the communication-only program: a :class:`DataParallel` step of the same algorithm over the same
parameters whose loss is ``0.5 * |params|^2`` (its gradient is the parameters: real values through
the kernels) and whose optimizer is ``sgd(0)``. Each candidate costs the compile of that small
program (reported in :attr:`BucketTuning.compile_s`) plus its samples; the training step is then
compiled once, with the winner. The search is :class:`bagua_common.autotune.InBandTuner`: rank 0
decides and broadcasts, so every process ends with the same bucket size.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh

from bagua_common.autotune import InBandTuner, TuningCache, autotune_mode, bucket_candidates, cache_key, check_knobs
from bagua_jax.algorithms.base import Algorithm
from bagua_jax.native_communicator import NativeCommunicator
from bagua_jax.signature import job_signature


@dataclasses.dataclass(frozen=True)
class BucketTuning:
    """What tuning chose and what it cost: the bucket size, every candidate's median, compile seconds."""

    bucket_bytes: int
    medians_s: dict[int, float]
    compile_s: float
    from_cache: bool


def _half_square(params: Any, batch: Any) -> jax.Array:
    del batch
    return 0.5 * sum(jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in jax.tree.leaves(params))


def tune_bucket_bytes(
    params: Any,
    algorithm: Algorithm,
    *,
    mesh: Mesh | None = None,
    communicator: NativeCommunicator | None = None,
    mode: str | None = None,
    allow_numerics_change: bool = False,
    steps_per_sample: int = 5,
) -> BucketTuning | None:
    """Tune ``algorithm.bucket_bytes`` for ``params`` on this job; None when autotuning is off.

    Call it on every process at once (it communicates). ``mode`` is ``off``, ``once`` or ``cached``
    (default: ``BAGUA_AUTOTUNE``); ``cached`` reuses a stored result for the same model, world,
    engine and algorithm. Compressed algorithms are refused unless ``allow_numerics_change``.
    """
    from bagua_jax.trainer import DataParallel

    mode = autotune_mode(mode)
    if mode == "off":
        return None
    registry_name = _registry_name(algorithm)
    check_knobs(registry_name, {"bucket_bytes": [0]}, allow_numerics_change=allow_numerics_change)
    world = [int(np.prod(mesh.devices.shape))] if mesh is not None else [communicator.size]
    engine = communicator.kind if communicator is not None else "lax"
    key = cache_key(job_signature(params, algorithm).digest().hex(), world, engine, registry_name)
    cache = TuningCache()
    if mode == "cached" and (stored := cache.get(key)) is not None:
        return BucketTuning(int(stored["bucket_bytes"]), {}, 0.0, True)

    if mesh is not None:
        rank = jax.process_index()

        def broadcast(vector: np.ndarray) -> np.ndarray:
            return np.asarray(multihost_utils.broadcast_one_to_all(vector.astype(np.int32)))
    else:
        rank = int(communicator.rank())
        send = jax.jit(lambda v: communicator.broadcast(v, 0))

        def broadcast(vector: np.ndarray) -> np.ndarray:
            return np.asarray(send(jnp.asarray(vector, jnp.int32)))

    start = algorithm.bucket_bytes
    candidates = [start, *(b for b in bucket_candidates(ravel_pytree(params)[0].nbytes) if b != start)]
    settings = [{"bucket_bytes": b} for b in candidates]
    tuner = InBandTuner(settings, rank=rank, broadcast=broadcast, warmup_steps=1, steps_per_sample=steps_per_sample)
    compile_s = 0.0
    programs: dict[int, tuple[DataParallel, Any]] = {}
    while not tuner.finished:
        bucket = tuner.current["bucket_bytes"]
        if bucket not in programs:
            start = time.perf_counter()
            trainer = DataParallel(
                _half_square,
                optax.sgd(0.0),
                dataclasses.replace(algorithm, bucket_bytes=bucket),
                mesh=mesh,
                communicator=communicator,
                autotune="off",
            )
            state = trainer.init(params)
            jax.block_until_ready(trainer.step(state, _empty_batch(trainer, mesh)))
            compile_s += time.perf_counter() - start
            programs[bucket] = (trainer, state)
        trainer, state = programs[bucket]
        start = time.perf_counter()
        jax.block_until_ready(trainer.step(state, _empty_batch(trainer, mesh)))
        tuner.step_finished(time.perf_counter() - start)
    best = tuner.current["bucket_bytes"]
    medians = {candidates[i]: s for i, s in tuner.medians().items()}
    if rank == 0:
        cache.put(key, {"bucket_bytes": best}, {str(b): s for b, s in medians.items()})
    return BucketTuning(best, medians, compile_s, False)


def _empty_batch(trainer: Any, mesh: Mesh | None) -> Any:
    return np.zeros((trainer.size,), np.float32) if mesh is not None else np.zeros((1,), np.float32)


def _registry_name(algorithm: Algorithm) -> str:
    from bagua_jax.algorithms import ALGORITHMS

    for key, cls in ALGORITHMS.items():
        if isinstance(algorithm, cls):
            return key
    raise ValueError(f"autotune: {type(algorithm).__name__} is not a registered algorithm")

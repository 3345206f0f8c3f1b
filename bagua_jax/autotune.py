"""Tuning :class:`~bagua_jax.trainer.DataParallel`'s exact knobs, in the job, before the first step.

The knobs (:func:`bagua_common.tuning.autotune.tuning_knobs`): the bucket size; ``hierarchical`` on a
2-D mesh ``("inter", "intra")`` when the algorithm has the field; the MPI ring threshold over a
native MPI communicator whose ranks span nodes. Under ``jit`` a bucket layout and the hierarchical
flag are compiled into the step, so measuring candidates with the user's own step would recompile
the whole model once per candidate. Instead each candidate is timed on the communication-only
program the trainer passes in: a :class:`DataParallel` step of the same algorithm over the same parameters whose loss is
``0.5 * |params|^2`` (its gradient is the parameters: real values through the kernels) and whose
optimizer is ``sgd(0)``. Each bucket size and flag costs the compile of that small program
(reported in :attr:`BucketTuning.compile_s`) plus its samples; the ring threshold is the
communicator's run-time state, so switching it compiles nothing. The training step is then
compiled once, with the winner. The search is :class:`bagua_common.tuning.autotune.TuningSession`:
rank 0 decides and broadcasts, so every process ends with the same setting.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh

from bagua_common.tuning.autotune import TuningSession, autotune_mode, cache_key, tuning_knobs
from bagua_jax.algorithms.base import REGISTRY, Algorithm
from bagua_jax.native_communicator import NativeCommunicator
from bagua_jax.signature import job_signature


@dataclasses.dataclass(frozen=True)
class BucketTuning:
    """What tuning chose and what it cost: the whole ``setting`` (knob -> value; ``bucket_bytes`` is its bucket
    size), every searched setting's median by :func:`~bagua_common.tuning.autotune.setting_label`, compile seconds."""

    setting: dict[str, Any]
    medians_s: dict[str, float]
    compile_s: float
    from_cache: bool

    @property
    def bucket_bytes(self) -> int:
        """The chosen bucket size."""
        return int(self.setting["bucket_bytes"])


def tune_bucket_bytes(
    params: Any,
    algorithm: Algorithm,
    step_for: Callable[[Algorithm], Callable[[], Any]],
    *,
    mesh: Mesh | None = None,
    communicator: NativeCommunicator | None = None,
    mode: str | None = None,
    allow_numerics_change: bool = False,
    steps_per_sample: int = 5,
) -> BucketTuning | None:
    """Tune ``algorithm``'s bucket size (and its other exact knobs that have an effect here) for ``params`` on this
    job; None when autotuning is off.

    Call it on every process at once (it communicates). ``mode`` is ``off``, ``once`` or ``cached``
    (default: ``BAGUA_AUTOTUNE``); ``cached`` reuses a stored result for the same model, world,
    engine and algorithm. Compressed algorithms are refused unless ``allow_numerics_change``. The
    chosen ring threshold is left set on ``communicator``; the caller applies the other knobs
    (:func:`algorithm_setting`). ``step_for(candidate)`` returns one step of the job with the
    candidate algorithm, which is timed; its first call (compilation) is counted apart.
    """
    mode = autotune_mode(mode)
    if mode == "off":
        return None
    registry_name = getattr(algorithm, "name", None)
    if registry_name not in REGISTRY.names():
        raise ValueError(f"autotune: {type(algorithm).__name__} is not a registered algorithm")
    ring = communicator is not None and communicator.kind == "mpi" and communicator.spans_nodes
    knobs = tuning_knobs(
        registry_name,
        bucket_bytes=algorithm.bucket_bytes,
        total_bytes=ravel_pytree(params)[0].nbytes,
        hierarchical=getattr(algorithm, "hierarchical", None),
        two_levels=mesh is not None and len(mesh.axis_names) == 2,
        mpi_ring_min_bytes=communicator.mpi_ring_min_bytes if ring else None,
        allow_numerics_change=allow_numerics_change,
    )
    world = list(mesh.devices.shape) if mesh is not None else [communicator.size]
    engine = communicator.kind if communicator is not None else "lax"
    key = cache_key(job_signature(params, algorithm).digest().hex(), world, engine, registry_name)

    if mesh is not None:
        rank = jax.process_index()

        def broadcast(vector: np.ndarray) -> np.ndarray:
            return np.asarray(multihost_utils.broadcast_one_to_all(vector.astype(np.int32)))
    else:
        rank = int(communicator.rank())
        send = jax.jit(lambda v: communicator.broadcast(v, 0))

        def broadcast(vector: np.ndarray) -> np.ndarray:
            return np.asarray(send(jnp.asarray(vector, jnp.int32)))

    session = TuningSession(
        knobs, key=key, mode=mode, rank=rank, broadcast=broadcast, warmup_steps=1, steps_per_sample=steps_per_sample
    )
    compile_s = 0.0
    programs: dict[tuple[tuple[str, Any], ...], Callable[[], Any]] = {}
    while True:
        setting = session.current
        if "mpi_ring_min_bytes" in setting and setting["mpi_ring_min_bytes"] != communicator.mpi_ring_min_bytes:
            communicator.set_mpi_ring_min_bytes(setting["mpi_ring_min_bytes"])
        if session.finished:
            break
        compiled = algorithm_setting(setting)
        if compiled not in programs:
            start = time.perf_counter()
            programs[compiled] = step_for(algorithm.replace(**dict(compiled)))
            jax.block_until_ready(programs[compiled]())
            compile_s += time.perf_counter() - start
        start = time.perf_counter()
        jax.block_until_ready(programs[compiled]())
        session.step_finished(time.perf_counter() - start)
    return BucketTuning(setting, session.medians(), compile_s, session.cached is not None)


def algorithm_setting(setting: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """The knobs of ``setting`` that are fields of the algorithm (compiled into its step), as sorted pairs."""
    return tuple((name, value) for name, value in sorted(setting.items()) if name in ("bucket_bytes", "hierarchical"))

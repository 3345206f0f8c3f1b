"""Tuning a wrapped torch model's exact knobs between its training steps.

The wrapper (:class:`~bagua_torch.bagua_module.BaguaModule`) calls :meth:`BucketTuner.step` at
every training forward, after pending communication has finished; the time between two calls is
one step. :class:`bagua_common.tuning.autotune.TuningSession` decides: rank 0 searches, its choice is
broadcast over the job's world communicator at step counts fixed in advance, and every rank
switches at the same step. The knobs (:func:`bagua_common.tuning.autotune.tuning_knobs`): the bucket
size; ``hierarchical`` when the job has intra- and inter-node communicators; the MPI ring
threshold when the world communicator is the native MPI engine and spans nodes. Re-bucketing and
switching ``hierarchical`` rebuild the algorithm, so only algorithms without state tied to the
buckets are tuned: gradient allreduce. The whole setting is cached (``BAGUA_AUTOTUNE=cached``
starts the next run tuned).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from bagua_common.algorithms.registry import CONFIGS, algorithm_facts
from bagua_common.comm.topology import Communicators
from bagua_common.tuning.autotune import TuningSession, autotune_mode, cache_key, tuning_knobs
from bagua_torch.communicator import NativeCommunicator


def ring_communicator(communicators: Communicators) -> NativeCommunicator | None:
    """The world communicator if the MPI ring threshold has an effect on it (native MPI, spanning nodes), else None."""
    world = communicators.world
    if isinstance(world, NativeCommunicator) and world.engine == "mpi" and world.spans_nodes:
        return world
    return None


def set_mpi_ring_min_bytes(communicators: Communicators, value: int) -> None:
    """Set the MPI ring threshold on each of the job's distinct communicators (world, intra, inter)."""
    for comm in {id(c): c for c in communicators if c is not None}.values():
        comm.set_mpi_ring_min_bytes(value)


class BucketTuner:
    """Tunes a wrapped model's bucket size, and where they have an effect ``hierarchical`` and the MPI ring
    threshold, over its first steps (see the module docstring).

    ``algorithm`` is the wrapper's algorithm configuration. When ``mode`` is ``cached`` and a
    setting is stored, :attr:`cached` holds it (the wrapper starts with it and :attr:`finished`
    is true at once).
    """

    def __init__(
        self,
        *,
        algorithm: Any,
        total_bytes: int,
        start_bytes: int,
        communicators: Communicators,
        device: torch.device,
        job_digest: str,
        mode: str,
        warmup_steps: int = 5,
        steps_per_sample: int = 5,
    ) -> None:
        ring = ring_communicator(communicators)
        knobs = tuning_knobs(
            algorithm.name,
            bucket_bytes=start_bytes,
            total_bytes=total_bytes,
            hierarchical=getattr(algorithm, "hierarchical", None),
            two_levels=communicators.hierarchical,
            mpi_ring_min_bytes=ring.mpi_ring_min_bytes if ring is not None else None,
        )
        if not algorithm_facts(algorithm.name).stateless:  # re-bucketing mid-run rebuilds the algorithm
            stateless = [name for name, config_class in CONFIGS.items() if config_class.stateless]
            raise ValueError(
                f"autotune: {algorithm.name} keeps state per bucket, which re-bucketing between steps would lose; "
                f"PyTorch tunes {', '.join(stateless)} only"
            )
        world = communicators.world
        self._world = world
        self._device = device
        layout = [world.size, communicators.intra.size if communicators.hierarchical else world.size]
        engine = world.engine if isinstance(world, NativeCommunicator) else type(world).__name__
        self._session = TuningSession(
            knobs,
            key=cache_key(job_digest, layout, engine, algorithm.name),
            mode=mode,
            rank=world.rank,
            broadcast=self._broadcast,
            warmup_steps=warmup_steps,
            steps_per_sample=steps_per_sample,
        )
        self.cached: dict[str, Any] | None = self._session.cached
        self._last: float | None = None

    @property
    def finished(self) -> bool:
        """True once the setting is decided (or came from the cache)."""
        return self._session.finished

    @property
    def current(self) -> dict[str, Any]:
        """The setting in force."""
        return self._session.current

    def _broadcast(self, vector: np.ndarray) -> np.ndarray:
        tensor = torch.from_numpy(np.ascontiguousarray(vector, np.int32)).to(self._device)
        return self._world.broadcast(tensor, 0).cpu().numpy()

    def step(self) -> Mapping[str, Any] | None:
        """Call at every training step's start on every rank; returns a setting to switch to, or None."""
        if self.finished:
            return None
        now = time.perf_counter()
        last, self._last = self._last, now
        if last is None:
            return None
        return self._session.step_finished(now - last)


def tuner_for(mode: str | None, **settings: Any) -> BucketTuner | None:
    """A :class:`BucketTuner` with ``settings`` (its keyword arguments) when autotuning is on (``mode``, or
    ``BAGUA_AUTOTUNE`` when None), else None."""
    mode = autotune_mode(mode)
    return None if mode == "off" else BucketTuner(mode=mode, **settings)

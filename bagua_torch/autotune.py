"""Bucket-size tuning of a wrapped torch model, between its training steps.

The wrapper (:class:`~bagua_torch.distributed.BaguaModule`) calls :meth:`BucketTuner.step` at
every training forward, after pending communication has finished; the time between two calls is
one step. :class:`bagua_common.autotune.InBandTuner` decides: rank 0 searches, its choice is
broadcast over the job's world communicator at step counts fixed in advance, and every rank
re-buckets at the same step. Re-bucketing rebuilds the algorithm for the new buckets, so only
algorithms without state tied to the buckets are tuned: gradient allreduce. The result is cached
(``BAGUA_AUTOTUNE=cached`` starts the next run tuned).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from bagua_common.autotune import InBandTuner, TuningCache, autotune_mode, bucket_candidates, cache_key, check_knobs
from bagua_torch.communicator import Communicator

# Re-bucketing mid-run rebuilds the algorithm: only stateless ones survive it unchanged.
REBUCKETABLE = frozenset({"gradient_allreduce"})


class BucketTuner:
    """Tunes a wrapped model's bucket size over its first steps (see the module docstring).

    ``cached_bucket_bytes`` is the stored choice when ``mode`` is ``cached`` and one exists (the
    wrapper then starts with it and :attr:`finished` is true at once).
    """

    def __init__(
        self,
        *,
        algorithm: str,
        total_bytes: int,
        start_bytes: int,
        world: Communicator,
        device: torch.device,
        job_digest: str,
        mode: str,
        warmup_steps: int = 5,
        steps_per_sample: int = 5,
    ) -> None:
        check_knobs(algorithm, {"bucket_bytes": [start_bytes]})
        if algorithm not in REBUCKETABLE:
            raise ValueError(
                f"autotune: {algorithm} keeps state per bucket, which re-bucketing between steps would lose; "
                f"PyTorch tunes {', '.join(sorted(REBUCKETABLE))} only"
            )
        self._world = world
        self._device = device
        self._key = cache_key(job_digest, [world.size], type(world).__name__, algorithm)
        self._cache = TuningCache()
        stored = self._cache.get(self._key) if mode == "cached" else None
        self.cached_bucket_bytes: int | None = int(stored["bucket_bytes"]) if stored else None
        candidates = bucket_candidates(total_bytes)
        if start_bytes in candidates:
            candidates.remove(start_bytes)
        self._candidates = [start_bytes, *candidates]
        self._tuner = InBandTuner(
            [{"bucket_bytes": b} for b in self._candidates],
            rank=world.rank,
            broadcast=self._broadcast,
            warmup_steps=warmup_steps,
            steps_per_sample=steps_per_sample,
        )
        self._last: float | None = None

    @property
    def finished(self) -> bool:
        """True once the bucket size is decided (or came from the cache)."""
        return self.cached_bucket_bytes is not None or self._tuner.finished

    def _broadcast(self, vector: np.ndarray) -> np.ndarray:
        tensor = torch.from_numpy(np.ascontiguousarray(vector, np.int32)).to(self._device)
        return self._world.broadcast(tensor, 0).cpu().numpy()

    def step(self) -> int | None:
        """Call at every training step's start on every rank; returns a new bucket size to switch to, or None."""
        if self.finished:
            return None
        now = time.perf_counter()
        last, self._last = self._last, now
        if last is None:
            return None
        change = self._tuner.step_finished(now - last)
        if self._tuner.finished and self._world.rank == 0:
            medians = {str(self._candidates[i]): s for i, s in self._tuner.medians().items()}
            self._cache.put(self._key, self._tuner.current, medians)
        return None if change is None else int(change["bucket_bytes"])


def tuner_for(mode: str | None, **settings: Any) -> BucketTuner | None:
    """A :class:`BucketTuner` with ``settings`` (its keyword arguments) when autotuning is on (``mode``, or
    ``BAGUA_AUTOTUNE`` when None), else None."""
    mode = autotune_mode(mode)
    return None if mode == "off" else BucketTuner(mode=mode, **settings)

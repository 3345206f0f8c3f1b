"""A deterministic, step-indexed sampler for elastic jobs.

Step ``s`` trains on a fixed global batch: the ``s % steps_per_epoch``-th slice of ``global_batch``
indices of epoch ``s // steps_per_epoch``'s permutation (seeded by ``seed`` and the epoch).
Which ranks are alive decides only how that batch is split: rank ``r`` of ``n`` takes the
``r``-th of ``n`` equal contiguous parts. So a job restarted at step ``s`` with any world
size dividing the global batch sees exactly the samples it would have seen, and every
sample of an epoch is used exactly once across the live ranks (the last
``num_samples % global_batch`` samples of each epoch's permutation are left out, as
``drop_last`` does), also across a resize.
"""

from __future__ import annotations

import numpy as np


class ElasticSampler:
    """Sample indices by step: :meth:`global_indices` for the whole batch, :meth:`indices` for one rank's part."""

    def __init__(self, num_samples: int, global_batch: int, *, seed: int = 0):
        for name, value in (("num_samples", num_samples), ("global_batch", global_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ElasticSampler: {name} must be a positive int, got {value!r}")
        if global_batch > num_samples:
            raise ValueError(f"ElasticSampler: global_batch {global_batch} exceeds the {num_samples} samples")
        self.num_samples = num_samples
        self.global_batch = global_batch
        self.seed = seed
        self.steps_per_epoch = num_samples // global_batch

    def global_indices(self, step: int) -> np.ndarray:
        """The sample indices of step ``step``'s global batch."""
        if step < 0:
            raise ValueError(f"ElasticSampler: step must be >= 0, got {step}")
        epoch, position = divmod(step, self.steps_per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return order[position * self.global_batch : (position + 1) * self.global_batch]

    def indices(self, step: int, rank: int, world_size: int) -> np.ndarray:
        """Rank ``rank``'s part of step ``step``'s batch; a ValueError if ``world_size`` does not divide the batch."""
        self.check_world_size(world_size)
        if not 0 <= rank < world_size:
            raise ValueError(f"ElasticSampler: rank {rank} is not in 0 .. {world_size - 1}")
        part = self.global_batch // world_size
        return self.global_indices(step)[rank * part : (rank + 1) * part]

    def check_world_size(self, world_size: int) -> None:
        """Raise a ValueError unless ``world_size`` ranks can split the global batch evenly."""
        if world_size < 1 or self.global_batch % world_size:
            raise ValueError(
                f"the global batch of {self.global_batch} does not split evenly across {world_size} ranks; "
                "choose node counts whose world sizes divide it"
            )

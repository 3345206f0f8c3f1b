"""The balanced sampler and the dataset cache for grain's ``DataLoader``.

:class:`BalancedSampler` is a grain sampler over a
:class:`~bagua_common.data.balanced_plan.BalancedPlan`; :class:`CachedDataSource` wraps a grain
data source (anything with ``__len__`` and ``__getitem__``) in the node's dataset cache. Give
grain's ``DataLoader`` the plan's sharding and batch size, and each rank's batches are the plan's::

    plan = BalancedPlan(lengths, world_size=jax.process_count(), batch_size=32, drop_last=True)
    loader = grain.DataLoader(
        data_source=CachedDataSource(source, name="corpus", version="v1"),
        sampler=BalancedSampler(plan, num_epochs=10, worker_count=4),
        operations=[grain.Batch(plan.batch_size)],
        shard_options=grain.ShardByJaxProcess(),
        worker_count=4,
    )

grain is not a dependency of the package: ``pip install grain``.
"""

from __future__ import annotations

import sys

import numpy as np

from bagua_common.data.balanced_plan import BalancedPlan, EpochPlan
from bagua_common.data.cached_dataset import CachedDataset

try:
    from grain.python import RecordMetadata
except ImportError as e:
    raise ImportError("bagua_jax.grain_data needs grain: pip install grain") from e

__all__ = ["BalancedSampler", "CachedDataSource"]


class BalancedSampler:
    """A grain sampler yielding ``plan``'s epochs one after another, ``num_epochs`` of them (None: forever).

    grain deals global record ``k * world_size + rank`` to shard ``rank`` (``ShardOptions(rank,
    world_size)`` or ``ShardByJaxProcess()``), deals a shard's records round-robin to its
    ``worker_count`` worker processes, batches each worker's records and takes the workers'
    batches in turn. The sampler lays the records out so that the batches of shard ``r`` under
    ``grain.Batch(plan.batch_size)`` are rank ``r``'s steps of the plan, in order: give it the
    ``DataLoader``'s ``worker_count``. The plan must have a ``batch_size`` and whole steps
    (``drop_last=True``, or samples per rank a multiple of the batch size), since grain's batches
    are of one size and run on across epochs; and with ``num_epochs``, the steps of all epochs
    must share out evenly over the workers, so that no worker ends on part of a batch. Each record's
    ``rng`` is seeded from the plan's seed and the record's global index, as grain's own samplers
    do, for random transforms.
    """

    def __init__(self, plan: BalancedPlan, num_epochs: int | None = None, *, worker_count: int = 0) -> None:
        if plan.batch_size is None:
            raise ValueError("BalancedSampler needs a plan with batch_size (grain batches a fixed number of records)")
        if num_epochs is not None and (
            isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 1
        ):
            raise ValueError(f"num_epochs must be an int >= 1 or None, got {num_epochs!r}")
        if isinstance(worker_count, bool) or not isinstance(worker_count, int) or worker_count < 0:
            raise ValueError(f"worker_count must be an int >= 0 (the DataLoader's), got {worker_count!r}")
        self.plan, self.num_epochs, self.worker_count = plan, num_epochs, worker_count
        self._cached: tuple[int, EpochPlan] | None = None
        first = self._epoch(0)
        if any(len(step) != plan.batch_size for step in first.steps):
            raise ValueError(
                "the plan's epochs end with a short step, which grain.Batch would fill from the next epoch: "
                "plan with drop_last=True"
            )
        self.steps_per_epoch = first.num_steps
        if num_epochs is not None and num_epochs * self.steps_per_epoch % max(worker_count, 1):
            raise ValueError(
                f"{num_epochs} epochs of {self.steps_per_epoch} steps do not share out evenly over {worker_count} "
                "workers: grain would end a worker's stream on part of a batch; choose num_epochs to make them"
            )

    def _epoch(self, epoch: int) -> EpochPlan:
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self.plan.epoch(epoch))
        return self._cached[1]

    def __len__(self) -> int:
        per_epoch = self.steps_per_epoch * self.plan.batch_size * self.plan.world_size
        return sys.maxsize if self.num_epochs is None else self.num_epochs * per_epoch

    def __getitem__(self, index: int) -> RecordMetadata:
        """Return the record at global position ``index``."""
        if index < 0 or index >= len(self):
            raise IndexError(f"record {index} is out of range [0, {len(self)})")
        position, rank = divmod(index, self.plan.world_size)  # the shard's position-th record
        in_worker, worker = divmod(position, max(self.worker_count, 1))
        batch, row = divmod(in_worker, self.plan.batch_size)  # the worker's batch-th batch
        epoch, step = divmod(batch * max(self.worker_count, 1) + worker, self.steps_per_epoch)
        rng = np.random.Generator(np.random.Philox(key=self.plan.seed + index))
        return RecordMetadata(index=index, record_key=int(self._epoch(epoch).batch(rank, step)[row]), rng=rng)

    def __repr__(self) -> str:
        # grain compares this text when it restores a checkpoint: the same plan gives the same text.
        return (
            f"BalancedSampler(plan={self.plan.fingerprint().hex()}, num_epochs={self.num_epochs}, "
            f"worker_count={self.worker_count})"
        )


class CachedDataSource(CachedDataset):
    """A grain data source reading ``source`` through the node's dataset cache.

    Every argument is :class:`~bagua_common.data.cached_dataset.CachedDataset`'s; grain's
    worker processes share the cache (the default store is the node's LMDB environment for
    ``name`` and ``version``), so a record any process of the node has read is read once.
    """

    def __repr__(self) -> str:
        # grain records this text in checkpoints: name and version, never an address.
        return f"CachedDataSource(name={self.loader.name!r}, version={self.loader.version!r})"

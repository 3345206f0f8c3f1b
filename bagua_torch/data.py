"""Load-balanced samplers for ``torch.utils.data.DataLoader``, over :mod:`bagua_common`.

:class:`LoadBalancingDistributedSampler` keeps Bagua's signature and yields this rank's sample
indices; :class:`BalancedBatchSampler` yields this rank's batches for
``DataLoader(batch_sampler=...)``. Both plan with :class:`bagua_common.data.balanced_plan.BalancedPlan`,
so every rank gets the same number of samples and steps, a fresh sample set each epoch, and
samples of similar cost at each step. Do not wrap them in another sharding sampler (for
example ``accelerate``'s): they already shard. :class:`CachedDataset` (framework-neutral,
re-exported here) works under ``DataLoader`` workers with fork and spawn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence, Sized

import numpy as np
import torch.distributed
from torch.utils.data import Sampler

from bagua_common.data.balanced_plan import BalancedPlan, EpochPlan
from bagua_common.data.cached_dataset import CachedDataset, CacheLoader
from bagua_torch import job

__all__ = [
    "BalancedBatchSampler",
    "CacheLoader",
    "CachedDataset",
    "LoadBalancingDistributedSampler",
]


def _replicas_and_rank(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    if num_replicas is None or rank is None:
        if job.is_initialized():
            group = job.get_process_group()
            size, mine = group.size, group.rank
        elif torch.distributed.is_available() and torch.distributed.is_initialized():
            size, mine = (
                torch.distributed.get_world_size(),
                torch.distributed.get_rank(),
            )
        else:
            raise ValueError("num_replicas and rank are needed when no process group is initialized")
        num_replicas = size if num_replicas is None else num_replicas
        rank = mine if rank is None else rank
    if isinstance(num_replicas, bool) or not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an int >= 1, got {num_replicas!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be an int in [0, {num_replicas}), got {rank!r}")
    return num_replicas, rank


class _PlannedSampler:
    """The epoch and resume position shared by both samplers."""

    plan: BalancedPlan
    rank: int

    def _start(self) -> None:
        self.epoch = 0
        self.step = 0
        self._cached: tuple[int, EpochPlan] | None = None

    def _epoch_plan(self) -> EpochPlan:
        if self._cached is None or self._cached[0] != self.epoch:
            self._cached = (self.epoch, self.plan.epoch(self.epoch))
        return self._cached[1]

    def set_epoch(self, epoch: int, step: int = 0) -> None:
        """Plan epoch ``epoch``; iteration starts at ``step`` (to resume mid-epoch)."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        self.epoch, self.step = epoch, step

    def state_dict(self) -> dict[str, int]:
        """Return ``{"epoch", "step"}``: the items yielded so far of an unfinished epoch.

        A ``DataLoader`` prefetches, so when resuming from a checkpoint prefer the number of
        steps the training loop consumed: ``set_epoch(epoch, step=consumed)``.
        """
        return {"epoch": self.epoch, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume from :meth:`state_dict`: the next iteration yields the same remaining items."""
        self.set_epoch(state["epoch"], state["step"])


class LoadBalancingDistributedSampler(_PlannedSampler, Sampler[int]):
    """Bagua's load-balancing sampler: this rank's indices, one per cost group.

    ``complexity_fn(index)`` gives a sample's cost and is called once per index on first use
    (unlike Bagua's, it takes the index, never the decoded sample); or pass ``costs`` directly.
    ``random_level`` jitters the cost sort by up to that fraction. With ``drop_last`` a random,
    cost-representative remainder is dropped; otherwise random samples are repeated so every
    rank gets ``ceil(len(dataset) / num_replicas)`` indices.
    """

    def __init__(
        self,
        dataset: Sized,
        complexity_fn: Callable[[int], float] | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        random_level: float = 0.0,
        *,
        costs: Sequence[float] | np.ndarray | None = None,
    ) -> None:
        self.num_replicas, self.rank = _replicas_and_rank(num_replicas, rank)
        if costs is not None and len(costs) != len(dataset):
            raise ValueError(f"{len(costs)} costs given for a dataset of {len(dataset)} samples")
        self.plan = BalancedPlan(
            costs,
            world_size=self.num_replicas,
            cost_fn=complexity_fn,
            num_samples=len(dataset),
            batch_size=1,
            seed=seed,
            shuffle=shuffle,
            jitter=random_level,
            drop_last=drop_last,
        )
        self._start()

    def __iter__(self) -> Iterator[int]:
        indices = self._epoch_plan().rank_indices(self.rank)
        while self.step < len(indices):
            self.step += 1
            yield int(indices[self.step - 1])
        self.step = 0

    def __len__(self) -> int:
        n, w = self.plan.num_samples, self.num_replicas
        return n // w if self.plan.drop_last else -(-n // w)


class BalancedBatchSampler(_PlannedSampler, Sampler[list[int]]):
    """This rank's batches for ``DataLoader(batch_sampler=...)``, equal in count on every rank.

    Steps hold ``batch_size`` samples per rank, or as many as fit ``token_budget`` of padded
    cost per rank (samples times the step's largest cost); ``megabatch`` sorts chunks of that
    many cost groups to cut padding. Costs come from ``costs`` or a lazy ``cost_fn(index)``
    with ``num_samples``.
    """

    def __init__(
        self,
        costs: Sequence[float] | np.ndarray | None = None,
        *,
        cost_fn: Callable[[int], float] | None = None,
        num_samples: int | None = None,
        batch_size: int | None = None,
        token_budget: float | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        megabatch: int | None = None,
        drop_last: bool = False,
    ) -> None:
        self.num_replicas, self.rank = _replicas_and_rank(num_replicas, rank)
        self.plan = BalancedPlan(
            costs,
            world_size=self.num_replicas,
            cost_fn=cost_fn,
            num_samples=num_samples,
            batch_size=batch_size,
            token_budget=token_budget,
            seed=seed,
            shuffle=shuffle,
            megabatch=megabatch,
            drop_last=drop_last,
        )
        self._start()

    def __iter__(self) -> Iterator[list[int]]:
        plan = self._epoch_plan()
        while self.step < plan.num_steps:
            self.step += 1
            yield plan.batch(self.rank, self.step - 1).tolist()
        self.step = 0

    def __len__(self) -> int:
        return self._epoch_plan().num_steps

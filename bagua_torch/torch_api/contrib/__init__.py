"""Bagua's ``bagua.torch_api.contrib``, mapped onto the project's own features.

* :func:`fuse_optimizer`: :func:`bagua_torch.fuse_optimizer` (a wrapper; Bagua patched the
  optimizer in place) with Bagua's ``fuse_step()``. Use the returned optimizer:
  ``optimizer = fuse_optimizer(optimizer)``, as Bagua's examples do.
* :class:`LoadBalancingDistributedSampler`: :class:`bagua_torch.data.LoadBalancingDistributedSampler`
  (``complexity_fn`` takes the index, not the decoded sample), and
  :class:`LoadBalancingDistributedBatchSampler` over it with Bagua's ``batch_fn``.
* :class:`CachedDataset` / :class:`CacheLoader`: :mod:`bagua_common.data.cached_dataset` with Bagua's
  arguments. ``backend`` is the store the job configured (an LMDB directory private to the job
  by default, or the launcher's ``--cache-server redis``); Bagua's Redis host options are refused,
  since a cache of pickles must not be shared with writers outside the job.
* ``sync_batchnorm.SyncBatchNorm``: torch's ``torch.nn.SyncBatchNorm`` (CUDA tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from bagua_common.data import cached_dataset as _cached
from bagua_torch.data import LoadBalancingDistributedSampler
from bagua_torch.fused_optimizer import FusedOptimizer
from bagua_torch.torch_api import distributed as _compat
from bagua_torch.torch_api.contrib import sync_batchnorm

__all__ = [
    "CacheLoader",
    "CachedDataset",
    "LoadBalancingDistributedBatchSampler",
    "LoadBalancingDistributedSampler",
    "fuse_optimizer",
    "sync_batchnorm",
]


class _BaguaFusedOptimizer(FusedOptimizer):
    """:class:`bagua_torch.FusedOptimizer` with Bagua's ``fuse_step``."""

    def fuse_step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Bagua's name for :meth:`step`."""
        return self.step(closure)


def fuse_optimizer(
    optimizer: torch.optim.Optimizer, do_flatten: bool = True, check_flatten: bool = True
) -> FusedOptimizer:
    """The fused optimizer for ``optimizer`` (see :mod:`bagua_torch.fused_optimizer`); step it with ``fuse_step()``.

    When a wrapped model (``with_bagua``) holds ``optimizer``, its algorithm's step hooks move to
    the fused optimizer, so weight-communicating algorithms keep running. ``do_flatten`` and
    ``check_flatten`` are Bagua's and have no effect (the layout is always flat, and always checked).
    """
    fused = _BaguaFusedOptimizer(optimizer)
    for wrapper in list(_compat._active.values()):
        if any(opt is optimizer for opt in wrapper.optimizers):
            impl = wrapper.algorithm_impl

            def before(opt: Any, args: Any, kwargs: Any, wrapper: Any = wrapper, impl: Any = impl) -> None:
                wrapper.wait_gradients()
                impl.before_step(optimizer)

            def after(opt: Any, args: Any, kwargs: Any, impl: Any = impl) -> None:
                impl.after_step(optimizer)

            fused.register_step_pre_hook(before)
            fused.register_step_post_hook(after)
    return fused


class LoadBalancingDistributedBatchSampler(torch.utils.data.Sampler):
    """Bagua's batch sampler: ``batch_fn(indices) -> list of batches`` over each rank's balanced indices.

    Every rank yields the same number of batches: with ``drop_last`` the ranks' extra batches
    are dropped, otherwise the shorter ranks repeat their first batches.
    """

    def __init__(
        self,
        sampler: LoadBalancingDistributedSampler,
        batch_fn: Callable[[list[int]], list[list[int]]],
        drop_last: bool = False,
    ):
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise ValueError("sampler should be of LoadBalancingDistributedSampler type.")
        if sampler.plan.drop_last:
            raise ValueError("drop_last of sampler should be False")
        self.sampler = sampler
        self.batch_fn = batch_fn
        self.drop_last = drop_last

    def _batches(self) -> list[list[int]]:
        plan = self.sampler.plan.epoch(self.sampler.epoch)
        per_rank = [self.batch_fn([int(i) for i in plan.rank_indices(r)]) for r in range(self.sampler.num_replicas)]
        counts = [len(b) for b in per_rank]
        mine = per_rank[self.sampler.rank]
        target = min(counts) if self.drop_last else max(counts)
        if not mine:
            return []
        return (mine * (-(-target // len(mine))))[:target]

    def set_epoch(self, epoch: int) -> None:
        """Plan epoch ``epoch`` (call it before each epoch, as with the sampler)."""
        self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


def _store_options(backend: str, kwargs: dict[str, Any]) -> None:
    if backend not in ("redis", "lmdb", "memory", None):
        raise ValueError(f"backend must be 'redis', 'lmdb' or 'memory', got {backend!r}")
    if kwargs:
        raise TypeError(
            f"store options {sorted(kwargs)} are not taken: the cache uses the store the job configured (an LMDB "
            "directory private to the job, or bagua-launch --cache-server redis); see bagua_common.data.cache_stores"
        )


def CachedDataset(  # noqa: N802 (Bagua's class name)
    dataset: Any, backend: str = "redis", dataset_name: str = "", writer_buffer_size: int = 20, **kwargs: Any
) -> _cached.CachedDataset:
    """Bagua's ``CachedDataset(dataset, backend, dataset_name, writer_buffer_size)``: each sample cached on first read."""
    _store_options(backend, kwargs)
    return _cached.CachedDataset(dataset, name=dataset_name or "dataset")


def CacheLoader(  # noqa: N802 (Bagua's class name)
    backend: str = "redis", dataset_name: str = "", writer_buffer_size: int = 1, **kwargs: Any
) -> _cached.CacheLoader:
    """Bagua's ``CacheLoader``: ``get(key, load_fn)`` caches ``load_fn(key)`` under ``key``."""
    _store_options(backend, kwargs)
    return _cached.CacheLoader(None, name=dataset_name or "cache")

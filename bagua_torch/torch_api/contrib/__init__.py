"""Bagua's ``bagua.torch_api.contrib``, mapped onto the project's own features.

* :func:`fuse_optimizer`: :func:`bagua_torch.fuse_optimizer` (a wrapper; Bagua patched the
  optimizer in place) with Bagua's ``fuse_step()``. Use the returned optimizer:
  ``optimizer = fuse_optimizer(optimizer)``, as Bagua's examples do.
* :class:`LoadBalancingDistributedSampler`: :class:`bagua_torch.data.LoadBalancingDistributedSampler`
  (``complexity_fn`` takes the index, not the decoded sample), and
  :class:`LoadBalancingDistributedBatchSampler` over it with Bagua's ``batch_fn``.
* :class:`CachedDataset` / :class:`CacheLoader`: :mod:`bagua_common.data.cached_dataset` with
  Bagua's arguments. ``backend="redis"`` (the default, as in Bagua) is the server of
  ``bagua-launch --cache-server redis``, or else, where ``redis-server`` is installed, a private
  one per node that the node's first rank starts for the job (a unix socket only, gone with the
  job), as Bagua started its own; ``"lmdb"`` is the node's LMDB cache. Both are shared by every
  dataset of the job, so they need a ``dataset_name``. Bagua's Redis host options are refused:
  the cache's values are signed with the job's own key, and its servers are the job's own.
* ``sync_batchnorm.SyncBatchNorm``: torch's ``torch.nn.SyncBatchNorm`` (CUDA tensors).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from bagua_common.data import cache_stores as _stores
from bagua_common.data import cached_dataset as _cached
from bagua_common.data import redis_server as _redis
from bagua_torch import job
from bagua_torch.data import LoadBalancingDistributedSampler
from bagua_torch.fused_optimizer import FusedOptimizer
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

    When a wrapped model (``with_bagua``) holds ``optimizer``, the fused optimizer steps in its place
    there (:meth:`bagua_torch.BaguaModule.replace_optimizer`), so every algorithm keeps running. ``do_flatten``
    and ``check_flatten`` are Bagua's and have no effect (the layout is always flat, and always checked).
    """
    return _BaguaFusedOptimizer(optimizer)


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


def _store(backend: str, dataset_name: str, version: str, kwargs: dict[str, Any]) -> _stores.Store:
    """The store ``backend`` names: the job's Redis server, the node's LMDB cache, or per-process memory."""
    if kwargs:
        raise TypeError(
            f"store options {sorted(kwargs)} are not taken: the cache uses the stores the job configured (the "
            "node's LMDB cache, or bagua-launch --cache-server redis); see bagua_common.data.cache_stores"
        )
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {sorted(_BACKENDS)}, got {backend!r}")
    if backend != "memory" and not dataset_name:
        raise ValueError(
            f"dataset_name is required with backend={backend!r}: the store is shared by every dataset of the "
            "job, and unnamed datasets would read each other's samples"
        )
    return _BACKENDS[backend](dataset_name, version)


def _job_redis_store() -> _stores.RedisStore:
    """The launcher's server (``bagua-launch --cache-server redis``), else a private one per node started here, as
    Bagua did: the node's first rank starts it (:func:`bagua_common.data.redis_server.node_redis_store`)."""
    if os.environ.get(_stores.ENV_CACHE_URL, "").strip():
        return _stores.redis_store_from_environment()
    try:
        _redis.find_redis_server()
    except FileNotFoundError:
        raise ValueError(
            "backend='redis' needs a Redis server: install redis-server (apt-get install redis-server) and the job "
            "starts a private one per node, or start the job with bagua-launch --cache-server redis; "
            "backend='lmdb' is the node's LMDB cache, with no server"
        ) from None
    if not job.is_initialized():
        return _redis.node_redis_store(None)
    group = job.get_process_group()

    def allgather(x: np.ndarray) -> np.ndarray:
        return group.world.allgather(torch.from_numpy(x).to(group.device)).cpu().numpy()

    return _redis.node_redis_store(allgather if group.size > 1 else None, group.rank, group.local_size)


_BACKENDS: dict[str, Callable[[str, str], _stores.Store]] = {
    "redis": lambda name, version: _job_redis_store(),
    "lmdb": _stores.node_lmdb_store,
    "memory": lambda name, version: _stores.MemoryStore(),
}


def CachedDataset(  # noqa: N802 (Bagua's class name)
    dataset: Any, backend: str = "redis", dataset_name: str = "", writer_buffer_size: int = 20, **kwargs: Any
) -> _cached.CachedDataset:
    """Bagua's ``CachedDataset(dataset, backend, dataset_name, writer_buffer_size)``: each sample cached on first read.

    ``backend`` is ``"redis"`` (the server of ``bagua-launch --cache-server redis``, else a private
    one per node started for the job: see the module docstring), ``"lmdb"`` (the node's LMDB cache)
    or ``"memory"`` (per process). With ``"redis"`` the first call is collective when the job is
    initialized (every rank calls it at the same point). ``writer_buffer_size`` has no effect:
    values are written through as they are read.
    """
    name = dataset_name or "dataset"
    return _cached.CachedDataset(dataset, _store(backend, dataset_name, "", kwargs), name=name)


def CacheLoader(  # noqa: N802 (Bagua's class name)
    backend: str = "redis", dataset_name: str = "", writer_buffer_size: int = 1, **kwargs: Any
) -> _cached.CacheLoader:
    """Bagua's ``CacheLoader``: ``get(key, load_fn)`` caches ``load_fn(key)`` under ``key``, in ``backend`` as for
    :func:`CachedDataset`."""
    return _cached.CacheLoader(_store(backend, dataset_name, "", kwargs), name=dataset_name or "cache")

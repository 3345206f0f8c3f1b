"""Bagua's ``contrib`` spellings (``bagua_torch.torch_api.contrib``), in one process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import redis
import torch
from fresh_interpreter import source_tree_env

from bagua_common.data.cache_stores import LmdbStore, MemoryStore
from bagua_common.data.redis_server import RedisServer
from bagua_common.job.local_launch import free_port
from bagua_torch.torch_api import contrib


def test_batch_sampler_gives_every_rank_the_same_number_of_batches_of_its_own_samples():
    dataset = list(range(37))
    costs = [float((7 * i) % 11 + 1) for i in range(37)]

    def batch_fn(indices):  # multiples of 3 alone, the rest in fives: the number of batches differs between ranks
        alone = [[i] for i in indices if i % 3 == 0]
        rest = [i for i in indices if i % 3]
        return alone + [rest[k : k + 5] for k in range(0, len(rest), 5)]

    for drop_last in (False, True):
        per_rank, own = [], []
        for rank in range(3):
            sampler = contrib.LoadBalancingDistributedSampler(
                dataset, complexity_fn=lambda i: costs[i], num_replicas=3, rank=rank
            )
            batches = contrib.LoadBalancingDistributedBatchSampler(sampler, batch_fn, drop_last=drop_last)
            batches.set_epoch(2)
            sampler.set_epoch(2)
            mine = list(sampler)
            own.append(len(batch_fn(mine)))
            got = list(batches)
            assert len(got) == len(batches)
            assert all(i in mine for batch in got for i in batch)
            per_rank.append(got)
        lengths = {len(b) for b in per_rank}
        assert len(lengths) == 1, lengths
        expected = min if drop_last else max
        assert len(set(own)) > 1, own  # the ranks' own batch counts differ: padding or dropping was needed
        assert lengths.pop() == expected(own)


def test_batch_sampler_refuses_what_bagua_refused():
    with pytest.raises(ValueError, match="LoadBalancingDistributedSampler"):
        contrib.LoadBalancingDistributedBatchSampler(list(range(4)), lambda i: [i])
    sampler = contrib.LoadBalancingDistributedSampler(list(range(8)), float, num_replicas=2, rank=0, drop_last=True)
    with pytest.raises(ValueError, match="drop_last"):
        contrib.LoadBalancingDistributedBatchSampler(sampler, lambda i: [i])


class Slow(torch.utils.data.Dataset):
    def __init__(self):
        self.reads = []

    def __len__(self):
        return 5

    def __getitem__(self, i):
        self.reads.append(i)
        return i * 10


@pytest.mark.parametrize("backend", ["lmdb", "memory"])
def test_cached_dataset_and_cache_loader_read_through_once(backend, tmp_path, monkeypatch):
    monkeypatch.delenv("BAGUA_CACHE_URL", raising=False)
    monkeypatch.setenv("BAGUA_CACHE_DIR", str(tmp_path))
    slow = Slow()
    cached = contrib.CachedDataset(slow, backend=backend, dataset_name="slow")
    assert slow.reads == [0, 1, 2, 3, 4]  # the dataset's fingerprint reads up to 8 items
    assert [cached[i] for i in range(5)] == [0, 10, 20, 30, 40]
    assert [cached[i] for i in range(5)] == [0, 10, 20, 30, 40]
    assert slow.reads == [0, 1, 2, 3, 4] * 2
    loader = contrib.CacheLoader(backend=backend, dataset_name="squares")
    calls = []
    assert [loader.get(k, lambda k: calls.append(k) or k * k) for k in (3, 4, 3)] == [9, 16, 9]
    assert calls == [3, 4]
    again = Slow()
    cached_again = contrib.CachedDataset(again, backend=backend, dataset_name="slow")
    assert [cached_again[i] for i in range(5)] == [0, 10, 20, 30, 40]
    assert again.reads == [0, 1, 2, 3, 4] * (1 if backend == "lmdb" else 2)  # the node's cache, or this one's own
    assert len(os.listdir(tmp_path)) == (2 if backend == "lmdb" else 0)  # one environment per dataset


def test_backend_is_honoured_and_a_shared_store_needs_a_name(tmp_path, monkeypatch):
    monkeypatch.delenv("BAGUA_CACHE_URL", raising=False)
    monkeypatch.setenv("BAGUA_CACHE_DIR", str(tmp_path))
    for backend in ("redis", "lmdb"):
        with pytest.raises(ValueError, match="dataset_name is required"):
            contrib.CachedDataset(Slow(), backend=backend)
        with pytest.raises(ValueError, match="dataset_name is required"):
            contrib.CacheLoader(backend=backend)
    assert isinstance(contrib.CachedDataset(Slow(), backend="lmdb", dataset_name="a").loader.store, LmdbStore)
    assert isinstance(contrib.CachedDataset(Slow(), backend="memory").loader.store, MemoryStore)
    with pytest.raises(ValueError, match="backend must be one of"):
        contrib.CachedDataset(Slow(), backend="sqlite", dataset_name="a")
    with pytest.raises(TypeError, match="store options"):
        contrib.CachedDataset(Slow(), backend="redis", hosts=[{"host": "example.org", "port": 6379}])


def test_sync_batchnorm_converts_every_batchnorm_layer():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.BatchNorm1d(3))
    converted = contrib.sync_batchnorm.SyncBatchNorm.convert_sync_batchnorm(model)
    assert [type(m).__name__ for m in converted] == ["Conv2d", "SyncBatchNorm", "SyncBatchNorm"]


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # starting the server forks; JAX may be loaded
def test_redis_backend_is_the_jobs_server(monkeypatch):
    with RedisServer(1 << 24) as server:
        for name, value in server.environment().items():
            monkeypatch.setenv(name, value)
        slow = Slow()
        cached = contrib.CachedDataset(slow, backend="redis", dataset_name="slow")
        assert cached.loader.store.urls == [server.url]
        assert [cached[i] for i in (1, 2, 1)] == [10, 20, 10] and slow.reads == [0, 1, 2, 3, 4, 1, 2]
        assert len(redis.Redis.from_url(server.url).keys("*")) == 2


def test_redis_backend_without_redis_server_names_both_remedies(monkeypatch):
    monkeypatch.delenv("BAGUA_CACHE_URL", raising=False)
    monkeypatch.setenv("BAGUA_REDIS_SERVER", "/nonexistent/redis-server")
    with pytest.raises(ValueError, match="apt-get install redis-server.*bagua-launch --cache-server redis"):
        contrib.CachedDataset(Slow(), backend="redis", dataset_name="slow")


NODE_JOB = """
import json, os, sys
import torch.distributed as dist
import bagua_torch.torch_api as bagua
from bagua_torch.torch_api import contrib
from bagua_common.data import redis_server

class Squares:
    def __init__(self): self.reads = 0
    def __len__(self): return 20
    def __getitem__(self, i):
        self.reads += 1
        return i * i

bagua.init_process_group()
rank = bagua.get_rank()
squares = Squares()
cached = contrib.CachedDataset(squares, backend="redis", dataset_name="squares")  # Bagua's default backend
fingerprint_reads = squares.reads
mine = range(rank * 10, rank * 10 + 10)
values = [cached[i] for i in mine]
dist.barrier()
theirs = [cached[i] for i in range(20) if i not in mine]
server = redis_server._node_server
print(json.dumps({
    "rank": rank, "url": cached.loader.store.urls[0], "values": values + theirs,
    "reads": squares.reads - fingerprint_reads, "pid": server.pid if server else None,
    "directory": server.directory if server else None,
}))
dist.barrier()
"""


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_redis_backend_starts_a_private_server_per_node_for_the_job(tmp_path):
    """Bagua's default backend outside bagua-launch: the node's first rank starts one redis-server on a private
    unix socket (no TCP port), every rank of the node uses it (rank 1 reads what rank 0 wrote), and it is gone,
    its directory with it, when the job ends."""
    env = source_tree_env() | {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(free_port())
    env.pop("BAGUA_CACHE_URL", None)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", NODE_JOB],
            env=env | {"RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    first, second = (json.loads(out.strip().splitlines()[-1]) for out, _ in outputs)
    assert first["url"] == second["url"] == f"unix://{first['directory']}/redis.sock"
    assert second["pid"] is None and first["pid"] is not None  # one server, started by the node's first rank
    assert first["values"] == [i * i for i in range(20)] and second["values"] == [i * i for i in range(10, 20)] + [
        i * i for i in range(10)
    ]
    assert first["reads"] == 10 and second["reads"] == 10  # each read its half; the other half came from the cache
    assert not os.path.exists(first["directory"])
    assert not os.path.exists(f"/proc/{first['pid']}") or "redis" not in open(f"/proc/{first['pid']}/cmdline").read()

"""The cached dataset over each store: hits, misses, versions, corruption, failures, capacity."""

import os
import pickle
import stat
import subprocess
import sys
import tempfile
import threading
import warnings

import fakeredis
import numpy as np
import pytest
from cache_datasets import CountingDataset, reads

from bagua_common.data import cache_stores
from bagua_common.data.cache_stores import (
    LmdbStore,
    MemoryStore,
    RedisStore,
    parse_capacity,
    shard_of,
)
from bagua_common.data.cached_dataset import CachedDataset, CacheLoader, fingerprint_positions
from bagua_common.data.private_files import job_directory, private_directory
from bagua_common.job.message_tag import message_tag


@pytest.fixture
def fake_server(monkeypatch):
    server = fakeredis.FakeServer()
    monkeypatch.setattr(
        cache_stores,
        "connect_redis",
        lambda url, pw, t: fakeredis.FakeRedis(server=server),
    )
    return server


@pytest.fixture(params=["memory", "lmdb", "redis"])
def store(request, tmp_path):
    if request.param == "memory":
        return MemoryStore(capacity_bytes=1 << 20)
    if request.param == "lmdb":
        return LmdbStore(str(tmp_path / "lmdb"), capacity_bytes=1 << 24)
    request.getfixturevalue("fake_server")
    return RedisStore(["redis://a", "redis://b"], digest_key=os.urandom(32))


def expected(index):
    return np.random.default_rng(index).standard_normal(64).astype(np.float32)


def test_second_pass_hits_and_returns_the_same_samples(store, tmp_path):
    log = str(tmp_path / "reads")
    data = CachedDataset(CountingDataset(20, log), store, name="counting")
    for _ in range(2):
        for i in range(20):
            np.testing.assert_array_equal(data[i], expected(i))
    assert reads(log) == len(fingerprint_positions(20)) + 20  # the fingerprint's reads, then each sample once
    stats = data.stats()
    assert (stats["hits"], stats["misses"], stats["puts"], stats["errors"]) == (
        20,
        20,
        20,
        0,
    )
    assert stats["bytes"] >= 20 * 64 * 4
    np.testing.assert_array_equal(data[-1], expected(19))
    with pytest.raises(IndexError):
        data[20]
    with pytest.raises(TypeError):
        data[1.0]


def test_loader_threads_open_a_new_lmdb_store_at_once(tmp_path):
    """grain's and torch's loader threads read a store at once: the first reads open one environment, no error
    (LMDB refuses a second open of the same path in one process; unguarded, 8 threads hit that 2 trials in 3)."""
    for trial in range(10):
        store = LmdbStore(str(tmp_path / f"lmdb{trial}"), capacity_bytes=1 << 24)
        barrier, errors = threading.Barrier(8), []

        def read() -> None:
            barrier.wait()
            try:
                assert store.get(b"absent") is None
            except Exception as error:  # collected, reported below
                errors.append(error)

        threads = [threading.Thread(target=read) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors


def test_version_name_and_dataset_change_invalidate(tmp_path):
    store = LmdbStore(str(tmp_path / "lmdb"), capacity_bytes=1 << 24)
    log = str(tmp_path / "reads")

    def misses(n: int = 5, **scope: str) -> int:
        data = CachedDataset(CountingDataset(n, log), store, **scope)
        data[0]
        return data.stats()["misses"]

    assert misses(name="a") == 1 and misses(name="a") == 0
    assert misses(name="a", version="2") == 1 and misses(name="b") == 1 and misses(6, name="a") == 1
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        CachedDataset(CountingDataset(5, log), store, name="")
    with pytest.raises(ValueError, match="on_error"):
        CachedDataset(CountingDataset(5, log), store, name="a", on_error="ignore")


def test_transform_runs_after_the_cache(tmp_path):
    store = MemoryStore(1 << 20)
    data = CachedDataset(
        CountingDataset(3, str(tmp_path / "r")),
        store,
        name="t",
        transform=lambda x: x * 2,
    )
    np.testing.assert_array_equal(data[1], 2 * expected(1))
    np.testing.assert_array_equal(data[1], 2 * expected(1))
    assert data.stats()["hits"] == 1


def test_unreadable_signed_value_is_a_miss_warned_once_and_overwritten(tmp_path):
    store = MemoryStore(1 << 20)
    data = CachedDataset(CountingDataset(3, str(tmp_path / "r")), store, name="c")
    for i in range(3):
        payload = b"not a pickle"
        key = data.loader.key(i)
        tag = message_tag(store.digest_key, b"bagua-cache", b"\x03", key, payload, size=16)
        store.put(key, b"\x03" + tag + payload)
    with pytest.warns(RuntimeWarning, match="does not unpickle") as caught:
        values = [data[i] for i in range(3)]
    assert len(caught) == 1
    for i, v in enumerate(values):
        np.testing.assert_array_equal(v, expected(i))
    np.testing.assert_array_equal(data[2], expected(2))
    assert data.stats()["misses"] == 3 and data.stats()["hits"] == 1 and data.stats()["damaged"] == 0
    strict = CachedDataset(CountingDataset(3, str(tmp_path / "r")), store, name="d", on_error="raise")
    store.put(strict.loader.key(0), b"\x02other")
    with pytest.raises(ValueError, match="fails its digest check"):
        strict[0]


def test_store_that_dies_mid_epoch_falls_back_to_the_dataset(fake_server, tmp_path):
    store = RedisStore("redis://x", digest_key=os.urandom(32))
    data = CachedDataset(CountingDataset(10, str(tmp_path / "r")), store, name="d")
    for i in range(5):
        data[i]
    fake_server.connected = False
    with pytest.warns(RuntimeWarning, match="cache store get failed") as caught:
        values = [data[i] for i in range(10)]
    assert len(caught) == 1
    for i, v in enumerate(values):
        np.testing.assert_array_equal(v, expected(i))
    assert data.stats()["errors"] >= 10
    strict = CachedDataset(
        CountingDataset(10, str(tmp_path / "r")),
        data.loader.store,
        name="d",
        on_error="raise",
    )
    with pytest.raises(Exception, match="onnect"):
        strict[0]


def test_unreachable_redis_raises_naming_the_url():
    with pytest.raises(ConnectionError, match="unix:///nonexistent/redis.sock"):
        RedisStore("unix:///nonexistent/redis.sock", timeout_s=1.0, digest_key=os.urandom(32))


@pytest.mark.parametrize("kind", ["memory", "lmdb"])
def test_full_store_stops_admitting_and_keeps_what_it_has(kind, tmp_path):
    sample_bytes = 64 * 4 + 200
    if kind == "memory":
        store = MemoryStore(capacity_bytes=10 * sample_bytes)
    else:
        store = LmdbStore(str(tmp_path / "lmdb"), capacity_bytes=64 * 1024)
    log = str(tmp_path / "reads")
    data = CachedDataset(CountingDataset(400, log, size=64), store, name="full")
    for i in range(400):
        data[i]
    stats = data.stats()
    assert stats["rejected"] > 0 and stats["puts"] > 0 and stats["puts"] + stats["rejected"] == 400
    before = reads(log)
    for i in range(400):
        np.testing.assert_array_equal(data[i], expected(i))
    # Fill, then stop writing: everything admitted is still served.
    assert reads(log) - before == 400 - stats["puts"]


def test_cache_loader_get_spelling():
    loader = CacheLoader(MemoryStore(1 << 20), "bagua-style")
    calls = []
    load = lambda k: calls.append(k) or f"value of {k}"
    assert loader.get("x", load) == "value of x" and loader.get("x", load) == "value of x"
    assert calls == ["x"]


def test_stores_pickle_as_configuration(tmp_path, fake_server):
    lmdb_store = LmdbStore(str(tmp_path / "lmdb"), capacity_bytes=1 << 24)
    lmdb_store.put(b"k", b"v")
    assert pickle.loads(pickle.dumps(lmdb_store)).get(b"k") == b"v"
    redis_store = RedisStore("redis://x", digest_key=os.urandom(32))
    assert set(pickle.loads(pickle.dumps(redis_store)).__dict__) >= {"urls", "passwords"}
    memory = MemoryStore(1 << 20)
    memory.put(b"k", b"v")
    assert len(pickle.dumps(memory)) < 200


def run_python(script: str, **env: str) -> str:
    env = os.environ | {"PYTHONPATH": os.getcwd()} | env
    return subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=True,
    ).stdout


def test_memory_store_warns_in_another_process():
    script = (
        "import os, pickle, sys, warnings; from bagua_common.data.cache_stores import MemoryStore;"
        "s = MemoryStore(1 << 20); s._owner = -1; warnings.simplefilter('error');"
        "\ntry:\n s.get(b'k')\nexcept RuntimeWarning as e: print(e)"
    )
    assert "per process" in run_python(script)


def test_private_directory_rules(tmp_path):
    made = private_directory(str(tmp_path / "new"))
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(ValueError, match="not writable by others"):
        private_directory(str(open_dir))
    (tmp_path / "link").symlink_to(made)
    with pytest.raises(ValueError, match="not a link"):
        private_directory(str(tmp_path / "link"))


def test_capacity_parsing_and_validation():
    assert parse_capacity("8M") == 8 << 20 and parse_capacity("1GiB") == 1 << 30
    assert parse_capacity("4096") == 4096
    for bad in ["lots", "0", "-1G", "1000000T"]:
        with pytest.raises(ValueError, match="capacity"):
            parse_capacity(bad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert MemoryStore().capacity_bytes > 0


def test_shard_of_is_stable_across_processes_and_spreads_keys():
    keys = [f"bg1:x:{i}".encode() for i in range(1000)]
    here = [shard_of(k, 3) for k in keys]
    script = (
        "from bagua_common.data.cache_stores import shard_of;"
        "print([shard_of(f'bg1:x:{i}'.encode(), 3) for i in range(1000)])"
    )
    assert eval(run_python(script, PYTHONHASHSEED="123")) == here
    assert min(np.bincount(here)) > 250


def test_default_store_is_one_lmdb_environment_per_dataset_in_the_node_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(cache_stores.ENV_CACHE_URL, raising=False)
    monkeypatch.setenv(cache_stores.ENV_CACHE_DIR, str(tmp_path / "job"))
    log = str(tmp_path / "reads")

    def path(name, version="", n=4):
        return CachedDataset(CountingDataset(n, log), name=name, version=version).loader.store.path

    assert path("a") == path("a") == path("a", n=5) != path("b")  # a changed dataset: its fingerprint tells it apart
    assert len({path("a"), path("a", "2"), path("b"), path("a/../b")}) == 4
    assert {os.path.dirname(p) for p in (path("a"), path("a/../b"))} == {str(tmp_path / "job")}
    assert all(stat.S_IMODE(os.stat(p).st_mode) == 0o700 for p in (tmp_path / "job", path("a")))
    first = CachedDataset(CountingDataset(4, log), name="a")
    first[0]
    again = CachedDataset(CountingDataset(4, log), name="a")  # another process of the node: the same environment
    again[0]
    assert first.stats()["misses"] == 1 and again.stats()["hits"] == 1
    monkeypatch.delenv(cache_stores.ENV_CACHE_DIR)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert cache_stores.default_cache_directory() == str(tmp_path / f"bagua-cache-{os.getuid()}")


def test_the_default_store_is_installed_with_the_package():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    assert any(d.split(">")[0].split("=")[0].strip() == "lmdb" for d in dependencies)


def test_a_new_job_directory_removes_those_of_dead_jobs(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    orphan = tmp_path / f"bagua-job-cache-{ended.stdout.strip()}-a"  # its launcher was SIGKILLed
    running = tmp_path / f"bagua-job-cache-{os.getpid()}-b"
    unrelated = tmp_path / "bagua-job-cache-notes"
    for path in (orphan, running, unrelated):
        path.mkdir()
    made = job_directory()
    assert not orphan.exists() and running.exists() and unrelated.exists()
    assert os.path.basename(made).startswith(f"bagua-job-cache-{os.getpid()}-")
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700

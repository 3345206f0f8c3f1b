"""Damaged cached values are never served: on LMDB's disk and in a real redis-server.

Each case stores a dataset's samples, damages one stored value (a flipped bit, a truncation,
another index's value, another dataset's value, a value signed without the job's key) and
reads it back through a fresh cache, as another rank would: the dataset's own sample comes
back, the damage is counted, and the repaired value is served from then on.
"""

import hashlib
import hmac
import os
import pickle

import numpy as np
import pytest
from cache_datasets import REDIS_SERVER_MARKS, CountingDataset, reads

from bagua_common.data.cache_stores import LmdbStore, RedisStore
from bagua_common.data.cached_dataset import CachedDataset
from bagua_common.data.redis_server import RedisServer

SAMPLES = 8
DAMAGES = ["bit flip", "truncation", "another index", "another dataset", "outsider's key"]


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer(1 << 26) as server:
        yield server


@pytest.fixture(params=["lmdb", pytest.param("redis", marks=REDIS_SERVER_MARKS)])
def store(request, tmp_path):
    if request.param == "lmdb":
        return LmdbStore(str(tmp_path / "lmdb"), capacity_bytes=1 << 24)
    server = request.getfixturevalue("redis_server")
    store = RedisStore(server.url, digest_key=server.digest_key)
    store._open()[0].flushall()
    return store


def flip_bit(store, key: bytes, bit: int) -> None:
    """Flip bit ``bit`` of the value stored under ``key`` where the store keeps it."""
    raw = store.get(key)
    flipped = bytes([raw[bit // 8] ^ (1 << bit % 8)])
    if isinstance(store, RedisStore):
        store._client(key).setrange(key, bit // 8, flipped)
        return
    # LMDB maps its file: a write to the file is what every reader of the node sees next. Its
    # copy-on-write pages may hold stale copies of the value too: flip the bit in each.
    with open(os.path.join(store.path, "data.mdb"), "r+b") as data:
        contents = data.read()
        start = contents.find(raw)
        assert start >= 0
        while start >= 0:
            data.seek(start + bit // 8)
            data.write(flipped)
            start = contents.find(raw, start + 1)


def signed(digest_key: bytes, store_key: bytes, payload: bytes) -> bytes:
    """The documented value format, written independently of the cache's code."""
    message = b"".join(len(part).to_bytes(8, "little") + part for part in (b"bagua-cache", b"\x03", store_key, payload))
    return b"\x03" + hmac.new(digest_key, message, hashlib.sha256).digest()[:16] + payload


class WritesAFile:
    """Unpickling this runs code: it creates ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_value_is_never_served(store, damage, tmp_path, rng):
    log = str(tmp_path / "reads")
    ours = CachedDataset(CountingDataset(SAMPLES, log), store, name="ours")
    theirs = CachedDataset(CountingDataset(SAMPLES, log, size=16), store, name="theirs")
    for i in range(SAMPLES):
        ours[i], theirs[i]
    victim, other = (int(i) for i in rng.choice(SAMPLES, 2, replace=False))
    key = ours.loader.key(victim)
    raw = store.get(key)
    if damage == "bit flip":
        flip_bit(store, key, int(rng.integers(len(raw) * 8)))
    elif damage == "truncation":
        store.put(key, raw[: int(rng.integers(len(raw)))])
    elif damage == "another index":
        store.put(key, store.get(ours.loader.key(other)))
    elif damage == "another dataset":
        store.put(key, store.get(theirs.loader.key(victim)))
    else:
        marker = str(tmp_path / "unpickled")
        payload = pickle.dumps(WritesAFile(marker))
        store.put(key, signed(os.urandom(len(store.digest_key)), key, payload))
    assert store.get(key) != raw

    reader = CachedDataset(CountingDataset(SAMPLES, log), store, name="ours")  # another rank
    before = reads(log)
    with pytest.warns(RuntimeWarning, match="fails its digest check"):
        sample = reader[victim]
    np.testing.assert_array_equal(sample, np.random.default_rng(victim).standard_normal(64).astype(np.float32))
    assert reads(log) - before == 1
    assert reader.stats()["damaged"] == 1 and reader.stats()["hits"] == 0
    if damage == "outsider's key":
        assert not os.path.exists(marker)
    for i in range(SAMPLES):  # repaired, and nothing else touched
        np.testing.assert_array_equal(reader[i], np.random.default_rng(i).standard_normal(64).astype(np.float32))
    assert reads(log) - before == 1 and reader.stats()["damaged"] == 1


def test_a_value_signed_with_the_key_is_unpickled(tmp_path):
    """The control for the outsider case: the same forged value, signed with the key, runs."""
    store = LmdbStore(str(tmp_path / "lmdb"), capacity_bytes=1 << 24)
    data = CachedDataset(CountingDataset(SAMPLES, str(tmp_path / "reads")), store, name="ours")
    marker = str(tmp_path / "unpickled")
    payload = pickle.dumps(WritesAFile(marker))
    store.put(data.loader.key(0), signed(store.digest_key, data.loader.key(0), payload))
    data[0]
    assert os.path.exists(marker)

"""Key-value stores behind the cached dataset: bytes in, bytes out, admission stops when full.

:class:`LmdbStore` (the default) keeps values in a private node-local LMDB directory that every
rank and DataLoader worker of the node opens, with no server; :class:`MemoryStore` is a
per-process dict; :class:`RedisStore` talks to Redis servers, such as the one ``bagua-launch
--cache-server redis`` starts on a private unix socket. Every store holds a ``digest_key``, the
secret that signs its values (see :mod:`bagua_common.data.cached_dataset`): only processes that know
it can write a value the cache will unpickle. A store pickles as its configuration only and opens
its handle lazily in each process, so it survives fork and spawn. The ``redis`` package is
imported only by the store that needs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import tempfile
import threading
import warnings
from collections.abc import Sequence
from typing import Any, Protocol

import lmdb

from bagua_common.data.private_files import DIGEST_KEY_BYTES, digest_key_in, private_directory, read_private_file
from bagua_common.job.signature import AllGather, gather_bytes

ENV_CACHE_URL = "BAGUA_CACHE_URL"
ENV_CACHE_PASSWORD_FILE = "BAGUA_CACHE_PASSWORD_FILE"
ENV_CACHE_KEY_FILE = "BAGUA_CACHE_KEY_FILE"
ENV_CACHE_DIR = "BAGUA_CACHE_DIR"
_SERVER_ENTRY_BYTES = 1024  # one rank's {"url", "password", "key"} in sharded_store's exchange
DEFAULT_RAM_FRACTION = 0.25
FINGERPRINT_RECORD = b"#fingerprint"  # after a key scope: never a value's key, whose scope ends in a hex digest


class Store(Protocol):
    """What the cached dataset needs of a store.

    A store whose values outlive the job may also define ``adopt_fingerprint(scope, fingerprint)``
    (see :meth:`LmdbStore.adopt_fingerprint`) to drop the values of a dataset whose source changed;
    without it, those values are only never served again.
    """

    digest_key: bytes  # the secret every process that writes to the store signs values with

    def get(self, key: bytes) -> bytes | None:
        """Return the value stored under ``key``, or None."""

    def put(self, key: bytes, value: bytes) -> bool:
        """Store ``value`` under ``key``; return False (and keep nothing) once the store is full."""

    def close(self) -> None:
        """Release this process's handle."""


def physical_memory_bytes() -> int:
    """Return this machine's physical memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def parse_capacity(text: str) -> int:
    """Parse a capacity such as ``"8G"``, ``"512M"``, ``"100K"`` or ``"4096"`` into bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    body = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = units.get(body[-1:], 1)
    try:
        value = float(body[:-1] if body[-1:] in units else body) * scale
    except ValueError:
        raise ValueError(f"capacity must look like 8G, 512M or a byte count, got {text!r}") from None
    return checked_capacity(int(value))


def checked_capacity(capacity_bytes: int | None) -> int:
    """Return ``capacity_bytes``, or a quarter of RAM for None; reject <= 0 or more than RAM."""
    ram = physical_memory_bytes()
    if capacity_bytes is None:
        return int(ram * DEFAULT_RAM_FRACTION)
    if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
        raise TypeError(f"capacity must be an int number of bytes, got {capacity_bytes!r}")
    if not 0 < capacity_bytes <= ram:
        raise ValueError(f"capacity must be in (0, {ram}] bytes (this machine's RAM), got {capacity_bytes}")
    return capacity_bytes


class MemoryStore:
    """A per-process dict: DataLoader workers do not share it, so it warns when used in one."""

    def __init__(self, capacity_bytes: int | None = None) -> None:
        self.capacity_bytes = checked_capacity(capacity_bytes)
        self.digest_key = secrets.token_bytes(DIGEST_KEY_BYTES)
        self._owner = os.getpid()
        self._items: dict[bytes, bytes] = {}
        self._bytes = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"capacity_bytes": self.capacity_bytes, "digest_key": self.digest_key, "_owner": self._owner}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _items={}, _bytes=0)

    def _check_process(self) -> None:
        if self._owner != os.getpid():
            self._owner = os.getpid()
            self._items, self._bytes = {}, 0
            warnings.warn(
                "MemoryStore is per process: DataLoader workers and ranks each start empty "
                "(use LmdbStore or RedisStore to share the cache)",
                RuntimeWarning,
                stacklevel=3,
            )

    def get(self, key: bytes) -> bytes | None:
        """Return the value stored under ``key`` in this process, or None."""
        self._check_process()
        return self._items.get(key)

    def put(self, key: bytes, value: bytes) -> bool:
        """Keep ``value`` unless that would pass the capacity."""
        self._check_process()
        grown = self._bytes + len(key) + len(value) - len(self._items.get(key, b""))
        if grown > self.capacity_bytes:
            return False
        self._items[key], self._bytes = value, grown
        return True

    def close(self) -> None:
        """Forget this process's items."""
        self._items, self._bytes = {}, 0


class LmdbStore:
    """An LMDB database in a private node-local directory, opened by every process that uses it.

    LMDB is safe across processes (one writer at a time, readers never blocked), so the ranks
    and DataLoader workers of a node share one ``path``. The directory must be this user's and
    writable by nobody else (:func:`private_directory`); its digest key lives in it
    (:func:`digest_key_in`), so a directory kept between jobs serves the next one.
    ``capacity_bytes`` (default a quarter of RAM) is LMDB's map size: once it is full, puts
    return False and nothing is evicted. Values outlive the job, so the store records each
    dataset's fingerprint (:meth:`adopt_fingerprint`) and drops the values of a dataset whose
    source changed.
    """

    def __init__(self, path: str, capacity_bytes: int | None = None) -> None:
        self.capacity_bytes = checked_capacity(capacity_bytes)
        self.path = private_directory(path)
        self.digest_key = digest_key_in(self.path)
        free = shutil.disk_usage(self.path).free
        if free < self.capacity_bytes:
            warnings.warn(
                f"LMDB cache capacity {self.capacity_bytes} bytes exceeds the {free} bytes free under {self.path}",
                RuntimeWarning,
                stacklevel=2,
            )
        self._env: Any = None
        self._pid = -1
        self._full = False

    def __getstate__(self) -> dict[str, Any]:
        return {"capacity_bytes": self.capacity_bytes, "path": self.path, "digest_key": self.digest_key}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _env=None, _pid=-1, _full=False)

    def _open(self) -> Any:
        # An LMDB environment must not cross a fork and may be opened once per process.
        if self._pid != os.getpid():
            self._env = _lmdb_environment(self.path, self.capacity_bytes)
            self._pid = os.getpid()
        return self._env

    def get(self, key: bytes) -> bytes | None:
        """Return the value stored under ``key``, or None."""
        with self._open().begin(buffers=False) as txn:
            return txn.get(key)

    def put(self, key: bytes, value: bytes) -> bool:
        """Store ``value``; return False from the first put that finds the map full."""
        if self._full:
            return False
        try:
            with self._open().begin(write=True) as txn:
                txn.put(key, value)
        except lmdb.MapFullError:
            self._full = True
            return False
        return True

    def adopt_fingerprint(self, scope: bytes, fingerprint: bytes) -> int | None:
        """Record ``fingerprint`` for the keys starting with ``scope``; return None if it was already recorded (or
        none was), else delete every key under ``scope`` and return how many values went.

        One write transaction: of the ranks and workers of a node that open a changed dataset at
        once, the first drops the old values and records the new fingerprint, and the others find
        it recorded.
        """
        record = scope + FINGERPRINT_RECORD
        with self._open().begin(write=True) as txn:
            recorded = txn.get(record)
            if recorded == fingerprint:
                return None
            dropped = 0
            if recorded is not None:
                cursor = txn.cursor()
                found = cursor.set_range(scope)
                while found and cursor.key().startswith(scope):
                    dropped += cursor.key() != record
                    found = cursor.delete()
            txn.put(record, fingerprint)
        self._full = False
        return None if recorded is None else dropped

    def close(self) -> None:
        """Close this process's environment."""
        if self._env is not None and self._pid == os.getpid():
            _lmdb_environments.pop((self._pid, self.path), None)
            self._env.close()
        self._env, self._pid = None, -1


_lmdb_environments: dict[tuple[int, str], Any] = {}
# Loader threads (grain's, torch's with threads) open a store at once; LMDB refuses a second open of the same path.
_lmdb_environments_lock = threading.Lock()


def _fresh_environments_in_child() -> None:
    # The parent's environments are unusable here, and lmdb refuses to open one of them again while it is open
    # (a DataLoader worker forked after the parent read the cache, or recorded its fingerprint, failed every read).
    # Closing them here releases nothing of the parent's: its locks and reader slots are its own.
    global _lmdb_environments_lock
    _lmdb_environments_lock = threading.Lock()
    for environment in _lmdb_environments.values():
        environment.close()
    _lmdb_environments.clear()


os.register_at_fork(after_in_child=_fresh_environments_in_child)


def _lmdb_environment(path: str, capacity_bytes: int) -> Any:
    key = (os.getpid(), path)
    with _lmdb_environments_lock:
        if key not in _lmdb_environments:
            _lmdb_environments[key] = lmdb.open(
                path, map_size=capacity_bytes, sync=False, metasync=False, readahead=False,
                max_readers=512, meminit=False,
            )  # fmt: skip
        return _lmdb_environments[key]


def shard_of(key: bytes, num_shards: int) -> int:
    """Return the shard that holds ``key``: a stable hash, the same in every process."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") % num_shards


def connect_redis(url: str, password: str | None, timeout_s: float) -> Any:
    """Return a ``redis.Redis`` client for ``url`` with bounded socket waits."""
    import redis

    return redis.Redis.from_url(
        url,
        password=password,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )


class RedisStore:
    """Redis servers, keys spread over them by a stable hash (:func:`shard_of`).

    ``urls`` such as ``unix:///path/redis.sock`` or ``redis://host:6379/0``; every process of
    a job must list them in the same order. ``password`` is one for all servers or one per
    server (None: no password). ``digest_key`` signs the values (None: read it from the file
    named in ``BAGUA_CACHE_KEY_FILE``, which the launcher's server sets); every process of the
    job must hold the same one, and nobody outside the job. Each server should run with
    ``maxmemory-policy noeviction``: its first out-of-memory reply stops this process's puts.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        password: str | Sequence[str | None] | None = None,
        timeout_s: float = 10.0,
        *,
        digest_key: bytes | None = None,
    ) -> None:
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        if not self.urls or not all(isinstance(u, str) and u for u in self.urls):
            raise ValueError(f"urls must be non-empty strings, got {urls!r}")
        if not 0 < timeout_s < float("inf"):
            raise ValueError(f"timeout_s must be a positive finite number, got {timeout_s!r}")
        passwords = [password] * len(self.urls) if password is None or isinstance(password, str) else list(password)
        if len(passwords) != len(self.urls):
            raise ValueError(f"{len(self.urls)} urls but {len(passwords)} passwords")
        self.passwords = passwords
        self.timeout_s = float(timeout_s)
        self.digest_key = _digest_key_from_environment() if digest_key is None else digest_key
        if not isinstance(self.digest_key, bytes) or len(self.digest_key) < 16:
            raise ValueError(f"digest_key must be at least 16 secret bytes, got {type(self.digest_key).__name__}")
        self._clients: list[Any] | None = None
        self._pid = -1
        self._full = False
        for url, client in zip(self.urls, self._open()):
            try:
                client.ping()
            except Exception as e:
                raise ConnectionError(f"cannot reach the Redis cache at {url}: {e}") from e

    def __getstate__(self) -> dict[str, Any]:
        return {
            "urls": self.urls,
            "passwords": self.passwords,
            "timeout_s": self.timeout_s,
            "digest_key": self.digest_key,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _clients=None, _pid=-1, _full=False)

    def _open(self) -> list[Any]:
        if self._pid != os.getpid():
            self._clients = [connect_redis(u, p, self.timeout_s) for u, p in zip(self.urls, self.passwords)]
            self._pid = os.getpid()
        return self._clients

    def _client(self, key: bytes) -> Any:
        clients = self._open()
        return clients[shard_of(key, len(clients))]

    def get(self, key: bytes) -> bytes | None:
        """Return the value stored under ``key``, or None."""
        return self._client(key).get(key)

    def put(self, key: bytes, value: bytes) -> bool:
        """Store ``value``; return False from the first out-of-memory reply on."""
        if self._full:
            return False
        import redis

        try:
            self._client(key).set(key, value)
        except redis.exceptions.OutOfMemoryError:
            self._full = True
            return False
        return True

    def close(self) -> None:
        """Close this process's connections."""
        if self._clients is not None and self._pid == os.getpid():
            for client in self._clients:
                client.close()
        self._clients, self._pid = None, -1


def _password_from_environment() -> str | None:
    path = os.environ.get(ENV_CACHE_PASSWORD_FILE)
    return read_private_file(path).decode().strip() if path else None


def _digest_key_from_environment() -> bytes:
    path = os.environ.get(ENV_CACHE_KEY_FILE)
    if not path:
        raise ValueError(
            f"RedisStore needs digest_key, the job's secret that signs cached values, or {ENV_CACHE_KEY_FILE} "
            "naming a file that holds it (bagua-launch --cache-server redis sets it)"
        )
    return read_private_file(path)


def default_cache_directory() -> str:
    """Return the directory that holds the node's LMDB caches: ``$BAGUA_CACHE_DIR`` if set.

    ``bagua-launch`` sets it to a 0700 directory it makes for the job and removes at its end
    (or to ``--cache-dir``, kept for the next job). Without it: ``bagua-cache-<uid>`` in the
    temporary directory, kept until the machine's temporary files are cleaned.
    """
    return os.environ.get(ENV_CACHE_DIR) or os.path.join(tempfile.gettempdir(), f"bagua-cache-{os.getuid()}")


def store_from_environment(name: str, version: str) -> Store:
    """Return the default store for dataset ``name`` at ``version``.

    :func:`redis_store_from_environment` if ``BAGUA_CACHE_URL`` is set (by ``bagua-launch
    --cache-server redis``), else :func:`node_lmdb_store`.
    """
    if os.environ.get(ENV_CACHE_URL, "").strip():
        return redis_store_from_environment()
    return node_lmdb_store(name, version)


def redis_store_from_environment() -> RedisStore:
    """Return the :class:`RedisStore` at ``BAGUA_CACHE_URL`` (comma-separated for several servers).

    The password, if any, and the digest key are read from the files named in
    ``BAGUA_CACHE_PASSWORD_FILE`` and ``BAGUA_CACHE_KEY_FILE``; ``bagua-launch --cache-server
    redis`` sets all three.
    """
    urls = [u for u in os.environ.get(ENV_CACHE_URL, "").strip().split(",") if u]
    if not urls:
        raise ValueError(f"no Redis cache server: {ENV_CACHE_URL} is unset (bagua-launch --cache-server redis sets it)")
    return RedisStore(urls, _password_from_environment())


def node_lmdb_store(name: str, version: str) -> LmdbStore:
    """Return the node's :class:`LmdbStore` for dataset ``name`` at ``version``.

    One LMDB environment per (dataset name, version) in :func:`default_cache_directory`, which
    every rank and DataLoader worker of the node that asks for the same dataset opens.
    """
    root = private_directory(default_cache_directory())
    return LmdbStore(os.path.join(root, environment_name(name, version)))


def environment_name(name: str, version: str) -> str:
    """Return the directory name of dataset ``name`` at ``version``: readable, and unique by digest."""
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:48]
    scope = hashlib.blake2b(f"{name}\0{version}".encode(), digest_size=8).hexdigest()
    return f"{readable}-{scope}"


def sharded_store(allgather: AllGather, timeout_s: float = 10.0) -> RedisStore:
    """Return one :class:`RedisStore` over the cache servers of every node of the job.

    For ``bagua-launch --cache-server redis --cache-bind ADDR``: each rank contributes its
    node's server (``BAGUA_CACHE_URL``, the password from ``BAGUA_CACHE_PASSWORD_FILE``) through
    ``allgather`` (a uint8 array of the same length from every rank, stacked in rank order, over
    the job's communicator; every rank must call this). The servers are listed in the order of
    the first rank naming each, so every process routes every key to the same server, and
    every process signs values with rank 0's digest key. The exchange is JSON, never a pickle;
    the passwords and keys travel over the job's own communicator.
    """
    url = os.environ.get(ENV_CACHE_URL, "").strip()
    if not url or "," in url:
        raise ValueError(f"sharded_store needs {ENV_CACHE_URL} to name this node's one cache server, got {url!r}")
    mine = {"url": url, "password": _password_from_environment(), "key": _digest_key_from_environment().hex()}
    entry = json.dumps(mine).encode()
    if len(entry) > _SERVER_ENTRY_BYTES:
        raise ValueError(f"the cache server's address is too long ({len(entry)} bytes with its password)")
    servers: dict[str, str | None] = {}
    rows = [json.loads(row.rstrip(b"\0")) for row in gather_bytes(allgather, entry, _SERVER_ENTRY_BYTES)]
    for theirs in rows:
        if servers.setdefault(theirs["url"], theirs["password"]) != theirs["password"]:
            raise ValueError(f"ranks disagree on the password of the cache server {theirs['url']}")
    return RedisStore(list(servers), list(servers.values()), timeout_s, digest_key=bytes.fromhex(rows[0]["key"]))

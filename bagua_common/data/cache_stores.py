"""Key-value stores behind the cached dataset: bytes in, bytes out, admission stops when full.

:class:`LmdbStore` (the default) keeps values in a private node-local LMDB directory shared by
the DataLoader workers of a job, with no server; :class:`MemoryStore` is a per-process dict;
:class:`RedisStore` talks to Redis servers, such as the one ``bagua-launch --cache-server redis``
starts on a private unix socket. A store pickles as its configuration only and opens its handle
lazily in each process, so it survives fork and spawn. The ``lmdb`` and ``redis`` packages are
imported only by the store that needs them.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
import warnings
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

from bagua_common.job.signature import AllGather, gather_bytes

ENV_CACHE_URL = "BAGUA_CACHE_URL"
ENV_CACHE_PASSWORD_FILE = "BAGUA_CACHE_PASSWORD_FILE"
_SERVER_ENTRY_BYTES = 1024  # one rank's {"url", "password"} in sharded_store's exchange
DEFAULT_RAM_FRACTION = 0.25


class Store(Protocol):
    """What the cached dataset needs of a store."""

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


def private_directory(path: str | None) -> str:
    """Return ``path`` (created 0700 if missing) or a fresh 0700 temporary directory.

    An existing directory must belong to this user and be writable by nobody else: the cache
    unpickles what it reads, so only this job may write there.
    """
    if path is None:
        return tempfile.mkdtemp(prefix="bagua-cache-")
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.stat(path)
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"cache directory {path!r} must belong to this user and not be writable by others")
    return path


class MemoryStore:
    """A per-process dict: DataLoader workers do not share it, so it warns when used in one.

    Values were written by this process only, so reading them back as pickles is safe.
    """

    def __init__(self, capacity_bytes: int | None = None) -> None:
        self.capacity_bytes = checked_capacity(capacity_bytes)
        self._owner = os.getpid()
        self._items: dict[bytes, bytes] = {}
        self._bytes = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"capacity_bytes": self.capacity_bytes, "_owner": self._owner}

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
    """An LMDB database in a private node-local directory, shared by all processes that use it.

    ``path=None`` makes a fresh 0700 temporary directory, removed when the creating process
    exits; pass one ``path`` to share the cache among the ranks of a node. Values are
    unpickled on read, which is safe only because nobody else can write to the directory.
    ``capacity_bytes`` (default a quarter of RAM) is LMDB's map size: once it is full, puts
    return False and nothing is evicted.
    """

    def __init__(self, path: str | None = None, capacity_bytes: int | None = None) -> None:
        import lmdb  # noqa: F401  (fail here, not in a worker, when it is missing)

        self.capacity_bytes = checked_capacity(capacity_bytes)
        self.path = private_directory(path)
        if path is None:
            weakref.finalize(self, _remove_if_owner, self.path, os.getpid())
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
        return {"capacity_bytes": self.capacity_bytes, "path": self.path}

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
        import lmdb

        try:
            with self._open().begin(write=True) as txn:
                txn.put(key, value)
        except lmdb.MapFullError:
            self._full = True
            return False
        return True

    def close(self) -> None:
        """Close this process's environment."""
        if self._env is not None and self._pid == os.getpid():
            _lmdb_environments.pop((self._pid, self.path), None)
            self._env.close()
        self._env, self._pid = None, -1


_lmdb_environments: dict[tuple[int, str], Any] = {}


def _lmdb_environment(path: str, capacity_bytes: int) -> Any:
    key = (os.getpid(), path)
    if key not in _lmdb_environments:
        import lmdb

        _lmdb_environments[key] = lmdb.open(
            path, map_size=capacity_bytes, sync=False, metasync=False, readahead=False,
            max_readers=512, meminit=False,
        )  # fmt: skip
    return _lmdb_environments[key]


def _remove_if_owner(path: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(path, ignore_errors=True)


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
    server (None: no password). Values are unpickled on read, so point it only at servers that
    nobody outside the job can write to (the launcher's server listens on a 0700 unix socket,
    or with a generated password). Each server should run with ``maxmemory-policy
    noeviction``: its first out-of-memory reply stops this process's puts.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        password: str | Sequence[str | None] | None = None,
        timeout_s: float = 10.0,
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
    if not path:
        return None
    info = os.stat(path)
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{ENV_CACHE_PASSWORD_FILE}={path!r} must belong to this user and be readable by nobody else")
    with open(path) as f:
        return f.read().strip()


def store_from_environment() -> Store:
    """Return the default store: Redis at ``BAGUA_CACHE_URL`` (set by ``bagua-launch
    --cache-server redis``, comma-separated for several servers; the password, if any, read
    from the file named in ``BAGUA_CACHE_PASSWORD_FILE``) if set, else a fresh :class:`LmdbStore`."""
    urls = os.environ.get(ENV_CACHE_URL, "").strip()
    if urls:
        return RedisStore([u for u in urls.split(",") if u], _password_from_environment())
    return LmdbStore()


def sharded_store(allgather: AllGather, timeout_s: float = 10.0) -> RedisStore:
    """Return one :class:`RedisStore` over the cache servers of every node of the job.

    For ``bagua-launch --cache-server redis --cache-bind ADDR``: each rank contributes its
    node's server (``BAGUA_CACHE_URL``, the password from ``BAGUA_CACHE_PASSWORD_FILE``) through
    ``allgather`` (a uint8 array of the same length from every rank, stacked in rank order, over
    the job's communicator; every rank must call this). The servers are listed in the order of
    the first rank naming each, so every process routes every key to the same server. The
    exchange is JSON, never a pickle; the passwords travel over the job's own communicator.
    """
    url = os.environ.get(ENV_CACHE_URL, "").strip()
    if not url or "," in url:
        raise ValueError(f"sharded_store needs {ENV_CACHE_URL} to name this node's one cache server, got {url!r}")
    entry = json.dumps({"url": url, "password": _password_from_environment()}).encode()
    if len(entry) > _SERVER_ENTRY_BYTES:
        raise ValueError(f"the cache server's address is too long ({len(entry)} bytes with its password)")
    servers: dict[str, str | None] = {}
    for row in gather_bytes(allgather, entry, _SERVER_ENTRY_BYTES):
        theirs = json.loads(row.rstrip(b"\0"))
        if servers.setdefault(theirs["url"], theirs["password"]) != theirs["password"]:
            raise ValueError(f"ranks disagree on the password of the cache server {theirs['url']}")
    return RedisStore(list(servers), list(servers.values()), timeout_s)

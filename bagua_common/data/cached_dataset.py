"""A dataset wrapper that serves samples from a cache after their first read.

:class:`CacheLoader` is Bagua's ``get(key, load_fn)``: return the cached value, or load,
write it through and return it. :class:`CachedDataset` applies it to ``dataset[index]`` and
works anywhere an object with ``__getitem__`` and ``__len__`` does (a torch ``DataLoader``
with fork or spawn workers, a JAX input pipeline, a grain data source).

Every value carries a header: the format version and a tag (:mod:`bagua_common.job.message_tag`), under the store's
``digest_key``, of the format version, the store key (dataset name, version, index) and the payload. A value whose
tag does not match (a flipped bit, a truncation, another index's or dataset's value) is never unpickled: it is
counted in ``stats()["damaged"]`` and read from the dataset again. Only a process holding the key can write a value
that is served, so the key must stay with the job (the defaults keep it in 0600 files in the store's private
directory). A store that fails never yields wrong data either: the sample is read from the dataset instead.

A :class:`CachedDataset` also keys its values by the dataset's *fingerprint*
(:func:`dataset_fingerprint`: its class, its length and a digest of a few items at fixed
positions, read from the dataset whenever it is wrapped), so a dataset whose source changed
between two runs (new preprocessing, a fixed label) misses instead of getting the old values
back. A store that keeps values between jobs (LMDB) records the fingerprint of each dataset name
and version, and drops that dataset's values when another one arrives, saying so in one logged
line. A change that no sampled item shows needs a new ``version``, the explicit way.
"""

from __future__ import annotations

import hashlib
import logging
import operator
import pickle
import warnings
from collections.abc import Callable, Hashable, Sized
from typing import Any, Protocol

from bagua_common.data.cache_stores import Store, store_from_environment
from bagua_common.job.message_tag import message_tag, tag_matches

KEY_PREFIX = b"bg1:"
FORMAT_VERSION = b"\x03"  # 1: an unsigned pickle; 2: a blake2b digest
TAG_BYTES = 16
HEADER_BYTES = len(FORMAT_VERSION) + TAG_BYTES
FINGERPRINT_SAMPLES = 8
"""Items read from the dataset for its fingerprint each time it is wrapped: evenly spaced, the first and last."""
_ON_ERROR = ("warn", "raise")
_log = logging.getLogger(__name__)


def _signed(store_key: bytes, payload: bytes | memoryview) -> tuple[bytes | memoryview, ...]:
    """A value's purpose and parts for its tag."""
    return b"bagua-cache", FORMAT_VERSION, store_key, payload


class MapDataset(Sized, Protocol):
    """What the cache wraps: a dataset with a length whose samples are read by index (``len(d)``, ``d[i]``)."""

    def __getitem__(self, index: int) -> Any: ...


class CacheLoader:
    """Returns cached values by key, loading and writing through on a miss.

    Keys are scoped by ``name`` (required, non-empty) and ``version``: change the version and
    no value from an earlier version is served. ``fingerprint`` (bytes, see :func:`dataset_fingerprint`)
    scopes them further to one content of the source: where the store records fingerprints
    (``adopt_fingerprint``, as :class:`~bagua_common.data.cache_stores.LmdbStore` does), the values
    of another fingerprint under this name and version are dropped, with one logged line. ``store`` None is
    :func:`~bagua_common.data.cache_stores.store_from_environment` for that name and version. When
    the store is full new values are not admitted (nothing is evicted). A store error warns once
    per process, is counted in :meth:`stats`, and the value is loaded instead; a value that fails
    its digest check warns once, counts as damaged and a miss, and is overwritten;
    ``on_error="raise"`` raises either instead.
    """

    def __init__(
        self,
        store: Store | None,
        name: str,
        version: str = "",
        *,
        fingerprint: bytes = b"",
        on_error: str = "warn",
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, got {name!r}")
        if not isinstance(version, str):
            raise TypeError(f"version must be a string, got {version!r}")
        if not isinstance(fingerprint, bytes):
            raise TypeError(f"fingerprint must be bytes, got {fingerprint!r}")
        if on_error not in _ON_ERROR:
            raise ValueError(f"on_error must be one of {_ON_ERROR}, got {on_error!r}")
        self.store = store_from_environment(name, version) if store is None else store
        self.name, self.version, self.on_error = name, version, on_error
        scope = KEY_PREFIX + self._scope(name.encode(), version.encode()) + b":"
        self._prefix = scope + fingerprint.hex().encode() + b":" if fingerprint else scope
        self._reset_counters()
        if fingerprint:
            self._adopt(scope, fingerprint)

    def _scope(self, name: bytes, version: bytes) -> bytes:
        digest = hashlib.blake2b(version, digest_size=4, person=b"bagua-cache").hexdigest()
        return name + b":" + digest.encode()

    def _adopt(self, scope: bytes, fingerprint: bytes) -> None:
        adopt = getattr(self.store, "adopt_fingerprint", None)
        dropped = None if adopt is None else self._call("adopt", adopt, scope, fingerprint)
        if dropped is not None:
            _log.warning(
                "bagua cache: dataset %r (version %r) changed since its values were cached (its class, length or "
                "sampled items differ): dropped %d cached values, reading the dataset again",
                self.name,
                self.version,
                dropped,
            )

    def _reset_counters(self) -> None:
        self._stats = dict.fromkeys(("hits", "misses", "puts", "rejected", "damaged", "errors", "bytes"), 0)
        self._warned: set[str] = set()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_stats"), state.pop("_warned")
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_counters()

    def key(self, key: Hashable) -> bytes:
        """Return the store key for ``key``: prefix, name, version digest, then ``str(key)``."""
        return self._prefix + str(key).encode()

    def stats(self) -> dict[str, int]:
        """Return this process's counts: hits, misses, puts, rejected (store full), damaged (failed
        the digest check), errors (store failures), bytes (read)."""
        return dict(self._stats)

    def get(self, key: Hashable, load_fn: Callable[[Hashable], Any]) -> Any:
        """Return the value for ``key`` from the store, or ``load_fn(key)`` written through."""
        store_key = self.key(key)
        raw = self._call("get", self.store.get, store_key)
        if raw is not None:
            value = self._decoded(raw, store_key, key)
            if value is not _MISSING:
                self._stats["hits"] += 1
                self._stats["bytes"] += len(raw)
                return value
        self._stats["misses"] += 1
        value = load_fn(key)
        admitted = self._call("put", self.store.put, store_key, self._encoded(store_key, value))
        if admitted is True:
            self._stats["puts"] += 1
        elif admitted is False:
            self._stats["rejected"] += 1
        return value

    def _call(self, what: str, method: Callable[..., Any], *args: Any) -> Any:
        try:
            return method(*args)
        except Exception as e:
            if self.on_error == "raise":
                raise
            self._stats["errors"] += 1
            self._warn_once(
                "store",
                f"cache store {what} failed ({type(e).__name__}: {e}); reading the dataset "
                "instead (further errors are counted in stats()['errors'])",
            )
            return None

    def _encoded(self, store_key: bytes, value: Any) -> bytes:
        payload = pickle.dumps(value, protocol=5)
        tag = message_tag(self.store.digest_key, *_signed(store_key, payload), size=TAG_BYTES)
        return FORMAT_VERSION + tag + payload

    def _decoded(self, raw: bytes, store_key: bytes, key: Hashable) -> Any:
        view = memoryview(raw)
        payload = view[HEADER_BYTES:]
        intact = (
            len(raw) >= HEADER_BYTES
            and raw[:1] == FORMAT_VERSION
            and tag_matches(view[1:HEADER_BYTES], self.store.digest_key, *_signed(store_key, payload), size=TAG_BYTES)
        )
        if intact:
            try:
                return pickle.loads(payload)
            except Exception as e:  # signed by this job yet unreadable: a class that changed since
                problem = f"does not unpickle ({type(e).__name__}: {e})"
        else:
            problem = "fails its digest check"
            self._stats["damaged"] += 1
        if self.on_error == "raise":
            raise ValueError(f"cached value for {key!r} {problem}")
        self._warn_once("decode", f"cached value for {key!r} {problem}; reading the dataset instead")
        return _MISSING

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, RuntimeWarning, stacklevel=4)


_MISSING = object()


def fingerprint_positions(length: int, count: int = FINGERPRINT_SAMPLES) -> list[int]:
    """Return the indices a fingerprint reads: ``count`` evenly spaced ones, the first and the last included."""
    if length <= count:
        return list(range(length))
    return sorted({round(i * (length - 1) / (count - 1)) for i in range(count)})


def dataset_fingerprint(dataset: MapDataset) -> bytes:
    """Return a 16-byte digest of ``dataset``'s class, length and items at :func:`fingerprint_positions`.

    The items are read from ``dataset`` itself (a few reads, the same positions in every process)
    and digested as their pickles, so equal values give equal fingerprints in every process.
    """
    cls, length = type(dataset), len(dataset)
    digest = hashlib.blake2b(digest_size=16, person=b"bagua-source")
    digest.update(f"{cls.__module__}.{cls.__qualname__}\0{length}".encode())
    for index in fingerprint_positions(length):
        payload = pickle.dumps(dataset[index], protocol=5)
        digest.update(index.to_bytes(8, "little") + len(payload).to_bytes(8, "little") + payload)
    return digest.digest()


class CachedDataset:
    """``dataset`` with each sample cached after its first read (see :class:`CacheLoader`).

    ``store`` defaults to :func:`~bagua_common.data.cache_stores.store_from_environment` (one LMDB
    environment per ``name`` and ``version``). The keys also carry the dataset's
    :func:`dataset_fingerprint`, computed here, so a dataset whose class, length or sampled items
    changed since its values were cached misses, and the store drops the old values (see the
    module docstring). ``transform`` runs after the cache on every read: cache deterministic
    decoding, augment in ``transform``.
    """

    def __init__(
        self,
        dataset: MapDataset,
        store: Store | None = None,
        *,
        name: str,
        version: str = "",
        transform: Callable[[Any], Any] | None = None,
        on_error: str = "warn",
    ) -> None:
        self.dataset = dataset
        self.transform = transform
        fingerprint = dataset_fingerprint(dataset)
        self.loader = CacheLoader(store, name, version, fingerprint=fingerprint, on_error=on_error)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        i = operator.index(index)
        n = len(self.dataset)
        if not -n <= i < n:
            raise IndexError(f"index {index} out of range for {n} samples")
        value = self.loader.get(i % n, self.dataset.__getitem__)
        return value if self.transform is None else self.transform(value)

    def stats(self) -> dict[str, int]:
        """Return this process's cache counts (see :meth:`CacheLoader.stats`)."""
        return self.loader.stats()

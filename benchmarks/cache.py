"""Epoch times of a DataLoader over a slow-to-decode dataset: uncached, LMDB cache, Redis cache.

Each sample costs a CPU-bound decode of about 3 ms (NumPy work, not a sleep, so the workers
really contend for the cores). Two DataLoader workers (fork, not persistent), two epochs per
run; the stores are fresh for every run and the configurations are interleaved and repeated.
Reported: median epoch times, epoch-2 speed-up over uncached, epoch-1 overhead, hit rates.

``--node`` runs one node's 4 ranks x 2 DataLoader workers with the balanced sampler, which deals
each rank other samples every epoch: epoch-2 hit rate and time without a cache, with a cache per
process (each rank its own LMDB directory, as before the node cache) and with the default store
(one LMDB environment per dataset that every process of the node opens); results in
``cache-node.{md,json}``.

``--compare-stores`` measures the stores themselves instead: put, then get, throughput of the
embedded default (LMDB) against the alternatives (SQLite in WAL mode, one file per sample in a
directory, the per-process memory store, Redis over its unix socket), from the DataLoader
workers, for small and large samples; results in ``benchmarks/results/cache-stores.{md,json}``
(the epoch times in ``cache-cpu.{md,json}``; ``--out`` names another folder).

    python benchmarks/cache.py [--samples 1000] [--repeats 3] [--workers 2]
    python benchmarks/cache.py --compare-stores [--repeats 3]
    python benchmarks/cache.py --node [--samples 2000] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import pickle
import sqlite3
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader

from bagua_common.data.cache_stores import ENV_CACHE_DIR, LmdbStore, MemoryStore, RedisStore
from bagua_common.data.cached_dataset import CachedDataset, CacheLoader
from bagua_common.data.private_files import private_directory
from bagua_common.data.redis_server import RedisServer
from bagua_torch.data import BalancedBatchSampler

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from harness.console import Transcript  # noqa: E402
from harness.options import add_out_option  # noqa: E402
from harness.results import finish_meta, header_lines, run_meta, write_results  # noqa: E402

DECODE_SECONDS = 0.003
PACKAGES = ("numpy", "lmdb", "redis", "torch")


class SlowDecodeDataset:
    """Sample i: a 16 KiB float32 array produced by ``rounds`` rounds of FFTs (CPU-bound)."""

    def __init__(self, n: int, rounds: int) -> None:
        self.n, self.rounds = n, rounds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        x = np.random.default_rng(index).standard_normal(4096)
        for _ in range(self.rounds):
            x = np.fft.irfft(np.fft.rfft(x), n=4096)
        return x.astype(np.float32)


def calibrated_rounds() -> int:
    """The number of FFT rounds that take about DECODE_SECONDS of CPU time here."""
    probe = SlowDecodeDataset(1, 100)
    start = time.process_time()
    for _ in range(5):
        probe[0]
    per_round = (time.process_time() - start) / 500
    return max(1, round(DECODE_SECONDS / per_round))


def epoch_seconds(dataset, workers: int) -> float:
    loader = DataLoader(dataset, batch_size=16, shuffle=True, num_workers=workers,
                        multiprocessing_context="fork", persistent_workers=False)  # fmt: skip
    start = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - start


def redis_hits(server: RedisServer) -> tuple[int, int]:
    info = RedisStore(server.url, digest_key=server.digest_key)._open()[0].info("stats")
    return info["keyspace_hits"], info["keyspace_misses"]


class SqliteStore:
    """An alternative to LMDB measured here: one SQLite file in WAL mode, no fsync (like LMDB's
    ``sync=False``), a connection per process, each put its own transaction (write-through)."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, "cache.sqlite")
        with sqlite3.connect(self.path) as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE kv (key BLOB PRIMARY KEY, value BLOB NOT NULL)")
        self._db: Any = None
        self._pid = -1

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _db=None, _pid=-1)

    def _open(self) -> sqlite3.Connection:
        if self._pid != os.getpid():
            self._db = sqlite3.connect(self.path, timeout=60, isolation_level=None)
            self._db.execute("PRAGMA synchronous=OFF")
            self._pid = os.getpid()
        return self._db

    def get(self, key: bytes) -> bytes | None:
        row = self._open().execute("SELECT value FROM kv WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def put(self, key: bytes, value: bytes) -> bool:
        self._open().execute("INSERT OR REPLACE INTO kv VALUES (?, ?)", (key, value))
        return True


class FileStore:
    """An alternative to LMDB measured here: one file per sample in a directory, written to a
    temporary name and renamed into place (readers never see half a value)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def get(self, key: bytes) -> bytes | None:
        try:
            with open(os.path.join(self.directory, key.hex()), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def put(self, key: bytes, value: bytes) -> bool:
        path = os.path.join(self.directory, key.hex())
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "wb") as f:
            f.write(value)
        os.replace(temporary, path)
        return True


class StoreOps:
    """Item c < chunks puts chunk c's samples, item chunks + c reads them back; each item returns
    (first op's start, last op's end, hits). With an even number of chunks and two workers, the
    worker that wrote a chunk reads it (DataLoader deals items round-robin): so the per-process
    memory store can hit too."""

    def __init__(self, store: Any, chunks: int, chunk: int, value: bytes) -> None:
        self.store, self.chunks, self.chunk, self.value = store, chunks, chunk, value

    def __len__(self) -> int:
        return 2 * self.chunks

    def __getitem__(self, item: int) -> tuple[float, float, int]:
        first = (item % self.chunks) * self.chunk
        keys = [b"bg1:bench:%d" % i for i in range(first, first + self.chunk)]
        start = time.perf_counter()
        if item < self.chunks:
            hits = sum(self.store.put(k, self.value) for k in keys)
        else:
            hits = sum(self.store.get(k) == self.value for k in keys)
        return start, time.perf_counter(), hits


def store_throughput(store: Any, samples: int, size: int, workers: int) -> dict[str, float]:
    """Puts, then gets, of ``samples`` values of ``size`` bytes from ``workers`` DataLoader workers."""
    chunk = 50
    chunks = samples // chunk
    ops = StoreOps(store, chunks, chunk, np.random.default_rng(0).bytes(size))
    loader = DataLoader(ops, batch_size=None, num_workers=workers, multiprocessing_context="fork", prefetch_factor=2)
    results = [tuple(float(v) for v in item) for item in loader]  # DataLoader yields items in index order
    puts, gets = results[:chunks], results[chunks:]
    put_s = max(r[1] for r in puts) - min(r[0] for r in puts)
    get_s = max(r[1] for r in gets) - min(r[0] for r in gets)
    n = chunks * chunk
    return {"put_per_s": n / put_s, "get_per_s": n / get_s, "hit_rate": sum(r[2] for r in gets) / n}


def read_overhead(size: int, calls: int = 2000) -> dict[str, float]:
    """Seconds one cache hit costs in this process, for a float32 array of ``size`` bytes: ``CacheLoader.get``
    on a ``MemoryStore`` that holds the value (a dict lookup, so the time is the loader's own: the key, the tag
    check and the unpickling), and ``pickle.loads`` of the same value alone; each the median of ``calls`` calls."""
    value = np.random.default_rng(0).random(size // 4, dtype=np.float32)
    payload = pickle.dumps(value, protocol=5)
    loader = CacheLoader(MemoryStore(), "read-overhead")
    loader.get(0, lambda _: value)

    def median_s(call: Any) -> float:
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    return {
        "hit_s": median_s(lambda: loader.get(0, _never_loaded)),
        "unpickle_s": median_s(lambda: pickle.loads(payload)),
    }


def _never_loaded(key: Any) -> Any:
    raise AssertionError(f"the read-overhead loader missed key {key!r}")


def compare_stores(args: argparse.Namespace) -> None:
    sizes = {"small": (1 << 10, args.small_samples), "large": (128 << 10, args.large_samples)}
    names = ["lmdb", "sqlite-wal", "files", "memory", "redis-unix"]
    capacity = 1 << 30
    # Expected here, and said in the table: the memory store is per process (the workers inherit this filter).
    warnings.filterwarnings("ignore", "MemoryStore is per process", RuntimeWarning)
    meta = run_meta(PACKAGES, argv=sys.argv[1:])
    runs: dict[tuple[str, str], list[dict[str, float]]] = {(n, k): [] for k in sizes for n in names}
    with RedisServer(capacity) as server:
        client = RedisStore(server.url, digest_key=server.digest_key)._open()[0]
        for repeat in range(args.repeats):
            for kind, (size, samples) in sizes.items():
                for name in names:
                    with tempfile.TemporaryDirectory(prefix="bagua-cache-bench-") as scratch:
                        directory = private_directory(os.path.join(scratch, "store"))
                        store = {
                            "lmdb": lambda: LmdbStore(directory, capacity),
                            "sqlite-wal": lambda: SqliteStore(directory),
                            "files": lambda: FileStore(directory),
                            "memory": lambda: MemoryStore(capacity),
                            "redis-unix": lambda: RedisStore(server.url, digest_key=server.digest_key),
                        }[name]()
                        client.flushall()
                        result = store_throughput(store, samples, size, args.workers)
                    runs[name, kind].append(result)
                    print(
                        f"#{repeat} {kind:5s} {name:10s} put {result['put_per_s']:9.0f}/s get "
                        f"{result['get_per_s']:9.0f}/s hit rate {result['hit_rate']:.2f}",
                        flush=True,
                    )
    overhead = {kind: read_overhead(size) for kind, (size, _) in sizes.items()}
    finish_meta(meta)
    lines = [
        "# Cache stores: put and get throughput from DataLoader workers",
        "",
        *header_lines(meta),
        f"- {args.workers} DataLoader workers (fork); each worker puts, then gets, chunks of 50 samples; "
        f"{args.repeats} interleaved repeats, median shown; small = {args.small_samples} samples of 1 KiB, "
        f"large = {args.large_samples} samples of 128 KiB; a fresh store per run (Redis: one server, flushed).",
        "- memory: per process; it hits only because each worker reads back what it wrote itself.",
        "- a hit's cost in the cache itself (one process, a memory store, median of 2000 calls of "
        f"`CacheLoader.get`: its key, tag check (HMAC-SHA256) and unpickling): {overhead['small']['hit_s'] * 1e6:.1f} "
        f"us for 1 KiB, {overhead['large']['hit_s'] * 1e6:.0f} us for 128 KiB; unpickling alone "
        f"{overhead['small']['unpickle_s'] * 1e6:.1f} and {overhead['large']['unpickle_s'] * 1e6:.1f} us.",
        "",
        "| store | small put/s | small get/s | large put/s | large get/s | large get MB/s | hit rate |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    summary = {}
    for name in names:
        cells = {}
        for kind in sizes:
            for op in ("put_per_s", "get_per_s", "hit_rate"):
                cells[kind, op] = statistics.median(r[op] for r in runs[name, kind])
        summary[name] = {f"{k}_{op}": v for (k, op), v in cells.items()}
        lines.append(
            f"| {name} | {cells['small', 'put_per_s']:,.0f} | {cells['small', 'get_per_s']:,.0f} | "
            f"{cells['large', 'put_per_s']:,.0f} | {cells['large', 'get_per_s']:,.0f} | "
            f"{cells['large', 'get_per_s'] * (128 << 10) / 1e6:,.0f} | "
            f"{min(cells['small', 'hit_rate'], cells['large', 'hit_rate']):.2f} |"
        )
    lines.append("")
    payload = {
        "meta": meta,
        "summary": summary,
        "read_overhead": overhead,
        "runs": {f"{n}/{k}": v for (n, k), v in runs.items()},
    }
    for path in write_results(args.out, "cache-stores", lines, payload):
        print(f"wrote {path}")
    print("\n".join(lines))


class CountedDataset(SlowDecodeDataset):
    """:class:`SlowDecodeDataset` that counts its decodes in ``reads``, shared by forked processes."""

    def __init__(self, n: int, rounds: int, reads: Any) -> None:
        super().__init__(n, rounds)
        self.reads = reads

    def __getitem__(self, index: int) -> np.ndarray:
        with self.reads.get_lock():
            self.reads.value += 1
        return super().__getitem__(index)


NODE_RANKS, NODE_WORKERS = 4, 2
NODE_CACHES = ("no cache", "per process", "node (default)")


def node_rank(rank: int, cache: str, scratch: str, base: CountedDataset, costs: np.ndarray, barrier, queue) -> None:
    """One rank: its balanced batches through 2 DataLoader workers for 2 epochs, between barriers."""
    if cache == "per process":
        os.environ[ENV_CACHE_DIR] = os.path.join(scratch, f"rank-{rank}")
    dataset = base if cache == "no cache" else CachedDataset(base, name="bench")  # the default store
    batches = BalancedBatchSampler(costs, batch_size=16, num_replicas=NODE_RANKS, rank=rank)
    loader = DataLoader(dataset, batch_sampler=batches, num_workers=NODE_WORKERS, multiprocessing_context="fork")
    for epoch in range(2):
        batches.set_epoch(epoch)
        barrier.wait()
        start = time.perf_counter()
        samples = sum(len(batch) for batch in loader)
        queue.put((epoch, rank, time.perf_counter() - start, samples))
        barrier.wait()


def node_run(args: argparse.Namespace) -> None:
    """4 ranks x 2 workers with the balanced sampler: epoch-2 hit rate and time of each cache."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    meta = run_meta(PACKAGES, argv=sys.argv[1:])
    costs = np.random.default_rng(0).lognormal(4.3, 0.8, args.samples)
    rounds = calibrated_rounds()
    runs: dict[str, list[dict[str, float]]] = {cache: [] for cache in NODE_CACHES}
    for repeat in range(args.repeats):
        for cache in NODE_CACHES:
            reads = context.Value("q", 0)
            base = CountedDataset(args.samples, rounds, reads)
            barrier, queue = context.Barrier(NODE_RANKS + 1), context.SimpleQueue()
            with tempfile.TemporaryDirectory(prefix="bagua-cache-bench-") as scratch:
                os.environ[ENV_CACHE_DIR] = os.path.join(scratch, "node")
                ranks = [context.Process(target=node_rank, args=(r, cache, scratch, base, costs, barrier, queue))
                         for r in range(NODE_RANKS)]  # fmt: skip
                for proc in ranks:
                    proc.start()
                decoded = []
                for _ in range(2):
                    barrier.wait(timeout=600)
                    barrier.wait(timeout=600)
                    decoded.append(reads.value - sum(decoded))
                for proc in ranks:
                    proc.join(timeout=60)
            results = [queue.get() for _ in range(2 * NODE_RANKS)]
            seconds = [max(r[2] for r in results if r[0] == e) for e in range(2)]
            samples = sum(r[3] for r in results if r[0] == 1)
            run = {"epoch1_s": seconds[0], "epoch2_s": seconds[1], "epoch2_hit_rate": 1 - decoded[1] / samples}
            runs[cache].append(run)
            print(f"#{repeat} {cache:15s} epoch 1 {seconds[0]:6.2f} s, epoch 2 {seconds[1]:6.2f} s, "
                  f"epoch-2 hit rate {run['epoch2_hit_rate']:.3f}", flush=True)  # fmt: skip
    finish_meta(meta)
    transcript = Transcript()
    transcript.say(f"{args.samples} samples, ~{DECODE_SECONDS * 1e3:.0f} ms CPU decode, {NODE_RANKS} ranks x "
                   f"{NODE_WORKERS} DataLoader workers (fork), balanced sampler (batch 16), {args.repeats} "
                   "interleaved repeats; an epoch's time is its slowest rank's, medians shown")  # fmt: skip
    uncached = statistics.median(r["epoch2_s"] for r in runs["no cache"])
    transcript.say(
        f"{'cache':15s} {'epoch 1 s':>10s} {'epoch 2 s':>10s} {'epoch-2 hit rate':>17s} {'epoch 2 vs none':>16s}"
    )
    for cache, rows in runs.items():
        first, second = (statistics.median(r[k] for r in rows) for k in ("epoch1_s", "epoch2_s"))
        hit_rate = statistics.median(r["epoch2_hit_rate"] for r in rows)
        transcript.say(f"{cache:15s} {first:10.2f} {second:10.2f} {hit_rate:17.3f} {second / uncached:15.2f}x")
    markdown = transcript.markdown("One node's cache: 4 ranks x 2 workers, balanced sampler", meta)
    for path in write_results(args.out, "cache-node", markdown, {**meta, "runs": runs}):
        print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--compare-stores", action="store_true", help="measure the stores' put/get throughput")
    parser.add_argument("--node", action="store_true", help="4 ranks x 2 workers with the balanced sampler")
    parser.add_argument("--small-samples", type=int, default=20000, help="--compare-stores: 1 KiB samples")
    parser.add_argument("--large-samples", type=int, default=2000, help="--compare-stores: 128 KiB samples")
    add_out_option(parser)
    args = parser.parse_args()
    if args.compare_stores:
        compare_stores(args)
        return
    if args.node:
        node_run(args)
        return
    meta = run_meta(PACKAGES, argv=sys.argv[1:])
    rounds = calibrated_rounds()
    base = SlowDecodeDataset(args.samples, rounds)
    capacity = 256 << 20
    times: dict[str, list[tuple[float, float]]] = {
        "uncached": [],
        "lmdb": [],
        "redis": [],
    }
    epoch2_hit_rates: dict[str, list[float]] = {"redis": []}
    for _ in range(args.repeats):
        times["uncached"].append(tuple(epoch_seconds(base, args.workers) for _ in range(2)))
        with tempfile.TemporaryDirectory(prefix="bagua-cache-bench-") as scratch:
            lmdb_data = CachedDataset(base, LmdbStore(scratch, capacity), name="bench")
            times["lmdb"].append(tuple(epoch_seconds(lmdb_data, args.workers) for _ in range(2)))
            lmdb_data.loader.store.close()
        with RedisServer(capacity) as server:
            redis_data = CachedDataset(base, RedisStore(server.url, digest_key=server.digest_key), name="bench")
            first = epoch_seconds(redis_data, args.workers)
            hits0, misses0 = redis_hits(server)
            second = epoch_seconds(redis_data, args.workers)
            hits, misses = redis_hits(server)
            times["redis"].append((first, second))
            epoch2_hit_rates["redis"].append((hits - hits0) / (hits - hits0 + misses - misses0))
    finish_meta(meta)
    median = {k: [statistics.median(t[e] for t in v) for e in range(2)] for k, v in times.items()}
    uncached = statistics.median(t for pair in times["uncached"] for t in pair)
    transcript = Transcript()
    transcript.say(f"{args.samples} samples, ~{DECODE_SECONDS * 1e3:.0f} ms CPU decode ({rounds} FFT rounds),"
                   f" {args.workers} workers, {args.repeats} interleaved repeats; median seconds")  # fmt: skip
    transcript.say(f"{'store':10s} {'epoch 1':>8s} {'epoch 2':>8s} {'epoch-2 speed-up':>17s} {'epoch-1 overhead':>17s}")
    for name, (first, second) in median.items():
        transcript.say(f"{name:10s} {first:8.3f} {second:8.3f} {uncached / second:16.1f}x "
                       f"{100 * (first / median['uncached'][0] - 1):+16.0f}%")  # fmt: skip
    transcript.say(f"redis epoch-2 hit rate: {statistics.median(epoch2_hit_rates['redis']):.3f}")
    markdown = transcript.markdown("DataLoader epochs: uncached, LMDB cache, Redis cache", meta)
    payload = {**meta, "epoch_seconds": times, "redis_epoch2_hit_rates": epoch2_hit_rates["redis"]}
    for path in write_results(args.out, "cache-cpu", markdown, payload):
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""Epoch times of a DataLoader over a slow-to-decode dataset: uncached, LMDB cache, Redis cache.

Each sample costs a CPU-bound decode of about 3 ms (NumPy work, not a sleep, so the workers
really contend for the cores). Two DataLoader workers (fork, not persistent), two epochs per
run; the stores are fresh for every run and the configurations are interleaved and repeated.
Reported: median epoch times, epoch-2 speed-up over uncached, epoch-1 overhead, hit rates.

    python benchmarks/cache.py [--samples 1000] [--repeats 3] [--workers 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from torch.utils.data import DataLoader

from bagua_common.cache_stores import LmdbStore, RedisStore
from bagua_common.cached_dataset import CachedDataset
from bagua_common.redis_server import RedisServer

DECODE_SECONDS = 0.003


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
    info = RedisStore(server.url)._open()[0].info("stats")
    return info["keyspace_hits"], info["keyspace_misses"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
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
        lmdb_data = CachedDataset(base, LmdbStore(capacity_bytes=capacity), name="bench")
        times["lmdb"].append(tuple(epoch_seconds(lmdb_data, args.workers) for _ in range(2)))
        lmdb_data.loader.store.close()
        with RedisServer(capacity) as server:
            redis_data = CachedDataset(base, RedisStore(server.url), name="bench")
            first = epoch_seconds(redis_data, args.workers)
            hits0, misses0 = redis_hits(server)
            second = epoch_seconds(redis_data, args.workers)
            hits, misses = redis_hits(server)
            times["redis"].append((first, second))
            epoch2_hit_rates["redis"].append((hits - hits0) / (hits - hits0 + misses - misses0))
    median = {k: [statistics.median(t[e] for t in v) for e in range(2)] for k, v in times.items()}
    uncached = statistics.median(t for pair in times["uncached"] for t in pair)
    print(f"{args.samples} samples, ~{DECODE_SECONDS * 1e3:.0f} ms CPU decode ({rounds} FFT rounds),"
          f" {args.workers} workers, {args.repeats} interleaved repeats; median seconds")  # fmt: skip
    print(f"{'store':10s} {'epoch 1':>8s} {'epoch 2':>8s} {'epoch-2 speed-up':>17s} {'epoch-1 overhead':>17s}")
    for name, (first, second) in median.items():
        print(f"{name:10s} {first:8.3f} {second:8.3f} {uncached / second:16.1f}x "
              f"{100 * (first / median['uncached'][0] - 1):+16.0f}%")  # fmt: skip
    print(f"redis epoch-2 hit rate: {statistics.median(epoch2_hit_rates['redis']):.3f}")


if __name__ == "__main__":
    main()

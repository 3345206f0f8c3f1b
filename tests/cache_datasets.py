"""Datasets for the cache tests, importable by spawned DataLoader workers."""

import os

import numpy as np
import pytest

from bagua_common.data.redis_server import find_redis_server


def _have_redis_server() -> bool:
    try:
        find_redis_server()
        return True
    except FileNotFoundError:
        return False


# The marks of a test module that starts real redis-servers.
REDIS_SERVER_MARKS = [
    pytest.mark.skipif(not _have_redis_server(), reason="redis-server is not installed"),
    # Starting a child needs fork (for its preexec); JAX, if another test loaded it, warns.
    pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning"),
]


class CountingDataset:
    """Sample i is a deterministic array; every real read appends one line to ``log_path``."""

    def __init__(self, n: int, log_path: str, size: int = 64) -> None:
        self.n, self.log_path, self.size = n, log_path, size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        with open(self.log_path, "a") as log:
            log.write(f"{os.getpid()} {index}\n")
        return np.random.default_rng(index).standard_normal(self.size).astype(np.float32)


def reads(log_path: str) -> int:
    """How many samples were read from the dataset (not the cache)."""
    if not os.path.exists(log_path):
        return 0
    with open(log_path) as log:
        return sum(1 for _ in log)


def epoch_reads(dataset, log_path: str, num_workers: int, context: str) -> list[int]:
    """Run two DataLoader epochs over ``dataset``; return the dataset reads of each."""
    from torch.utils.data import DataLoader

    loader = DataLoader(
        dataset, batch_size=8, shuffle=True, num_workers=num_workers,
        multiprocessing_context=context, persistent_workers=False, timeout=120,
    )  # fmt: skip
    counts = []
    for _ in range(2):
        before = reads(log_path)
        total = sum(len(batch) for batch in loader)
        assert total == len(dataset)
        counts.append(reads(log_path) - before)
    return counts

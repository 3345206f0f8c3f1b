"""The data and the initial MLP weights of the digits examples, the same for both front ends."""

from __future__ import annotations

import numpy as np
from sklearn.datasets import load_digits


def load(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Standardized 8x8 digit images split into 1400 training and 397 test examples."""
    data = load_digits()
    x = data.data.astype(np.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], data.target[order].astype(np.int32)
    return x[:1400], y[:1400], x[1400:], y[1400:]


def init_mlp(hidden: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The weights of a 64-``hidden``-10 ReLU MLP: ``w1``, ``b1``, ``w2``, ``b2`` (float32)."""
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((64, hidden)) / 8).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, 10)) / np.sqrt(hidden)).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }


def add_arguments(parser, algorithms: list[str]) -> None:
    """The flags both examples take."""
    parser.add_argument("--algorithm", choices=algorithms, default="gradient_allreduce")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=128, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--log-every", type=int, default=50)


def rank_batches(x: np.ndarray, batch: int, steps: int, rank: int, size: int):
    """For each of ``steps`` random global batches (the same on every rank), this rank's slice of
    its indices into ``x``."""
    rng = np.random.default_rng(1)
    per_rank = batch // size
    for _ in range(steps):
        yield rng.choice(len(x), batch, replace=False)[rank * per_rank : (rank + 1) * per_rank]

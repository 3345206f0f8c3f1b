"""A small real task for convergence tests: an MLP on scikit-learn's bundled digits."""

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


def init_mlp(seed: int = 0, hidden: int = 32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": (rng.standard_normal((64, hidden)) / 8).astype(np.float32),
        "b1": np.zeros(hidden, np.float32),
        "w2": (rng.standard_normal((hidden, 10)) / np.sqrt(hidden)).astype(np.float32),
        "b2": np.zeros(10, np.float32),
    }


def batches(x: np.ndarray, y: np.ndarray, batch: int, steps: int, seed: int = 0):
    """``steps`` random global batches of ``batch`` examples."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        index = rng.choice(len(x), batch, replace=False)
        yield {"x": x[index], "y": y[index]}

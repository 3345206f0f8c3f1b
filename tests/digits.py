"""A small real task for convergence tests: an MLP on scikit-learn's bundled digits.

The data and the initial weights are the examples' (``examples/digits_data.py``), so the tests
train what the examples train.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import digits_data  # noqa: E402 - found through the examples folder added above
from digits_data import load  # noqa: E402

__all__ = ["batches", "init_mlp", "load"]


def init_mlp(seed: int = 0, hidden: int = 32) -> dict[str, np.ndarray]:
    """The weights of a 64-``hidden``-10 ReLU MLP (:func:`digits_data.init_mlp`)."""
    return digits_data.init_mlp(hidden, seed)


def batches(x: np.ndarray, y: np.ndarray, batch: int, steps: int, seed: int = 0):
    """``steps`` random global batches of ``batch`` examples."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        index = rng.choice(len(x), batch, replace=False)
        yield {"x": x[index], "y": y[index]}

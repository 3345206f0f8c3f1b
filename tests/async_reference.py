"""NumPy references for the asynchronous model averaging tests (JAX and torch): synchronous
and local SGD on the linear regression of ``async_workers.py``, and the check that background
averaging kept the ranks together and trained."""

from __future__ import annotations

import numpy as np
from async_workers import BATCH, DIM, LR, batch, optimum


def numpy_grad(theta: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Gradient of ``0.5 * mean((x w + b - y)^2)`` with respect to ``[w, b]``."""
    residual = x @ theta[:DIM] + theta[DIM] - y
    return np.concatenate([x.T @ residual / BATCH, [residual.mean()]]).astype(np.float32)


def numpy_sgd(seed: int, n: int, steps: int, averaged_steps: int) -> np.ndarray:
    """All n ranks' weights after each step: gradients averaged for the first ``averaged_steps``
    steps (synchronous allreduce SGD), local SGD afterwards. Shape ``[steps, n, DIM + 1]``."""
    theta = np.zeros((n, DIM + 1), np.float32)
    history = []
    for t in range(steps):
        grads = np.stack([numpy_grad(theta[r], *batch(seed, r, t)) for r in range(n)])
        if t < averaged_steps:
            grads[:] = grads.mean(0)
        theta = (theta - np.float32(LR) * grads).astype(np.float32)
        history.append(theta.copy())
    return np.stack(history)


def excess_loss(thetas: np.ndarray, seed: int, n: int) -> np.ndarray:
    """The loss over all ranks' data of each ``[..., DIM + 1]`` weight vector, as the fraction of the
    initial loss (zero weights) above the best consensus (the mean of the optima). With x standard
    normal the expected loss is half the mean squared distance to the ranks' optima (noise left out)."""
    optima = np.stack([optimum(seed, r) for r in range(n)]).astype(np.float64)

    def loss(theta: np.ndarray) -> np.ndarray:
        return 0.5 * np.mean(np.sum((theta[..., None, :] - optima) ** 2, -1), -1)

    best = loss(optima.mean(0))
    return (loss(np.asarray(thetas, np.float64)) - best) / (loss(np.zeros(DIM + 1)) - best)


def check_averaged_training(got: np.ndarray, running: list[list[bool]], seed: int, warmup: int) -> None:
    """Assert that background averaging after ``warmup`` steps kept the ranks' weights ``got``
    (``[step, rank, DIM + 1]``) together and trained them, against local SGD from the same start.

    Ranks step at uneven speeds (2 cores for n processes): once the first rank finishes and aborts,
    the others' last steps are local, so only the steps every rank took with its averaging thread
    running (``running[rank][step]``) are judged.
    """
    n = got.shape[1]
    local = numpy_sgd(seed, n, got.shape[0], averaged_steps=warmup)
    last = min(max(t for t, on in enumerate(flags) if on) for flags in running)
    assert last >= warmup + 50, [sum(flags) for flags in running]

    def spread(thetas: np.ndarray) -> float:  # mean distance of the ranks from their mean
        return float(np.mean(np.linalg.norm(thetas - thetas.mean(0), axis=-1)))

    # Alone, each rank converges to its own optimum; averaging keeps the replicas together.
    averaged_spread = np.mean([spread(got[t]) for t in range(warmup, last + 1)])
    local_spread = np.mean([spread(local[t]) for t in range(warmup, last + 1)])
    assert averaged_spread < 0.5 * local_spread, (averaged_spread, local_spread)
    # The loss over all ranks' data goes down, well below where the ranks get alone, over the last
    # 20 judged steps. Typically 0-5% of the initial excess with averaging versus 7-35% alone; a
    # rank whose thread was starved for a while under load can sit near 8% at one step, hence the
    # window and the factor 2 on the mean, and each rank below the mean alone.
    window = slice(last - 19, last + 1)
    excess = excess_loss(got[window], seed, n)  # [20, n]
    excess_alone = excess_loss(local[window], seed, n)
    assert excess.mean() < 0.5 * excess_alone.mean(), (excess.mean(0), excess_alone.mean(0))
    assert excess.mean(0).max() < excess_alone.mean(), (excess.mean(0), excess_alone.mean(0))

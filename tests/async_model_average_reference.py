"""NumPy references for the asynchronous model averaging tests (JAX and torch): synchronous
and local SGD on a linear regression whose data are plain NumPy (each rank with its own optimum,
so that ranks training alone drift apart), and the replay of the
background averaging rounds that ran (judged on what each step did, not on how many rounds
the machine's load let through)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

DIM = 8
BATCH = 32
LR = 0.1


def optimum(seed: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s own least-squares optimum ``[w*, b*]``: a shared part plus a rank offset,
    so that ranks training alone drift apart."""
    shared = np.random.default_rng([seed, 999]).standard_normal(DIM + 1)
    offset = np.random.default_rng([seed, 1000 + rank]).standard_normal(DIM + 1)
    return (shared + 0.5 * offset).astype(np.float32)


def batch(seed: int, rank: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s fresh minibatch for ``step``: ``y = x w* + b* + noise``."""
    rng = np.random.default_rng([seed, rank, step])
    theta = optimum(seed, rank)
    x = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    y = (x @ theta[:DIM] + theta[DIM] + 0.01 * rng.standard_normal(BATCH)).astype(np.float32)
    return x, y


def rank_params(seed: int, rank: int, tag: int) -> dict:
    """Random parameters of two dtypes (a float32 matrix, a bfloat16 vector) for the update-rule test."""
    import ml_dtypes

    rng = np.random.default_rng([seed, rank, tag])
    return {
        "w": rng.standard_normal((5, 3)).astype(np.float32),
        "b": rng.standard_normal(7).astype(ml_dtypes.bfloat16),
    }


def check_one_round(out: dict[str, np.ndarray], seed: int, n: int, rank: int, corrected_from: int) -> None:
    """Assert what one finished averaging round made of ``rank``'s parameters (``out``, as float32 values).

    Each parameter ``x = rank_params(seed, rank, corrected_from)`` becomes the kernel's
    ``x + sum / n - snapshot``, the sum over the ranks' snapshots ``rank_params(seed, r, 0)``, rounded once to its
    dtype. Two snapshots add up alike in any order, so with n == 2 that is exact; with more, the collective may add
    them in another order (float32 roundings of the sum's terms, divided by n), and bfloat16 rounds once more.
    """
    from kernels_reference import async_average

    snapshots = [rank_params(seed, r, 0) for r in range(n)]
    x = rank_params(seed, rank, corrected_from)
    assert sorted(out) == sorted(x), sorted(out)
    for key, got in out.items():
        sums = np.sum([s[key].astype(np.float64) for s in snapshots], 0).astype(np.float32)
        expected = async_average(x[key], sums, snapshots[rank][key], n).astype(x[key].dtype).astype(np.float32)
        if n == 2:
            np.testing.assert_array_equal(got, expected, err_msg=key)
        else:
            bound = n * float(np.finfo(np.float32).eps) * np.abs(np.stack([s[key] for s in snapshots])).max()
            if x[key].dtype != np.float32:
                bound = bound + 2.0**-8 * np.abs(expected)
            np.testing.assert_array_less(np.abs(got - expected), bound + 1e-30, err_msg=key)


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


TOLERANCE = 2e-5
"""How far a step may be from its NumPy replay: float32 roundings of the framework's gradient, of
the allreduce's sum and of the correction kernel versus NumPy's, on weights of size ~1. A round's
correction moves the weights by at least a local step of the ranks apart (~1e-2)."""


def corrections(got: np.ndarray, seed: int, warmup: int) -> np.ndarray:
    """What each step after warm-up added to the local SGD step from the previous step's weights:
    zero on a local step, ``sum / n - s`` on a step that applied a round. ``got`` is
    ``[step, rank, DIM + 1]``; the result is ``[step, rank, DIM + 1]``, zero during warm-up."""
    steps, n, _ = got.shape
    added = np.zeros_like(got)
    for t in range(max(warmup, 1), steps):
        for r in range(n):
            local = got[t - 1, r] - np.float32(LR) * numpy_grad(got[t - 1, r], *batch(seed, r, t))
            added[t, r] = got[t, r] - local
    return added


def replay_rounds(got: np.ndarray, seed: int, warmup: int, rounds: int) -> list[np.ndarray]:
    """Assert that background averaging after ``warmup`` steps did exactly what the algorithm says,
    on the rounds that ran, whatever their timing; return each round's average ``sum / n``.

    ``got`` is every rank's weights after each step (``[step, rank, DIM + 1]``), ``rounds`` the
    rounds completed. Every step must be a local SGD step from the previous weights, plus, on the
    step that applied round k, ``m_k - s_{k,r}``: ``s_{k,r}`` the rank's weights after some step
    since its previous round was applied (its snapshot) and ``m_k`` the mean of all ranks'
    snapshots. Every rank applies rounds 1 .. rounds - 1; the last may finish after a rank's
    final step. A rank never applies a round twice or one that did not run.
    """
    steps, n, _ = got.shape
    added = corrections(got, seed, warmup)
    applied = [[t for t in range(steps) if np.abs(added[t, r]).max() > TOLERANCE] for r in range(n)]
    assert all(len(ts) in (rounds - 1, rounds) for ts in applied), (rounds, applied)
    averages = []
    since = [warmup] * n  # the first step whose weights may be a snapshot of the next round
    for k in range(min(len(ts) for ts in applied)):
        at = [ts[k] for ts in applied]
        # m_k seen from each rank: its snapshot plus its correction; the same for every rank.
        candidates = [got[since[r] : at[r], r] + added[at[r], r] for r in range(n)]
        average = _common_point(candidates)
        assert average is not None, f"round {k + 1}: no snapshots with a common average at steps {at}"
        snapshots = [c[np.abs(c - average).max(-1) <= TOLERANCE][0] - added[at[r], r] for r, c in enumerate(candidates)]
        np.testing.assert_allclose(np.mean(snapshots, 0), average, atol=TOLERANCE)
        averages.append(average)
        since = [t + 1 for t in at]
    return averages


def _common_point(candidates: list[np.ndarray]) -> np.ndarray | None:
    """A row of ``candidates[0]`` that every other ``[rows, D]`` array holds too (within
    ``TOLERANCE``), or None."""
    for point in candidates[0]:
        if all((np.abs(c - point).max(-1) <= TOLERANCE).any() for c in candidates[1:]):
            return point
    return None


def check_averaged_training(got: np.ndarray, seed: int, warmup: int, rounds_per_rank: list[int]) -> None:
    """Assert that every rank ran the same rounds (at least 3; each is a collective of all), that they averaged
    the ranks' weights exactly (:func:`replay_rounds`), and that they trained: the averages' loss over all ranks'
    data goes down to a small fraction of the first round's. (How far the ranks drift between rounds depends on
    how many rounds the machine's load let through, so it is not judged.)"""
    assert len(set(rounds_per_rank)) == 1 and rounds_per_rank[0] >= 3, rounds_per_rank
    rounds = rounds_per_rank[0]
    averages = np.stack(replay_rounds(got, seed, warmup, rounds))
    n = got.shape[1]
    excess = excess_loss(averages, seed, n)
    assert excess[-1] < 0.5 * excess[0] and excess[-1] < 0.1, excess


def abort_and_resume(rounds: Any, steps: Callable[[int], None], rank: int, resume: Callable[[], Any]) -> dict:
    """The abort/resume scenario on either front end's rounds (``abort``, ``resume``, ``rounds``, ``running``):
    abort at staggered times on every rank, ``resume()`` (its result is kept), abort on rank 0 only (every other
    rank keeps stepping, ``steps(n)``, until that stops its thread too), then resume and abort at once."""
    out: dict[str, Any] = {}
    steps(100)
    time.sleep(0.05 * rank)  # the ranks ask to stop at different times
    rounds.abort()
    out["a"] = (rounds.rounds, rounds.running)
    steps(20)  # no rounds while aborted
    out["a_after_steps"] = rounds.rounds
    out["resume"] = resume()
    steps(100)
    if rank == 0:
        rounds.abort()
        out["stopped_by_peer"] = None
    else:
        # Rank 0's abort must stop this rank's thread too, while this loop keeps stepping.
        deadline = time.monotonic() + 20
        while rounds.running and time.monotonic() < deadline:
            steps(1)
        out["stopped_by_peer"] = not rounds.running
        rounds.abort()
    out["b"] = (rounds.rounds, rounds.running)
    rounds.resume()
    rounds.abort()  # possibly before the first round's flag: must not hang either
    out["c"] = (rounds.rounds, rounds.running)
    return out


def one_rank_stalls(
    rounds: Any, step: Callable[[], None], timed_step: Callable[[], float], rank: int, stall_s: float
) -> dict:
    """Rank 1 stops stepping for ``stall_s`` seconds, which keeps rank 0's round in flight, while rank 0 keeps
    stepping: ``step_s``, the seconds of each of its ``timed_step()`` (which returns them), must stay short."""
    out: dict[str, Any] = {"rounds_before": rounds.rounds}
    if rank == 1:
        time.sleep(stall_s)
    else:
        durations = []
        start = time.monotonic()
        while time.monotonic() - start < 0.8 * stall_s:
            durations.append(timed_step())
            time.sleep(0.001)
        out["step_s"] = np.array(durations)
        out["loop_s"] = time.monotonic() - start
    out["rounds_during"] = rounds.rounds - out["rounds_before"]
    for _ in range(5):
        step()
    rounds.abort()
    out["rounds"] = rounds.rounds
    return out

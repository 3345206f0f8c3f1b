"""DiLoCo simulated for every rank in one process with NumPy, from the definitions of issue 34.

The model is a set of named parameters with the loss ``0.5 * sum((p - target)^2)`` per
parameter, so rank ``r``'s gradient at step ``t`` is ``p - target(t, r)``, computed exactly in
every front end. The inner optimizer is plain SGD; the outer one Nesterov SGD
(``m = mu m + g``, ``anchor -= lr (g + mu m)``) or plain SGD (``momentum=0``).
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
SHAPES = {"a": (5, 3), "b": (3,), "c": (7,)}  # in the order both front ends list them
INNER_LR = 0.1


def initial(seed: int) -> dict[str, np.ndarray]:
    g = np.random.default_rng([seed, 7])
    return {k: g.standard_normal(s).astype(F32) for k, s in SHAPES.items()}


def target(seed: int, step: int, rank: int) -> dict[str, np.ndarray]:
    """What rank ``rank`` pulls its parameters towards at inner step ``step`` (counted from 1)."""
    g = np.random.default_rng([seed, step, rank])
    return {k: (g.standard_normal(s) + rank).astype(F32) for k, s in SHAPES.items()}


def fragments_of(names: list[str], parts: int) -> list[list[str]]:
    """The fragments for this model's three parameters (sizes 15, 3, 7): one, or {a} and {b, c}."""
    return {1: [names], 2: [names[:1], names[1:]], 3: [[n] for n in names]}[parts]


def simulate(
    n: int,
    steps: int,
    seed: int,
    *,
    sync_every: int,
    fragments: int = 1,
    delay: int = 0,
    alpha: float = 0.0,
    outer_lr: float = 0.7,
    momentum: float = 0.9,
) -> list[list[dict[str, np.ndarray]]]:
    """Every rank's parameters after every inner step (``history[t - 1][r]``)."""
    names = list(SHAPES)
    xs = [initial(seed) for _ in range(n)]
    anchor = initial(seed)
    trace = {k: np.zeros(s, np.float64) for k, s in SHAPES.items()}
    pending: dict[int, dict[str, np.ndarray]] = {}
    history = []
    for t in range(1, steps + 1):
        for r in range(n):
            goal = target(seed, t, r)
            xs[r] = {k: (x - F32(INNER_LR) * (x - goal[k])).astype(F32) for k, x in xs[r].items()}
        for p, part in enumerate(fragments_of(names, fragments)):
            offset = p * sync_every // fragments
            if (t - offset) % sync_every == 0:
                pending[p] = {k: np.mean([anchor[k] - xs[r][k] for r in range(n)], axis=0) for k in part}
            if t - delay >= 1 and (t - delay - offset) % sync_every == 0:
                for k in part:
                    g = pending[p][k].astype(np.float64)
                    trace[k] = momentum * trace[k] + g
                    step = g + momentum * trace[k] if momentum else g
                    anchor[k] = (anchor[k] - outer_lr * step).astype(F32)
                    for r in range(n):
                        xs[r][k] = (alpha * xs[r][k] + (1 - alpha) * anchor[k]).astype(F32)
        history.append([{k: v.copy() for k, v in x.items()} for x in xs])
    return history


def h1_allreduce_atol(histories: list[list[dict[str, np.ndarray]]], steps: int, name: str) -> float:
    """How far DiLoCo with ``sync_every=1`` and plain outer SGD may sit from gradient allreduce after ``steps`` steps.

    Each step rounds the inner step ``x = θ - ηg`` to float32, so the pseudo-gradient ``θ - x`` is
    ``ηg`` only up to about ``eps·|θ|`` (θ's magnitude, not ηg's); the mean and the outer step
    ``θ - mean`` round once more at that magnitude. This loss's SGD contracts errors, so the
    steps' errors at most add up. ``histories`` are the runs' parameters, ``[run][step][name]``.
    """
    eps = float(np.finfo(F32).eps)
    return sum(4 * eps * max(float(np.max(np.abs(h[t][name]))) for h in histories) for t in range(steps))

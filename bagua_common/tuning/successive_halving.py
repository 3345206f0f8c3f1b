"""Successive halving over a small discrete grid, driven by ask and tell.

Each round gives every surviving candidate ``samples_per_round`` more timing samples and keeps
the fastest ``1/eta`` of them by the median of all their samples so far (the median, because
step times on a shared machine have long upper tails), until one is left: survivors are
measured ever more precisely while the cost of a round shrinks with the field. A candidate
whose sample failed (``tell(..., None)``: an error or a timeout) is out for good, whatever its
earlier samples said, so a noisy timing can never pick it. The driver never calls the objective
itself: the training loop asks which candidate to run next and tells how long its steps took,
as optuna's ask/tell interface does.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

Candidate = TypeVar("Candidate", bound=Hashable)


class SuccessiveHalving(Generic[Candidate]):
    """Ask/tell successive halving: ``ask()`` names the candidate to sample next, ``tell()`` records it.

    ``candidates`` are the grid's points (at least one, no repeats). Each round, every survivor gets
    ``samples_per_round`` samples and the field shrinks by ``eta``, so a search of ``c`` candidates
    costs about ``samples_per_round * c * eta / (eta - 1)`` samples. ``done`` is true once one
    candidate is left (or none, when all failed), and ``best`` is then the winner.
    """

    def __init__(self, candidates: Sequence[Candidate], *, samples_per_round: int = 3, eta: int = 2) -> None:
        if not candidates:
            raise ValueError("successive halving needs at least one candidate")
        if len(set(candidates)) != len(candidates):
            raise ValueError(f"successive halving: candidates repeat: {list(candidates)!r}")
        if isinstance(samples_per_round, bool) or not isinstance(samples_per_round, int) or samples_per_round < 1:
            raise ValueError(f"successive halving: samples_per_round must be a positive int, got {samples_per_round!r}")
        if isinstance(eta, bool) or not isinstance(eta, int) or eta < 2:
            raise ValueError(f"successive halving: eta must be an int >= 2, got {eta!r}")
        self._eta = eta
        self._per_candidate = samples_per_round
        self._alive: list[Candidate] = list(candidates)
        self._failed: set[Candidate] = set()
        self._samples: dict[Candidate, list[float]] = {c: [] for c in candidates}
        self._round_samples: dict[Candidate, int] = {c: 0 for c in candidates}

    @property
    def done(self) -> bool:
        """True once at most one candidate is left: nothing more to ask."""
        return len(self._alive) <= 1

    @property
    def best(self) -> Candidate:
        """The winner; a RuntimeError before the search is done or when every candidate failed."""
        if not self.done:
            raise RuntimeError("successive halving: the search is not done yet")
        if not self._alive:
            raise RuntimeError(f"successive halving: every candidate failed: {sorted(map(repr, self._failed))}")
        return self._alive[0]

    @property
    def failed(self) -> frozenset[Candidate]:
        """The candidates excluded because a sample failed."""
        return frozenset(self._failed)

    def medians(self) -> dict[Candidate, float]:
        """The median of every sample recorded so far, per candidate that has samples and has not failed."""
        return {c: statistics.median(s) for c, s in self._samples.items() if s and c not in self._failed}

    def ask(self) -> Candidate:
        """The candidate whose next sample the search needs (the one with fewest samples this round)."""
        if self.done:
            raise RuntimeError("successive halving: the search is done; read best")
        return min(self._alive, key=lambda c: self._round_samples[c])

    def tell(self, candidate: Candidate, seconds: float | None) -> None:
        """Record one sample of ``candidate``: its step time in seconds, or None when the sample failed."""
        if candidate not in self._samples:
            raise ValueError(f"successive halving: unknown candidate {candidate!r}")
        if candidate not in self._alive:
            return
        if seconds is None or not math.isfinite(seconds) or seconds < 0:
            self._failed.add(candidate)
            self._alive.remove(candidate)
        else:
            self._samples[candidate].append(float(seconds))
            self._round_samples[candidate] += 1
        if self._alive and all(self._round_samples[c] >= self._per_candidate for c in self._alive):
            self._halve()

    def _halve(self) -> None:
        medians = self.medians()
        keep = max(1, math.ceil(len(self._alive) / self._eta))
        self._alive = sorted(self._alive, key=lambda c: medians[c])[:keep]
        self._round_samples = {c: 0 for c in self._alive}


def minimize(
    candidates: Sequence[Candidate],
    sample: Callable[[Candidate], float | None],
    *,
    samples_per_round: int = 3,
    eta: int = 2,
) -> tuple[Candidate, int]:
    """Run successive halving to the end with ``sample`` as the objective; returns (best, samples spent).

    ``sample(candidate)`` returns one noisy measurement, or None when the candidate failed; an exception
    it raises counts as a failure too.
    """
    search = SuccessiveHalving(candidates, samples_per_round=samples_per_round, eta=eta)
    spent = 0
    while not search.done:
        candidate = search.ask()
        try:
            value = sample(candidate)
        except Exception:
            value = None
        spent += 1
        search.tell(candidate, value)
    return search.best, spent

"""Interleaved repeats and what is published of them: the median with its [min, max].

A shared machine's load drifts over minutes, so a study never times one variant's repeats back to back: every
repeat runs every variant once, in an order that rotates from repeat to repeat (:func:`rotated`), so that no
variant always runs first or always after the same neighbour. A figure is then the median over the repeats
with the smallest and largest beside it (:class:`Spread`); a ratio of two variants is taken per repeat, between
the two runs that were closest in time, before its median is (:func:`paired_ratios`).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def rotated(items: Sequence[T], repeat: int) -> list[T]:
    """``items`` rotated left by ``repeat``: interleaved repeats start from a different item each, so that no item
    always runs first (or right after the same neighbour)."""
    if not items:
        return []
    shift = repeat % len(items)
    return [*items[shift:], *items[:shift]]


def alternated(items: Sequence[T], repeat: int) -> list[T]:
    """``items`` in order on even repeats and reversed on odd ones (A B, B A, ...): for a pair, each runs first
    as often as the other."""
    return list(items) if repeat % 2 == 0 else list(items)[::-1]


@dataclasses.dataclass(frozen=True)
class Spread:
    """The median of ``values`` (at least one) and their smallest and largest."""

    values: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.values:
            raise ValueError("a Spread needs at least one value")

    @property
    def median(self) -> float:
        """The median of the values."""
        return statistics.median(self.values)

    @property
    def low(self) -> float:
        """The smallest value."""
        return min(self.values)

    @property
    def high(self) -> float:
        """The largest value."""
        return max(self.values)

    def scaled(self, factor: float) -> Spread:
        """Every value times ``factor`` (e.g. seconds to milliseconds)."""
        return Spread(tuple(v * factor for v in self.values))

    def format(self, spec: str = ".3g", unit: str = "") -> str:
        """``median unit [min, max]``, each number formatted by ``spec``; one value alone is printed alone."""
        if len(self.values) == 1:
            return f"{self.median:{spec}}{unit}"
        return f"{self.median:{spec}}{unit} [{self.low:{spec}}, {self.high:{spec}}]"

    def as_dict(self) -> dict[str, Any]:
        """``median``, ``min``, ``max``, ``n`` and the ``values``, for a results file."""
        return {"median": self.median, "min": self.low, "max": self.high, "n": len(self.values), "values": self.values}


def spread(values: Iterable[float]) -> Spread:
    """The :class:`Spread` of ``values``."""
    return Spread(tuple(float(v) for v in values))


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> Spread:
    """The ratios of two variants' figures repeat by repeat (each pair ran next to each other), as a spread."""
    if len(numerators) != len(denominators):
        raise ValueError(
            f"paired_ratios needs as many numerators as denominators, got {len(numerators)} and {len(denominators)}"
        )
    return spread(a / b for a, b in zip(numerators, denominators))

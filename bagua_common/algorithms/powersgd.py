"""PowerSGD's configuration and the rule that decides which gradients are compressed.

PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019) approximates each matrix-shaped
gradient ``M`` (``n x m``; a tensor of higher rank is viewed as ``shape[0] x rest``) by a
rank-``r`` product ``P Q^T``, found with one step of power iteration per training step:

    M = grad + residual              (error feedback)
    P = allreduce_sum(M Q)           (one flat allreduce for every matrix's P)
    P = orthogonalize(P)             (Gram-Schmidt on the columns)
    Q = allreduce_sum(M^T P) / n     (one flat allreduce for every matrix's Q)
    grad = P Q^T;  residual = M - P Q^T

``Q`` is kept from step to step (warm start) and starts from the same seeded random matrix on
every rank, so every rank computes the same ``P Q^T``. Gradients that would gain too little
(vectors, small or thin matrices: ``n m <= min_compression_rate (n + m) r``) are averaged
uncompressed, riding in the same allreduce as the ``P`` factors. During the first
``start_iter`` steps every gradient is averaged exactly.

This module is framework-neutral; ``bagua_jax`` and ``bagua_torch`` each execute the step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

NAME = "powersgd"


def matrix_view(shape: Sequence[int]) -> tuple[int, int] | None:
    """The ``(n, m)`` matrix PowerSGD sees for a tensor of ``shape``, or None for a vector or scalar."""
    if len(shape) < 2:
        return None
    return int(shape[0]), int(math.prod(shape[1:]))


@dataclass(frozen=True)
class PowerSGDConfig:
    """PowerSGD's settings: ``rank`` of the approximation, exact steps first, error feedback, warm start.

    ``min_compression_rate``: a matrix is compressed only when its ``n m`` elements are at
    least this many times the ``(n + m) r`` its factors send. ``seed`` seeds the initial ``Q``
    (the same on every rank).
    """

    name: ClassVar[str] = NAME

    rank: int = 4
    start_iter: int = 10
    min_compression_rate: float = 2.0
    error_feedback: bool = True
    warm_start: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("rank", "start_iter", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{NAME}: {name} must be an int, got {value!r}")
        if self.rank < 1:
            raise ValueError(f"{NAME}: rank must be at least 1, got {self.rank}")
        if self.start_iter < 0:
            raise ValueError(f"{NAME}: start_iter must be >= 0, got {self.start_iter}")
        if not isinstance(self.min_compression_rate, (int, float)) or not self.min_compression_rate >= 1:
            raise ValueError(f"{NAME}: min_compression_rate must be a number >= 1, got {self.min_compression_rate!r}")
        for name in ("error_feedback", "warm_start"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{NAME}: {name} must be a bool, got {getattr(self, name)!r}")

    def compressed_rank(self, shape: Sequence[int]) -> int | None:
        """The rank a tensor of ``shape`` is compressed with, or None if it is sent uncompressed.

        The rank is capped at ``min(n, m)``; a matrix whose factors would not save
        ``min_compression_rate`` times its size is not compressed.
        """
        view = matrix_view(shape)
        if view is None:
            return None
        n, m = view
        rank = min(self.rank, n, m)
        # torch's PowerSGD hook draws the same line: compress when the factors are smaller by more
        # than ``min_compression_rate``.
        if not self.min_compression_rate * (n + m) * rank < n * m:
            return None
        return rank

    def check_compressible(self, shapes: Sequence[Sequence[int]]) -> None:
        """Raise a ValueError if ``rank`` is larger than every matrix allows (nothing would compress)."""
        views = [matrix_view(s) for s in shapes]
        largest = max((min(v) for v in views if v is not None), default=0)
        if largest and self.rank > largest:
            raise ValueError(
                f"{NAME}: rank {self.rank} is larger than any gradient matrix allows (the largest "
                f"min(n, m) is {largest}); choose rank <= {largest}"
            )

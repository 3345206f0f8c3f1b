"""NumPy reference of the floor under QAdam's and 1-bit Adam's frozen second moment.

The rule is ``bagua_common.algorithms.frozen_variance``'s, written here independently of both front ends:
per tensor, ``VARIANCE_FLOOR`` times the tensor's mean second moment, or the whole model's mean
where the tensor's is zero; the bound on each coordinate's step; and which tensors 1-bit Adam holds still.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

VARIANCE_FLOOR = np.float32(0.01)
STEP_BOUND = np.float32(1.0)
"""After the warm-up each coordinate's direction ``m_hat / (sqrt(v_hat) + eps)`` is clipped to +-STEP_BOUND."""
NEGLIGIBLE_VARIANCE = 1e-12


def variance_floors(
    second_moments: dict[str, np.ndarray],
    mean: Callable[[np.ndarray], float] = lambda v: float(np.sum(v, dtype=np.float64) / max(v.size, 1)),
) -> dict[str, np.float32]:
    """Per tensor name, the float32 floor under its frozen second moment. ``mean`` computes a
    tensor's mean (a test that compares bits passes its framework's float32 summation)."""
    means = {k: np.float32(mean(v)) for k, v in second_moments.items()}
    total = max(sum(v.size for v in second_moments.values()), 1)
    overall = np.float32(sum(float(means[k]) * v.size for k, v in second_moments.items()) / total)
    return {k: VARIANCE_FLOOR * (m if m > 0 else overall) for k, m in means.items()}


def negligible(second_moments: dict[str, np.ndarray]) -> dict[str, bool]:
    """Per tensor name, whether its mean second moment is at most NEGLIGIBLE_VARIANCE times the whole model's (zero
    throughout included): 1-bit Adam holds its momentum at zero."""
    sums = {k: float(np.sum(v, dtype=np.float64)) for k, v in second_moments.items()}
    overall = sum(sums.values()) / max(sum(v.size for v in second_moments.values()), 1)
    return {k: sums[k] <= NEGLIGIBLE_VARIANCE * overall * v.size for k, v in second_moments.items()}

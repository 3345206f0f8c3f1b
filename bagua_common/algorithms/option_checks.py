"""Validation of the algorithm options both front ends share, with one wording of each error.

Each check takes the algorithm's registry name, so a bad value is reported the same way
whether it was given to ``bagua_jax`` or to ``bagua_torch``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from bagua_common.comm.bucket_plan import check_bucket_bytes as check_bucket_bytes  # one check, with the buckets

_INTS = (int, np.integer)
_NUMBERS = (int, float, np.integer, np.floating)


def check_communication_interval(interval: Any, algorithm: str) -> int:
    """``interval`` as an int if it is a positive integer, else a ValueError naming it."""
    if isinstance(interval, bool) or not isinstance(interval, _INTS) or interval < 1:
        raise ValueError(f"{algorithm}: communication_interval must be a positive int, got {interval!r}")
    return int(interval)


def check_sync_interval_ms(value: Any, algorithm: str) -> float:
    """``value`` as a float if it is a finite number of milliseconds >= 0, else a ValueError."""
    number = not isinstance(value, bool) and isinstance(value, _NUMBERS)
    if not number or not math.isfinite(value) or value < 0:
        raise ValueError(
            f"{algorithm}: sync_interval_ms must be a finite number of milliseconds >= 0 "
            f"(0: rounds back to back), got {value!r}"
        )
    return float(value)


def check_warmup_steps(value: Any, algorithm: str) -> int:
    """``value`` as an int if it is a non-negative integer, else a ValueError naming it."""
    if isinstance(value, bool) or not isinstance(value, _INTS) or value < 0:
        raise ValueError(f"{algorithm}: warmup_steps must be a non-negative int, got {value!r}")
    return int(value)


def check_flags(algorithm: str, **flags: Any) -> None:
    """Raise a TypeError unless every keyword argument is a bool (catches e.g. ``average="sum"``)."""
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise TypeError(f"{algorithm}: {key} must be a bool, got {value!r}")

"""The collective timeout: how long any collective may wait before it raises."""

from __future__ import annotations

import os
from datetime import timedelta

DEFAULT_TIMEOUT_SECONDS = 300.0
ENV_VAR = "BAGUA_COMM_TIMEOUT"


def default_timeout() -> float:
    """Return the default collective timeout in seconds: ``BAGUA_COMM_TIMEOUT`` if set, else 300.

    The environment variable is read on each call, so a test or launcher may set it before
    creating a communicator. It must hold a positive, finite number of seconds; anything else
    raises a ``ValueError`` naming the variable and the value.
    """
    text = os.environ.get(ENV_VAR)
    if text is None or not text.strip():
        return DEFAULT_TIMEOUT_SECONDS
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{ENV_VAR} must be a number of seconds, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise ValueError(f"{ENV_VAR} must be a positive, finite number of seconds, got {text!r}")
    return value


def timeout_seconds(timeout: float | timedelta | None) -> float:
    """Return ``timeout`` in seconds, or :func:`default_timeout` when it is ``None``.

    Accepts a number of seconds or a ``datetime.timedelta``; a non-positive or non-finite
    value raises a ``ValueError``.
    """
    if timeout is None:
        return default_timeout()
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    if not 0 < seconds < float("inf"):
        raise ValueError(f"timeout must be a positive, finite number of seconds, got {timeout!r}")
    return seconds

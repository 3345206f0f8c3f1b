"""Bagua's ``bagua.torch_api.utils``: flat buffers of tensors, and the small helpers Bagua's tests and examples import.

``flatten(tensors)`` is one 1-D tensor holding the tensors' elements in order, ``unflatten(flat,
tensors)`` the views of it shaped like ``tensors``; :func:`apply_flattened_call` runs a collective
over a list of tensors as one flat buffer. :class:`StatisticalAverage` keeps the time-weighted
average of a value over the last 1, 2, 4, ... seconds. Where Bagua's differ: ``flatten`` and
``unflatten`` are written here (Bagua aliased torch's private ``torch._utils`` helpers), and
:meth:`StatisticalAverage.get` returns the tail's mean where Bagua's returned its length.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "StatisticalAverage",
    "apply_flattened_call",
    "apply_flattened_call_all",
    "average_by_removing_extreme_values",
    "check_contiguous",
    "flatten",
    "get_flattened_tensor",
    "to_bagua_datatype",
    "unflatten",
]

_BAGUA_DATATYPES = {torch.float32: "f32", torch.float16: "f16", torch.uint8: "u8", torch.long: "i64"}


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new 1-D tensor with the elements of ``tensors`` (same dtype and device), one after the other."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``tensors``, in order (the inverse of :func:`flatten`)."""
    views, offset = [], 0
    for t in tensors:
        views.append(flat.narrow(0, offset, t.numel()).view_as(t))
        offset += t.numel()
    return views


def apply_flattened_call(
    bucket: Sequence[torch.Tensor], call: Callable[..., Any], extra_args: Sequence[Any] | None = None
) -> None:
    """Run ``call(flat, *extra_args)`` on the tensors of ``bucket`` flattened, then copy the result back into them.

    A ``torch.distributed.all_reduce`` (a sum) is turned into the average, as in Bagua.
    """
    flat = flatten(bucket)
    call(flat, *(extra_args or ()))
    if call is dist.all_reduce:
        flat /= dist.get_world_size()
    with torch.no_grad():
        for t, result in zip(bucket, unflatten(flat, bucket)):
            t.copy_(result)


def apply_flattened_call_all(tensors: Sequence[torch.Tensor], call: Callable[..., Any]) -> None:
    """:func:`apply_flattened_call` once per tensor type (dtype and device) among ``tensors``."""
    by_type: dict[str, list[torch.Tensor]] = {}
    for t in tensors:
        by_type.setdefault(t.type(), []).append(t)
    for group in by_type.values():
        apply_flattened_call(group, call)


def check_contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether each tensor's memory starts where the one before it ends."""
    return all(b.data_ptr() == a.data_ptr() + a.numel() * a.element_size() for a, b in zip(tensors[:-1], tensors[1:]))


def get_flattened_tensor(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """:func:`flatten` of ``tensors``, or None for an empty list (as in Bagua)."""
    return flatten(tensors) if len(tensors) else None


def to_bagua_datatype(datatype: torch.dtype) -> str:
    """Bagua's engine name of a dtype: ``f32``, ``f16``, ``u8`` or ``i64``."""
    if datatype not in _BAGUA_DATATYPES:
        raise ValueError(f"unsupported data type {datatype}.")
    return _BAGUA_DATATYPES[datatype]


def average_by_removing_extreme_values(raw_score_list: Sequence[float]) -> tuple[float, float, list[float]]:
    """Mean and standard deviation of scores after the warm-up and the outliers are dropped, and the scores kept.

    The first third of the scores is the warm-up. Then, at most ten times and while the standard
    deviation is not below the mean, only scores within one standard deviation of the mean are kept
    (all of them, when none is).
    """

    def within_one_deviation(x: np.ndarray) -> np.ndarray:
        kept = x[np.abs(x - x.mean()) < x.std()]
        return kept if len(kept) else x

    scores = np.asarray(raw_score_list)
    scores = within_one_deviation(scores[len(scores) // 3 :])
    for _ in range(10):
        if scores.std() < scores.mean():
            break
        scores = within_one_deviation(scores)
    return float(scores.mean()), float(scores.std()), scores.tolist()


class StatisticalAverage:
    """The time-weighted average of a recorded value over the last ``n`` seconds.

    ``records[i]`` is the average over the ``2**i`` seconds up to ``last_update_time``, and
    ``record_tail`` ``(seconds, average)`` the average over all the time recorded (``2**(len -
    1)`` seconds plus the tail's). Averages over windows in between are interpolated linearly in
    the window's length.
    """

    def __init__(
        self,
        last_update_time: float | None = None,
        records: Sequence[float] = (),
        record_tail: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        self.last_update_time = time.time() if last_update_time is None else last_update_time
        self.records = list(records)
        self.record_tail = tuple(record_tail)

    def record_seconds(self) -> float:
        """The longest window ``records`` covers."""
        return 2.0 ** (len(self.records) - 1) if self.records else 0.0

    def total_recording_time(self) -> float:
        """All the time recorded: the records' longest window and the tail."""
        return self.record_seconds() + self.record_tail[0]

    def get_records_mean(self, last_n_seconds: float) -> float:
        """The average over the ``last_n_seconds`` up to ``last_update_time``."""
        if last_n_seconds <= 0.0:
            return 0.0
        tail_seconds, tail_mean = self.record_tail
        if not self.records:
            return tail_mean
        if last_n_seconds < 1.0:
            return self.records[0]
        covered = self.record_seconds()
        if last_n_seconds <= covered:
            i = max(0, math.floor(math.log2(last_n_seconds)))
            if i + 1 >= len(self.records):
                return self.records[i]
            shorter, longer = 2.0**i, 2.0 ** (i + 1)
            low, high = self.records[i], self.records[i + 1]
        elif last_n_seconds <= covered + tail_seconds:
            shorter, longer = covered, covered + tail_seconds
            low, high = self.records[-1], tail_mean
        else:
            return tail_mean
        return low + (high - low) * (last_n_seconds - shorter) / (longer - shorter)

    def record(self, val: float) -> None:
        """Record that the value was ``val`` since the last update, which is now."""
        now = time.time()
        elapsed = now - self.last_update_time
        recorded = self.total_recording_time()
        records: list[float] = []
        tail = (0.0, 0.0)
        for i in range(64):
            window = 2.0**i
            if window <= elapsed:
                records.append(val)
            elif window <= elapsed + recorded:
                share = elapsed / window
                records.append(val * share + self.get_records_mean(window - elapsed) * (1.0 - share))
            else:
                total = elapsed + recorded
                share = elapsed / total
                tail = (
                    total - 2.0 ** (len(records) - 1),
                    val * share + self.get_records_mean(recorded) * (1.0 - share),
                )
                break
        self.last_update_time = now
        self.records = records
        self.record_tail = tail

    def get(self, last_n_seconds: float) -> float:
        """The average over the ``last_n_seconds`` up to now (the latest record where nothing came since)."""
        since = time.time() - self.last_update_time
        if last_n_seconds <= since:
            return self.records[0] if self.records else self.record_tail[1]
        return self.get_records_mean(last_n_seconds - since)

    def __str__(self) -> str:
        return str(
            {"last_update_time": self.last_update_time, "records": self.records, "record_tail": self.record_tail}
        )

"""The bucket plan: how many small tensors are grouped into few flat buffers for communication.

Communication cost is dominated by per-call latency for small tensors, so both front ends
communicate *buckets*. The rule, written once here: tensors are taken in the order given (the
front end chooses it: tree order in JAX, reverse registration order in torch) and grouped
greedily; a bucket closes when the next tensor would take it past ``bucket_bytes`` or is of
another kind (dtype, and in torch device). A tensor larger than ``bucket_bytes`` gets a bucket of
its own. Each bucket is zero-padded to a multiple of ``pad_to`` elements (the rank count, so an
algorithm can split a bucket into one chunk per rank without more padding). The plan depends
only on the tensors' sizes and kinds, so every rank of a job computes the same one.
"""

from __future__ import annotations

import numbers
from collections.abc import Hashable, Sequence
from typing import NamedTuple

DEFAULT_BUCKET_BYTES = 10 * 1024 * 1024
"""The default bucket size: 10 MiB."""


class TensorSlot(NamedTuple):
    """What the plan needs to know of one tensor: its element count, element size and kind."""

    numel: int
    itemsize: int
    kind: Hashable


class PlannedBucket(NamedTuple):
    """One bucket: ``members`` index the planned tensors in flat order, ``offsets`` where each starts.

    ``numel`` counts the real elements, ``size`` the padded ones (a multiple of ``pad_to``).
    """

    members: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int
    size: int


def padded_size(numel: int, pad_to: int) -> int:
    """``numel`` rounded up to a multiple of ``pad_to``."""
    return -(-numel // pad_to) * pad_to


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_bucket_bytes(bucket_bytes: object, where: str) -> int:
    """``bucket_bytes`` as an int if it is a positive integer, else a ValueError that ``where`` (the caller) begins."""
    if not _is_int(bucket_bytes) or bucket_bytes <= 0:
        raise ValueError(f"{where}: bucket_bytes must be a positive int, got {bucket_bytes!r}")
    return int(bucket_bytes)


def plan_buckets(
    tensors: Sequence[TensorSlot], bucket_bytes: int = DEFAULT_BUCKET_BYTES, pad_to: int = 1
) -> list[PlannedBucket]:
    """Group ``tensors`` (in the order given) into buckets, as described in the module docstring."""
    check_bucket_bytes(bucket_bytes, "plan_buckets")
    if not _is_int(pad_to) or pad_to < 1:
        raise ValueError(f"plan_buckets: pad_to must be an int >= 1, got {pad_to!r}")
    buckets: list[PlannedBucket] = []
    members: list[int] = []
    offsets: list[int] = []
    numel = used_bytes = 0

    def close() -> None:
        if members:
            buckets.append(PlannedBucket(tuple(members), tuple(offsets), numel, padded_size(numel, pad_to)))

    for i, tensor in enumerate(tensors):
        nbytes = tensor.numel * tensor.itemsize
        if members and (tensors[members[0]].kind != tensor.kind or used_bytes + nbytes > bucket_bytes):
            close()
            members, offsets, numel, used_bytes = [], [], 0, 0
        members.append(i)
        offsets.append(numel)
        numel += tensor.numel
        used_bytes += nbytes
    close()
    return buckets

"""Which of PowerSGD's ``P`` factors are orthogonalized together, in one zero-padded batch."""

from __future__ import annotations

from collections.abc import Sequence


def orthogonalization_batches(shapes: Sequence[tuple[int, int]]) -> list[list[int]]:
    """The indices of the ``n x r`` matrices of ``shapes``, grouped into batches of one ``r``, tallest first.

    Each batch is zero-padded to its tallest matrix, so a batch only takes matrices at least
    half as tall as its first: padding at most doubles the arithmetic, while the few distinct
    heights of a real model (a transformer's embedding, its MLP and its attention matrices)
    still make only a few batches. (``r`` differs only for matrices narrower than the rank.)
    """
    batches: list[list[int]] = []
    for i in sorted(range(len(shapes)), key=lambda i: (-shapes[i][1], -shapes[i][0])):
        first = shapes[batches[-1][0]] if batches else None
        if first is not None and first[1] == shapes[i][1] and 2 * shapes[i][0] >= first[0]:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches

"""Load-balanced, padded batches for JAX training loops, over :mod:`bagua_common`.

:func:`balanced_batches` walks one epoch of a :class:`~bagua_common.data.balanced_plan.BalancedPlan`
and yields NumPy ``(batch, mask)`` pairs whose shapes come from a small fixed set, so a jitted
step compiles at most once per shape. The loss must honour ``mask``: padded positions and
padded rows are ``False`` and must not count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np

from bagua_common.data.balanced_plan import BalancedPlan

__all__ = ["DEFAULT_PAD_TO", "balanced_batches"]

DEFAULT_PAD_TO = (64, 128, 256, 512, 1024, 2048)
"""The lengths :func:`balanced_batches` pads a batch to by default: the smallest one that holds its longest sample."""


def balanced_batches(
    plan: BalancedPlan,
    epoch: int,
    load: Callable[[int], np.ndarray],
    *,
    rank: int | None = None,
    lengths: Sequence[int] | np.ndarray | None = None,
    pad_to: Sequence[int] = DEFAULT_PAD_TO,
    start_step: int = 0,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield epoch ``epoch``'s batches as ``(batch, mask)``, padded to a fixed set of shapes.

    ``load(index)`` returns a sample as an array whose first axis is its length; ``lengths``
    gives those lengths without loading (default: the plan's costs, when cost is length). Each
    step is padded to the smallest ``pad_to`` entry that holds its longest sample over all
    ranks, so every rank has the same shape. Rows are ``batch_size``, or in token-budget mode
    the step's sample count rounded up to a power of two. With ``rank=r`` (native mode) the
    batch is rank ``r``'s, shaped ``(rows, length, ...)``; with ``rank=None`` (mesh mode) it is
    the global batch stacked rank-major, ``(world_size * rows, length, ...)``, for a mesh to
    split along its first axis. ``mask`` is the boolean ``(rows, length)`` validity mask.
    ``start_step`` resumes mid-epoch.
    """
    pads = sorted({int(p) for p in pad_to})
    if not pads or pads[0] < 1:
        raise ValueError(f"pad_to must hold positive lengths, got {pad_to!r}")
    world = plan.world_size
    if rank is not None and (isinstance(rank, bool) or not 0 <= rank < world):
        raise ValueError(f"rank must be None or an int in [0, {world}), got {rank!r}")
    sizes = np.asarray(plan.costs if lengths is None else lengths)
    if sizes.shape != (plan.num_samples,):
        raise ValueError(f"lengths must hold {plan.num_samples} entries, got shape {sizes.shape}")
    if sizes.max() > pads[-1]:
        raise ValueError(f"sample {int(sizes.argmax())} has length {sizes.max()}, over pad_to")
    epoch_plan = plan.epoch(epoch)
    if isinstance(start_step, bool) or not 0 <= start_step <= epoch_plan.num_steps:
        raise ValueError(f"start_step must be in [0, {epoch_plan.num_steps}], got {start_step!r}")
    ranks = range(world) if rank is None else [rank]
    for groups in epoch_plan.steps[start_step:]:
        longest = sizes[groups].max()
        length = pads[int(np.searchsorted(pads, longest))]
        rows = plan.batch_size or 1 << (len(groups) - 1).bit_length()
        parts = [_padded(groups[:, r], load, rows, length) for r in ranks]
        yield (
            np.concatenate([batch for batch, _ in parts]),
            np.concatenate([mask for _, mask in parts]),
        )


def _padded(
    indices: np.ndarray, load: Callable[[int], np.ndarray], rows: int, length: int
) -> tuple[np.ndarray, np.ndarray]:
    samples = [np.asarray(load(int(i))) for i in indices]
    batch = np.zeros((rows, length, *samples[0].shape[1:]), dtype=samples[0].dtype)
    mask = np.zeros((rows, length), dtype=bool)
    for row, (index, sample) in enumerate(zip(indices, samples)):
        if len(sample) > length:
            raise ValueError(f"sample {int(index)} has length {len(sample)}, over its {length}")
        batch[row, : len(sample)] = sample
        mask[row, : len(sample)] = True
    return batch, mask

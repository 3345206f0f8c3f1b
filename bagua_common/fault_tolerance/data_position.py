"""Where a fault-tolerant job is in its data: each transaction takes the next samples of the epoch's order.

An epoch of the data is a permutation of the ``num_samples`` indices (seeded by ``seed`` and the
epoch number). Each committed transaction (a step) takes the next ``batch_per_rank * n`` of them,
``n`` being the members at that step, and member ``r`` trains on the ``r``-th contiguous part;
the epoch's last step takes what is left, split as evenly as possible (parts differ by at most
one sample). The position advances only when a step commits, so after any change of members
the survivors split exactly the samples not yet trained on: none is seen twice, none skipped.
The position is two integers, the same on every member (it is part of the replicated state
sent to a joiner and hashed).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from bagua_common.job.checkpoint import read_manifest

__all__ = ["RECORD_KEY", "DataPosition", "recorded_position"]

RECORD_KEY = "data_position"
"""The key of :meth:`DataPosition.record` in a fault-tolerant job's checkpoint (its manifest's ``metadata``)."""


@dataclass
class DataPosition:
    """The next unread sample of the data: ``epoch`` and ``offset`` into its permutation (see the module docstring)."""

    num_samples: int
    batch_per_rank: int
    seed: int = 0
    epoch: int = 0
    offset: int = 0

    def __post_init__(self) -> None:
        for name in ("num_samples", "batch_per_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DataPosition: {name} must be a positive int, got {value!r}")
        if not 0 <= self.offset < self.num_samples or self.epoch < 0:
            raise ValueError(f"DataPosition: no sample at epoch {self.epoch}, offset {self.offset}")

    def order(self) -> np.ndarray:
        """The current epoch's permutation of the sample indices."""
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)

    def step_samples(self, world_size: int) -> np.ndarray:
        """The indices the next step trains on, over all ``world_size`` members, in rank order."""
        if world_size < 1:
            raise ValueError(f"DataPosition: world_size must be >= 1, got {world_size}")
        end = min(self.offset + self.batch_per_rank * world_size, self.num_samples)
        return self.order()[self.offset : end]

    def indices(self, rank: int, world_size: int) -> np.ndarray:
        """Member ``rank``'s part of the next step's samples (empty only when the epoch has fewer samples left than
        members)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"DataPosition: rank {rank} is not in 0 .. {world_size - 1}")
        return np.array_split(self.step_samples(world_size), world_size)[rank]

    def advance(self, world_size: int) -> None:
        """Move past the next step's samples (call it when that step commits, on every member alike)."""
        self.offset += len(self.step_samples(world_size))
        if self.offset >= self.num_samples:
            self.epoch, self.offset = self.epoch + 1, 0

    def state(self) -> list[int]:
        """``[epoch, offset]``: what a joiner receives and the replica hash covers."""
        return [self.epoch, self.offset]

    def record(self) -> dict[str, int]:
        """The position and what identifies its data (``num_samples``, ``seed``), for a checkpoint: a restarted job
        takes up the same order where it stopped (:meth:`resume`)."""
        return {"num_samples": self.num_samples, "seed": self.seed, "epoch": self.epoch, "offset": self.offset}

    def resume(self, record: Mapping[str, int]) -> None:
        """Go on from :meth:`record`'s position; a ValueError if it is another data's (number of samples or seed: its
        order would not be this one). The batch per rank may differ: the position counts samples."""
        if (record["num_samples"], record["seed"]) != (self.num_samples, self.seed):
            raise ValueError(
                f"DataPosition: the position recorded is in {record['num_samples']} samples with seed {record['seed']},"
                f" not {self.num_samples} with seed {self.seed}: restart with the data the checkpoint was trained on"
            )
        self.load_state([record["epoch"], record["offset"]])

    def load_state(self, state: list[int]) -> None:
        """Restore :meth:`state` (a ValueError if it is not a position of this data)."""
        epoch, offset = (int(v) for v in state)
        if epoch < 0 or not 0 <= offset < self.num_samples:
            raise ValueError(f"DataPosition: no sample at epoch {epoch}, offset {offset}")
        self.epoch, self.offset = epoch, offset


def recorded_position(directory: str | os.PathLike) -> dict[str, int]:
    """The data position that the committed checkpoint ``directory`` recorded (a fault-tolerant job's ``save``); a
    ValueError naming it if it has none."""
    position = read_manifest(directory).metadata.get(RECORD_KEY)
    if position is None:
        raise ValueError(
            f"{directory} records no data position: it was not written by a fault-tolerant job's save (of a loop given "
            "a DataPosition), so a restart from it would not know which samples were trained"
        )
    return position

"""The load-balanced sampling plan: which samples each rank trains on at each step of an epoch.

Samples are sorted by cost and cut into groups of ``world_size`` neighbours; each rank takes one
sample of every group, so at every step the ranks hold samples of nearly equal cost and nobody
waits for the rank that drew the long ones. The plan is a pure function of (costs, seed, epoch,
configuration): every rank computes the same plan without communicating, and a run resumed from
``(epoch, step)`` sees the same batches.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

CostFn = Callable[[int], float]


@dataclass(frozen=True)
class EpochPlan:
    """One epoch of a :class:`BalancedPlan`.

    ``steps[s]`` is an ``(groups, world_size)`` int64 array: column ``r`` holds rank ``r``'s
    sample indices at step ``s``. ``dropped`` holds the indices left out by ``drop_last``.
    """

    steps: tuple[np.ndarray, ...]
    dropped: np.ndarray
    costs: np.ndarray
    world_size: int

    @property
    def num_steps(self) -> int:
        """The number of steps, the same on every rank by construction."""
        return len(self.steps)

    def batch(self, rank: int, step: int) -> np.ndarray:
        """Return rank ``rank``'s sample indices at step ``step`` as an int64 array."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        if not 0 <= step < self.num_steps:
            raise ValueError(f"step must be in [0, {self.num_steps}), got {step!r}")
        return self.steps[step][:, rank]

    def rank_indices(self, rank: int) -> np.ndarray:
        """Return all of rank ``rank``'s sample indices for the epoch, in step order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        if not self.steps:
            return np.empty(0, np.int64)
        return np.concatenate([s[:, rank] for s in self.steps])

    def step_costs(self) -> np.ndarray:
        """Return the ``(num_steps, world_size)`` summed cost of each rank's batch at each step."""
        return np.array([self.costs[s].sum(axis=0) for s in self.steps]).reshape(-1, self.world_size)


class BalancedPlan:
    """Plans balanced epochs for ``world_size`` ranks from per-sample costs.

    Give either ``costs`` (one number per sample) or ``cost_fn(index)`` with ``num_samples``;
    ``cost_fn`` is called once per index on first use and never decodes the dataset unless it
    does so itself. Steps hold ``batch_size`` groups, or as many groups as fit a
    ``token_budget`` of padded cost per rank (``groups * largest cost``); steps are cut on group
    boundaries, so every rank gets the same number of steps. ``megabatch`` sorts each chunk of
    that many groups by cost before cutting steps (less padding), ``jitter`` perturbs the sort
    by up to that fraction of each cost, and ``drop_last`` drops a random, cost-representative
    remainder instead of repeating random samples to fill the last group (and, with
    ``batch_size``, drops a short last step).
    """

    def __init__(
        self,
        costs: Sequence[float] | np.ndarray | None = None,
        *,
        world_size: int,
        cost_fn: CostFn | None = None,
        num_samples: int | None = None,
        batch_size: int | None = None,
        token_budget: float | None = None,
        seed: int = 0,
        shuffle: bool = True,
        megabatch: int | None = None,
        jitter: float = 0.0,
        drop_last: bool = False,
    ) -> None:
        if (costs is None) == (cost_fn is None):
            raise ValueError("give exactly one of costs and cost_fn")
        if cost_fn is not None and not callable(cost_fn):
            raise TypeError(f"cost_fn must be callable, got {cost_fn!r}")
        if costs is not None:
            self._costs: np.ndarray | None = _validated_costs(costs)
            if num_samples is not None and num_samples != len(self._costs):
                raise ValueError(f"num_samples={num_samples!r} but {len(self._costs)} costs given")
            num_samples = len(self._costs)
        else:
            self._costs = None
            if isinstance(num_samples, bool) or not isinstance(num_samples, int):
                raise ValueError(f"num_samples must be an int with cost_fn, got {num_samples!r}")
        self._cost_fn = cost_fn
        self.num_samples = _checked_int("num_samples", num_samples, 1)
        self.world_size = _checked_int("world_size", world_size, 1)
        if self.world_size > self.num_samples:
            raise ValueError(f"world_size={world_size!r} exceeds the {self.num_samples} samples")
        if (batch_size is None) == (token_budget is None):
            raise ValueError(
                f"give exactly one of batch_size and token_budget, got batch_size={batch_size!r}, "
                f"token_budget={token_budget!r}"
            )
        self.batch_size = None if batch_size is None else _checked_int("batch_size", batch_size, 1)
        if token_budget is not None and not (
            isinstance(token_budget, (int, float, np.number)) and 0 < token_budget < math.inf
        ):
            raise ValueError(f"token_budget must be a positive finite number, got {token_budget!r}")
        self.token_budget = None if token_budget is None else float(token_budget)
        self.megabatch = None if megabatch is None else _checked_int("megabatch", megabatch, 1)
        if not (isinstance(jitter, (int, float)) and 0.0 <= jitter < math.inf):
            raise ValueError(f"jitter must be a non-negative finite number, got {jitter!r}")
        self.jitter = float(jitter)
        self.seed = _checked_int("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)

    @property
    def costs(self) -> np.ndarray:
        """The per-sample costs (evaluated from ``cost_fn`` on first access)."""
        if self._costs is None:
            self._costs = _validated_costs([self._cost_fn(i) for i in range(self.num_samples)])
            if self.token_budget is not None:
                self._check_budget()
        return self._costs

    def _check_budget(self) -> None:
        largest = int(np.argmax(self._costs))
        if self._costs[largest] > self.token_budget:
            raise ValueError(
                f"sample {largest} costs {float(self._costs[largest])!r}, more than token_budget={self.token_budget!r}"
            )

    def fingerprint(self) -> bytes:
        """Return a digest of the costs and configuration; equal on ranks that plan alike."""
        digest = hashlib.blake2b(digest_size=16)
        config = (
            self.num_samples,
            self.world_size,
            self.batch_size,
            self.token_budget,
            self.seed,
            self.shuffle,
            self.megabatch,
            self.jitter,
            self.drop_last,
        )
        digest.update(repr(config).encode())
        digest.update(np.ascontiguousarray(self.costs, dtype=np.float64).tobytes())
        return digest.digest()

    def verify(self, all_gather: Callable[[bytes], Sequence[bytes]]) -> None:
        """Raise ``ValueError`` unless every rank holds the same costs and configuration.

        ``all_gather(payload)`` must return every rank's payload (in rank order) over the run's
        communicator; a mismatch would otherwise give ranks different plans and hang a step.
        """
        mine = self.fingerprint()
        gathered = list(all_gather(mine))
        differing = [r for r, theirs in enumerate(gathered) if bytes(theirs) != mine]
        if differing:
            raise ValueError(f"ranks {differing} hold different sample costs or plan settings")

    def epoch(self, epoch: int) -> EpochPlan:
        """Return the plan of epoch ``epoch``: a pure function of (costs, seed, epoch, config)."""
        epoch = _checked_int("epoch", epoch, 0)
        costs = self.costs
        rng = np.random.default_rng([self.seed, epoch])
        order, dropped = self._sorted_order(costs, rng)
        groups = order.reshape(-1, self.world_size)
        if self.shuffle:
            groups = rng.permuted(groups, axis=1)
            groups = groups[rng.permutation(len(groups))]
        if self.megabatch is not None:
            groups = self._megabatch_sorted(groups, costs)
        steps = self._cut_steps(groups, costs)
        if self.batch_size is not None and self.drop_last and len(steps[-1]) < self.batch_size:
            # The group order is random, so the short last step is a representative drop.
            dropped = np.concatenate([dropped, steps[-1].ravel()])
            steps = steps[:-1]
        if self.shuffle and self.megabatch is not None:
            steps = [steps[i] for i in rng.permutation(len(steps))]
        return EpochPlan(tuple(steps), np.sort(dropped), costs, self.world_size)

    def _sorted_order(self, costs: np.ndarray, rng: np.random.Generator):
        n, w = self.num_samples, self.world_size
        keys = costs * (1.0 + self.jitter * rng.random(n)) if self.jitter else costs
        if self.shuffle:
            # A random pre-permutation and a stable sort break cost ties at random.
            perm = rng.permutation(n)
            order = perm[np.argsort(keys[perm], kind="stable")]
        else:
            order = np.argsort(keys, kind="stable")
        remainder = n % w
        if remainder == 0:
            return order, np.empty(0, np.int64)
        if self.drop_last:
            # Drop uniformly chosen samples, so the dropped cost is representative on average.
            drop_at = rng.choice(n, remainder, replace=False)
            keep = np.ones(n, bool)
            keep[drop_at] = False
            return order[keep], np.sort(order[drop_at])
        extra = rng.choice(n, w - remainder, replace=False)
        padded = np.concatenate([order, extra])
        return padded[np.argsort(keys[padded], kind="stable")], np.empty(0, np.int64)

    def _megabatch_sorted(self, groups: np.ndarray, costs: np.ndarray) -> np.ndarray:
        group_cost = costs[groups].max(axis=1)
        chunks = []
        for start in range(0, len(groups), self.megabatch):
            chunk = groups[start : start + self.megabatch]
            chunks.append(chunk[np.argsort(group_cost[start : start + self.megabatch], kind="stable")])
        return np.concatenate(chunks)

    def _cut_steps(self, groups: np.ndarray, costs: np.ndarray) -> list[np.ndarray]:
        if self.batch_size is not None:
            return [groups[i : i + self.batch_size] for i in range(0, len(groups), self.batch_size)]
        self._check_budget()
        group_max = costs[groups].max(axis=1)
        steps, start, largest = [], 0, 0.0
        for i, cost in enumerate(group_max):
            grown = max(largest, cost)
            if i > start and (i - start + 1) * grown > self.token_budget:
                steps.append(groups[start:i])
                start, grown = i, cost
            largest = grown
        steps.append(groups[start:])
        return steps


def _checked_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _validated_costs(costs: Sequence[float] | np.ndarray) -> np.ndarray:
    try:
        array = np.asarray(costs, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"costs must be numbers, got {costs!r:.80}") from None
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"costs must be a non-empty 1-D sequence, got shape {array.shape}")
    bad = np.flatnonzero(~np.isfinite(array) | (array < 0))
    if bad.size:
        raise ValueError(f"cost of sample {bad[0]} must be finite and >= 0, got {float(array[bad[0]])!r}")
    return array

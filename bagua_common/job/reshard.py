"""What each algorithm's state becomes when a checkpoint is restored into another world size.

A saved state is one row per old rank for each tensor (a "leaf", named by its path in the
state). Each leaf follows one of three rules when the number of ranks changes:

* ``CARRY``: the leaf is identical on every rank (replicated parameters, Adam moments,
  QAdam's momentum, PowerSGD's ``qs``, step counters): old rank 0's row goes to every new rank.
* ``MEAN``: the ranks' rows differ (decentralized and asynchronous training let the
  parameters drift apart): every new rank starts from the mean of the old rows, a valid
  fresh state, the step kept (the peer schedule is step-indexed).
* ``RESET``: the leaf restarts at its initial value, as a freshly built state of the new
  world size has it: error-feedback residuals restart at zero (as DeepSpeed's 1-bit Adam
  does on load), and low-precision decentralized's copies of the weights restart equal
  to the (mean) parameters. Their shapes depend on the world size (buckets are padded to
  a multiple of it), so they could not carry over anyway.

Integer leaves (step counters) always carry. Restoring into the same world size restores
every rank's own row exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bagua_common.algorithms.registry import CONFIGS, AlgorithmConfig

CARRY = "carry"
MEAN = "mean"
RESET = "reset"


@dataclass(frozen=True)
class ReshardRule:
    """An algorithm's rule: ``default`` for its leaves, ``RESET`` for leaves whose path names one of ``reset``."""

    default: str
    reset: tuple[str, ...] = ()

    def rule_for(self, path: str, dtype: np.dtype) -> str:
        """The rule of the algorithm's state leaf at ``path`` (its key path, e.g. ``.worker_residuals[0]``)."""
        if any(word in path for word in self.reset):
            return RESET
        return self.parameter_rule(dtype)

    def parameter_rule(self, dtype: np.dtype) -> str:
        """The rule of a model parameter or buffer (never reset, whatever its name)."""
        return self.default if np.issubdtype(dtype, np.floating) else CARRY


def config_rule(config_class: type[AlgorithmConfig]) -> ReshardRule:
    """The rule of the algorithm ``config_class`` configures, from what it declares: ``CARRY`` where the ranks stay
    identical (:attr:`~AlgorithmConfig.replicated`), ``MEAN`` where they drift apart, ``RESET`` for the leaves its
    :attr:`~AlgorithmConfig.world_sized_state` names."""
    return ReshardRule(CARRY if config_class.replicated else MEAN, config_class.world_sized_state)


def algorithm_rule(algorithm: str) -> ReshardRule:
    """The rule of an algorithm given by the qualified class name a checkpoint's manifest records (a front end's
    class is named for its configuration: ``ByteGrad`` or ``ByteGradAlgorithm`` for ``ByteGradConfig``)."""
    name = algorithm.rsplit(".", 1)[-1].removesuffix("Algorithm")
    by_name = {config_class.__name__.removesuffix("Config"): config_class for config_class in CONFIGS.values()}
    if name not in by_name:
        raise ValueError(
            f"no rule to restore {algorithm!r} into another world size (known: {', '.join(sorted(by_name))}); "
            "restore it with the world size it was saved with"
        )
    return config_rule(by_name[name])


def reshard_rows(rule: str, rows: Sequence[np.ndarray], new_world: int, fresh: np.ndarray | None = None) -> np.ndarray:
    """One leaf's rows for ``new_world`` ranks (stacked on a leading axis) from the old ranks' ``rows``.

    ``fresh`` is the leaf in a freshly built state of the new world size (one row), used by
    ``RESET`` and to check that a carried or averaged leaf still has its shape.
    """
    if rule == RESET:
        if fresh is None:
            raise ValueError("a RESET leaf needs its fresh value")
        return np.broadcast_to(fresh, (new_world, *np.shape(fresh))).copy()
    if rule == CARRY:
        row = np.asarray(rows[0])
    elif rule == MEAN:
        stacked = np.stack([np.asarray(r) for r in rows])
        row = (stacked.astype(np.float64).sum(axis=0) / len(rows)).astype(stacked.dtype)
    else:
        raise ValueError(f"unknown reshard rule {rule!r}")
    if fresh is not None and np.shape(fresh) != row.shape:
        raise ValueError(
            f"a saved leaf of shape {row.shape} cannot become one of shape {np.shape(fresh)} under the {rule} rule"
        )
    return np.broadcast_to(row, (new_world, *row.shape)).copy()

"""Each algorithm's configuration, once: its fields, defaults, validation and registry name.

One frozen dataclass per algorithm. ``bagua_jax`` builds its optax transformation on it and
``bagua_torch`` its hooks, so a registry name means the same options in both front ends and a
bad value raises the same error, worded the same, in both. What only one front end has (the
JAX bucket size, torch's optimizer object) the front end's class holds beside the configuration.
Each class is registered with :func:`~bagua_common.algorithms.registry.register_config`, which
every front end's lookup by name derives from (see :mod:`bagua_common.algorithms.registry`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from bagua_common.algorithms.frozen_variance import STEP_BOUND
from bagua_common.algorithms.option_checks import (
    check_communication_interval,
    check_flags,
    check_sync_interval_ms,
    check_warmup_steps,
)
from bagua_common.algorithms.registry import AlgorithmConfig, register_config
from bagua_common.comm.topology import PeerSelectionMode, check_peer_selection_mode


@register_config
@dataclass(frozen=True)
class GradientAllReduceConfig(AlgorithmConfig):
    """Full-precision gradient averaging: ``hierarchical`` reduces inside the node first, ``average=False`` sums."""

    name: ClassVar[str] = "gradient_allreduce"
    replicated = bucket_exact = hierarchical_exact = stateless = step_free_of_world_size = True

    hierarchical: bool = False
    average: bool = True

    def __post_init__(self) -> None:
        check_flags(self.name, hierarchical=self.hierarchical, average=self.average)


@register_config
@dataclass(frozen=True)
class ByteGradConfig(AlgorithmConfig):
    """8-bit compressed gradient averaging; ``error_feedback`` carries each step's compression error forward."""

    name: ClassVar[str] = "bytegrad"
    replicated = True
    world_sized_state = ("residual",)

    hierarchical: bool = True
    average: bool = True
    # Off: over the LM study's whole budget (docs/results/lm_study.md, 4000 steps, one seed) ByteGrad without it
    # ends at 1.594 nats/byte held-out against gradient allreduce's 1.600. Early in the run it trails (4.1% at step
    # 1000, 2.5% with error feedback), and the gap closes as the learning rate decays.
    error_feedback: bool = False

    def __post_init__(self) -> None:
        check_flags(self.name, hierarchical=self.hierarchical, average=self.average, error_feedback=self.error_feedback)


@register_config
@dataclass(frozen=True)
class DecentralizedConfig(AlgorithmConfig):
    """Full-precision weight averaging with peers chosen by ``peer_selection_mode`` every ``communication_interval``
    steps."""

    name: ClassVar[str] = "decentralized"
    bucket_exact = True
    # shift_one pairs nodes, so its hierarchical form would need an even node count: ranked flat only.
    advisor_variants = {"shift_one": {"peer_selection_mode": "shift_one"}}

    # The LM study (docs/results/lm_study.md) found these 2.7% above gradient allreduce's held-out loss at 1000 of
    # 4000 steps and 11% at the end (1.783 against 1.600). They are already the most communication the algorithm
    # has (every peer, every step): the gap is weight averaging's, each rank's AdamW normalizing its own one-window
    # gradient before the average, not a default's.
    peer_selection_mode: PeerSelectionMode = "all"
    communication_interval: int = 1
    hierarchical: bool = True

    def __post_init__(self) -> None:
        check_peer_selection_mode(self.peer_selection_mode, self.name)
        check_communication_interval(self.communication_interval, self.name)
        check_flags(self.name, hierarchical=self.hierarchical)


@register_config
@dataclass(frozen=True)
class LowPrecisionDecentralizedConfig(AlgorithmConfig):
    """8-bit compressed weight-difference exchange with the two ring neighbours every ``communication_interval``
    steps."""

    name: ClassVar[str] = "low_precision_decentralized"
    world_sized_state = ("weights", "left", "right")

    communication_interval: int = 1
    hierarchical: bool = True

    def __post_init__(self) -> None:
        check_communication_interval(self.communication_interval, self.name)
        check_flags(self.name, hierarchical=self.hierarchical)


@register_config
@dataclass(frozen=True)
class AsyncModelAverageConfig(AlgorithmConfig):
    """Gradient allreduce for ``warmup_steps`` steps, then weights averaged in the background every
    ``sync_interval_ms`` milliseconds."""

    name: ClassVar[str] = "async"
    bucket_exact = background = True

    sync_interval_ms: float = 500
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        check_sync_interval_ms(self.sync_interval_ms, self.name)
        check_warmup_steps(self.warmup_steps, self.name)

    def local_steps_from(self) -> int | None:
        """After the warm-up's gradient allreduce, the steps are local."""
        return self.warmup_steps


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


@register_config
@dataclass(frozen=True)
class QAdamConfig(AlgorithmConfig):
    """Adam with averaged gradients for ``warmup_steps`` steps, then a frozen second moment and an 8-bit compressed
    momentum exchange. ``learning_rate`` is a number >= 0 (or, where the front end takes one, a schedule).
    ``step_bound`` clips each coordinate's step after the warm-up to ``step_bound * lr``
    (:data:`~bagua_common.algorithms.frozen_variance.STEP_BOUND`), and the frozen second moment keeps the warm-up's
    bias correction (:mod:`bagua_common.algorithms.frozen_variance`); None is Bagua's formula: unbounded, the frozen
    second moment corrected by the running step count."""

    name: ClassVar[str] = "qadam"
    replicated = is_optimizer = True

    learning_rate: Any
    warmup_steps: int = 100
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    hierarchical: bool = True
    step_bound: float | None = STEP_BOUND

    def __post_init__(self) -> None:
        rate = self.learning_rate
        # A number is checked here; a schedule (callable) or an array scalar is the front end's to check.
        schedule_or_array = callable(rate) or getattr(rate, "ndim", None) == 0
        if (_is_number(rate) and not rate >= 0) or not (_is_number(rate) or schedule_or_array):
            raise ValueError(f"{self.name}: learning_rate (lr) must be a float >= 0, got {rate!r}")
        steps = self.warmup_steps
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or not 1 <= steps < 2**31 - 1:
            raise ValueError(
                f"{self.name}: warmup_steps must be an int >= 1 (the frozen second moment comes from the Adam steps "
                f"of the warm-up), got {steps!r}"
            )
        for key, beta in (("b1 (betas[0])", self.b1), ("b2 (betas[1])", self.b2)):
            if not (_is_number(beta) and 0.0 <= beta < 1.0):
                raise ValueError(f"{self.name}: {key} must be a float in [0, 1), got {beta!r}")
        if not (_is_number(self.eps) and self.eps > 0.0):
            # After the warm-up the frozen v may hold exact zeros (parameters whose gradients were always zero).
            raise ValueError(
                f"{self.name}: eps must be a float > 0 (the frozen second moment may hold zeros), got {self.eps!r}"
            )
        check_flags(self.name, hierarchical=self.hierarchical)
        bound = self.step_bound
        if bound is not None and not (_is_number(bound) and bound > 0):
            raise ValueError(f"{self.name}: step_bound must be a float > 0 or None (Bagua's formula), got {bound!r}")

    @property
    def frozen_variance_count(self) -> int | None:
        """The count ``T`` whose bias correction ``1 - b2**T`` the frozen second moment keeps after the warm-up.

        It is ``warmup_steps``, the count the second moment stopped at (:mod:`bagua_common.algorithms.frozen_variance`),
        or None in Bagua's formula, ``step_bound=None``, which keeps Bagua's whole step after the warm-up: the running
        count and no bound. The warm-up's Adam corrects by the running count.
        """
        return None if self.step_bound is None else self.warmup_steps


@register_config
@dataclass(frozen=True)
class OneBitAdamConfig(QAdamConfig):
    """QAdam's schedule with the momentum exchanged as 1-bit signs with error feedback on both sides."""

    name: ClassVar[str] = "onebit_adam"
    world_sized_state = ("residual",)


def matrix_view(shape: Sequence[int]) -> tuple[int, int] | None:
    """The ``(n, m)`` matrix PowerSGD sees for a tensor of ``shape``, or None for a vector or scalar."""
    if len(shape) < 2:
        return None
    return int(shape[0]), int(math.prod(shape[1:]))


@register_config
@dataclass(frozen=True)
class PowerSGDConfig(AlgorithmConfig):
    """PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019): each matrix-shaped gradient ``M`` (``n x m``; a
    tensor of higher rank is viewed as ``shape[0] x rest``) is approximated by a rank-``r`` product ``P Q^T``, found
    with one step of power iteration per training step::

        M = grad + residual              (error feedback)
        P = allreduce_sum(M Q)           (one flat allreduce for every matrix's P; or its mean: see below)
        P = orthogonalize(P)             (Gram-Schmidt on the columns)
        Q = allreduce_sum(M^T P) / n     (one flat allreduce for every matrix's Q)
        grad = P Q^T;  residual = M - P Q^T

    ``Q`` is kept from step to step (``warm_start``) and starts from the same matrix, seeded by ``seed``, on every
    rank, so every rank computes the same ``P Q^T``. A matrix is compressed only when its ``n m`` elements are more
    than ``min_compression_rate`` times the ``(n + m) r`` its factors send; the others (vectors, small or thin
    matrices) are averaged uncompressed, riding in the same allreduce as the ``P`` factors. During the first
    ``start_iter`` steps every gradient is averaged exactly. Orthogonalizing ``P`` ignores its scale, so a front end
    may average it instead of summing it (JAX does: its step then divides only through the engine, at run time).
    """

    name: ClassVar[str] = "powersgd"
    replicated = step_free_of_world_size = True
    world_sized_state = ("residual",)
    advised = False

    # Rank 4, as DDP's powerSGD_hook is run beside it in every study. In the LM study (docs/results/lm_study.md, GPT
    # mini, one seed) it ends 4.7% above gradient allreduce's held-out loss at step 2400 of 4000 and reaches 2.0
    # nats/byte 17% later (step 2163 against 1846), for 1/18 of the bytes; a higher rank was not measured there.
    rank: int = 4
    start_iter: int = 10
    min_compression_rate: float = 2.0
    error_feedback: bool = True
    warm_start: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("rank", "start_iter", "seed"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{self.name}: {key} must be an int, got {value!r}")
        if self.rank < 1:
            raise ValueError(f"{self.name}: rank must be at least 1, got {self.rank}")
        if self.start_iter < 0:
            raise ValueError(f"{self.name}: start_iter must be >= 0, got {self.start_iter}")
        if not _is_number(self.min_compression_rate) or not self.min_compression_rate >= 1:
            raise ValueError(
                f"{self.name}: min_compression_rate must be a number >= 1, got {self.min_compression_rate!r}"
            )
        check_flags(self.name, error_feedback=self.error_feedback, warm_start=self.warm_start)

    def compressed_rank(self, shape: Sequence[int]) -> int | None:
        """The rank a tensor of ``shape`` is compressed with (at most ``min(n, m)``), or None if it is sent
        uncompressed."""
        view = matrix_view(shape)
        if view is None:
            return None
        n, m = view
        rank = min(self.rank, n, m)
        # torch's PowerSGD hook draws the same line: compress when the factors are smaller by more
        # than ``min_compression_rate``.
        if not self.min_compression_rate * (n + m) * rank < n * m:
            return None
        return rank

    def check_compressible(self, shapes: Sequence[Sequence[int]]) -> None:
        """Raise a ValueError if ``rank`` is larger than every matrix allows (nothing would compress)."""
        views = [matrix_view(s) for s in shapes]
        largest = max((min(v) for v in views if v is not None), default=0)
        if largest and self.rank > largest:
            raise ValueError(
                f"{self.name}: rank {self.rank} is larger than any gradient matrix allows (the largest "
                f"min(n, m) is {largest}); choose rank <= {largest}"
            )

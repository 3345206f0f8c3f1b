"""Each algorithm's configuration, once: its fields, defaults, validation and registry name.

One frozen dataclass per algorithm. ``bagua_jax`` builds its optax transformation on it and
``bagua_torch`` its hooks, so a registry name means the same options in both front ends and a
bad value raises the same error, worded the same, in both. What only one front end has (the
JAX bucket size, torch's optimizer object) is added by that front end's subclass.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

import numpy as np

from bagua_common.algorithms.diloco import DiLoCoConfig
from bagua_common.algorithms.option_checks import (
    check_communication_interval,
    check_flags,
    check_sync_interval_ms,
    check_warmup_steps,
)
from bagua_common.algorithms.powersgd import PowerSGDConfig
from bagua_common.comm.topology import PeerSelectionMode, check_peer_selection_mode

T = TypeVar("T")


@dataclass(frozen=True)
class GradientAllReduceConfig:
    """Full-precision gradient averaging: ``hierarchical`` reduces inside the node first, ``average=False`` sums."""

    name: ClassVar[str] = "gradient_allreduce"

    hierarchical: bool = False
    average: bool = True

    def __post_init__(self) -> None:
        check_flags(self.name, hierarchical=self.hierarchical, average=self.average)


@dataclass(frozen=True)
class ByteGradConfig:
    """8-bit compressed gradient averaging; ``error_feedback`` carries each step's compression error forward."""

    name: ClassVar[str] = "bytegrad"

    hierarchical: bool = True
    average: bool = True
    error_feedback: bool = False

    def __post_init__(self) -> None:
        check_flags(self.name, hierarchical=self.hierarchical, average=self.average, error_feedback=self.error_feedback)


@dataclass(frozen=True)
class DecentralizedConfig:
    """Full-precision weight averaging with peers chosen by ``peer_selection_mode`` every ``communication_interval``
    steps."""

    name: ClassVar[str] = "decentralized"

    peer_selection_mode: PeerSelectionMode = "all"
    communication_interval: int = 1
    hierarchical: bool = True

    def __post_init__(self) -> None:
        check_peer_selection_mode(self.peer_selection_mode, self.name)
        check_communication_interval(self.communication_interval, self.name)
        check_flags(self.name, hierarchical=self.hierarchical)


@dataclass(frozen=True)
class LowPrecisionDecentralizedConfig:
    """8-bit compressed weight-difference exchange with the two ring neighbours every ``communication_interval``
    steps."""

    name: ClassVar[str] = "low_precision_decentralized"

    communication_interval: int = 1
    hierarchical: bool = True

    def __post_init__(self) -> None:
        check_communication_interval(self.communication_interval, self.name)
        check_flags(self.name, hierarchical=self.hierarchical)


@dataclass(frozen=True)
class AsyncModelAverageConfig:
    """Gradient allreduce for ``warmup_steps`` steps, then weights averaged in the background every
    ``sync_interval_ms`` milliseconds."""

    name: ClassVar[str] = "async"

    sync_interval_ms: float = 500
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        check_sync_interval_ms(self.sync_interval_ms, self.name)
        check_warmup_steps(self.warmup_steps, self.name)


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


@dataclass(frozen=True)
class QAdamConfig:
    """Adam with averaged gradients for ``warmup_steps`` steps, then a frozen second moment and an 8-bit compressed
    momentum exchange. ``learning_rate`` is a number >= 0 (or, where the front end takes one, a schedule)."""

    name: ClassVar[str] = "qadam"

    learning_rate: Any
    warmup_steps: int = 100
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    hierarchical: bool = True

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


@dataclass(frozen=True)
class OneBitAdamConfig(QAdamConfig):
    """QAdam's schedule with the momentum exchanged as 1-bit signs with error feedback on both sides."""

    name: ClassVar[str] = "onebit_adam"


ALGORITHM_CONFIGS: dict[str, type] = {
    "gradient_allreduce": GradientAllReduceConfig,
    "bytegrad": ByteGradConfig,
    "decentralized": DecentralizedConfig,
    "low_precision_decentralized": LowPrecisionDecentralizedConfig,
    "async": AsyncModelAverageConfig,
    "qadam": QAdamConfig,
    "onebit_adam": OneBitAdamConfig,
    "powersgd": PowerSGDConfig,
    "diloco": DiLoCoConfig,
}
"""Registry name -> configuration class; the names both front ends accept."""


def config_options(config: Any) -> dict[str, Any]:
    """``config``'s fields as keyword arguments (by reference, unlike ``dataclasses.asdict``)."""
    return {field.name: getattr(config, field.name) for field in fields(config)}


def unknown_algorithm(name: str, available: Iterable[str]) -> ValueError:
    """The error both front ends raise for a name no algorithm is registered under."""
    return ValueError(f"algorithm {name!r} is unknown; available: {', '.join(available)}")


def build_algorithm(name: str, cls: type[T], options: dict[str, Any]) -> T:
    """``cls(**options)``, the algorithm registered as ``name``; a TypeError (an unknown option or a value of the
    wrong type) is raised again with the name in front, the same in both front ends."""
    try:
        return cls(**options)
    except TypeError as error:
        raise TypeError(f"algorithm {name!r}: {error}") from error

"""DiLoCo and Streaming DiLoCo: configuration, fragments and schedule, shared by both front ends.

DiLoCo (Douillard et al., arXiv 2311.08105) trains with the user's optimizer locally (the
*inner* optimizer) and communicates once every ``sync_every`` (H) steps: each rank's
*pseudo-gradient*, the parameters at the round's start minus its own, is averaged over the
ranks and an *outer* optimizer steps on the round-start parameters; the result becomes every
rank's parameters and the start of the next round. Streaming DiLoCo (arXiv 2501.18512) splits
the parameters into ``fragments`` (P) contiguous groups of layers balanced by size, each with
its own round of H steps, staggered so that fragment ``p`` is exchanged after the inner steps
``t`` with ``(t - p*H//P) mod H == 0``; its averaged pseudo-gradient is applied
``fragment_sync_delay`` (tau) steps later, so the exchange overlaps those steps, and the
fragment then becomes ``alpha * local + (1 - alpha) * global`` (``fragment_update_alpha``).

Steps are counted from 1 (``t`` inner steps done). With ``tau = 0`` and ``P = 1`` a sync is
exactly DiLoCo's. This module holds what is neither JAX nor torch: the options and their
errors, the fragment plan and the step schedule; the exchange itself is
:mod:`bagua_common.algorithms.outer_exchange`.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np

from bagua_common.algorithms.option_checks import check_flags
from bagua_common.algorithms.registry import AlgorithmConfig, register_config

OuterExchange = Literal["fp32", "bf16", "uint8", "uint4"]
OUTER_EXCHANGES: tuple[str, ...] = ("fp32", "bf16", "uint8", "uint4")
"""How the pseudo-gradients travel: float32, bfloat16, or 8-bit / 4-bit min-max codes (averaged in float32)."""

RoundStartMemory = Literal["host", "device"]

DEFAULT_OUTER_LEARNING_RATE = 0.7
DEFAULT_OUTER_MOMENTUM = 0.9
"""The default outer optimizer: Nesterov SGD with these settings (DiLoCo's and OpenDiLoCo's)."""
# The LM study (docs/results/lm_study.md) trained the whole 4000-step budget with these and with lr 1.0 / momentum 0.5,
# at two seeds: at H = 20 (200 rounds) these end 6.8% and 7.5% lower (1.726 against 1.844, 1.718 against 1.846), at
# H = 100 (40 rounds) 3.6% and 4.6% higher (2.093 against 2.017, 2.065 against 1.970); at H = 50 (80 rounds, seed 0)
# 0.7% lower (1.894 against 1.908). Momentum 0.9 pays with many rounds; which wins follows a run's number of rounds
# (the two cross between 40 and 80), which the configuration does not know, so DiLoCo's published settings stay: the
# runs DiLoCo is for have hundreds of rounds or more. Its defaults as a whole (H = 100, these) end at
# 2.093 against gradient allreduce's 1.600 (+31% at equal tokens, sending 1/100 of the bytes): 40 rounds, where the
# papers run thousands. DiLoCo buys bytes with tokens.


_INTS = (int, np.integer)


def _is_real(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def _check_int(value: Any, key: str, low: int, algorithm: str, why: str = "") -> int:
    if isinstance(value, bool) or not isinstance(value, _INTS) or value < low:
        raise ValueError(f"{algorithm}: {key} must be an int >= {low}{why}, got {value!r}")
    return int(value)


@register_config
@dataclass(frozen=True)
class DiLoCoConfig(AlgorithmConfig):
    """DiLoCo's options (see the module docstring).

    ``sync_every``: H, inner steps per round. ``outer_optimizer``: None for Nesterov SGD with
    ``outer_learning_rate`` and ``outer_momentum`` (None: 0.7 and 0.9, DiLoCo's),
    else the front end's optimizer (an optax transformation; for torch a callable that makes a
    ``torch.optim.Optimizer`` from a list of tensors). ``outer_exchange``:
    the pseudo-gradients' format on the wire; ``error_feedback`` carries each rank's compression
    error into its next round (compressed formats only). ``fragments``, ``fragment_sync_delay``,
    ``fragment_update_alpha``: Streaming DiLoCo's P, tau and alpha. ``round_start_memory``: where
    the round-start copy of the parameters lives ("host": host memory, the default, which frees
    accelerator memory; "device": next to the parameters).
    """

    name: ClassVar[str] = "diloco"
    # The ranks' parameters drift inside a round: they start from their mean, and so do JAX's pseudo-gradients whose
    # exchange was under way (the new world exchanges that mean). The round-start copy, the outer state and torch's
    # averages awaiting their outer step are the same on every rank (their mean is exact).
    world_sized_state = ("residual",)
    advised = False

    sync_every: int = 100
    outer_optimizer: Any = None
    outer_exchange: OuterExchange = "fp32"
    error_feedback: bool = False
    fragments: int = 1
    fragment_sync_delay: int = 0
    fragment_update_alpha: float = 0.0
    round_start_memory: RoundStartMemory = "host"
    outer_learning_rate: float | None = None
    outer_momentum: float | None = None

    def __post_init__(self) -> None:
        name = self.name
        h = _check_int(self.sync_every, "sync_every", 1, name)
        p = _check_int(self.fragments, "fragments", 1, name)
        if p > h:
            raise ValueError(f"{name}: fragments ({p}) must not exceed sync_every ({h}): each needs a step of its own")
        tau = _check_int(self.fragment_sync_delay, "fragment_sync_delay", 0, name)
        if tau >= h // p:
            raise ValueError(
                f"{name}: fragment_sync_delay ({tau}) must be less than sync_every // fragments "
                f"({h} // {p} = {h // p}),"
                " so that a fragment's exchange has finished before the next fragment's starts"
            )
        alpha = self.fragment_update_alpha
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not 0.0 <= alpha <= 1.0:
            raise ValueError(f"{name}: fragment_update_alpha must be a float in [0, 1], got {alpha!r}")
        if self.outer_exchange not in OUTER_EXCHANGES:
            raise ValueError(
                f"{name}: outer_exchange must be one of {', '.join(OUTER_EXCHANGES)}, got {self.outer_exchange!r}"
            )
        check_flags(name, error_feedback=self.error_feedback)
        if self.error_feedback and self.outer_exchange == "fp32":
            raise ValueError(f"{name}: error_feedback needs a compressed outer_exchange (bf16, uint8 or uint4)")
        if self.round_start_memory not in ("host", "device"):
            raise ValueError(f"{name}: round_start_memory must be 'host' or 'device', got {self.round_start_memory!r}")
        lr, momentum = self.outer_learning_rate, self.outer_momentum
        if lr is not None and not (_is_real(lr) and 0.0 < lr < math.inf):
            raise ValueError(f"{name}: outer_learning_rate must be a float > 0 or None, got {lr!r}")
        if momentum is not None and not (_is_real(momentum) and 0.0 <= momentum < 1.0):
            raise ValueError(f"{name}: outer_momentum must be a float in [0, 1) or None, got {momentum!r}")
        if self.outer_optimizer is not None and (lr is not None or momentum is not None):
            raise ValueError(
                f"{name}: outer_learning_rate and outer_momentum set the default outer optimizer; give them to your "
                "outer_optimizer instead"
            )

    @property
    def outer_settings(self) -> tuple[float, float]:
        """The default outer optimizer's (learning rate, momentum): the options, else DiLoCo's 0.7 and 0.9."""
        lr, momentum = self.outer_learning_rate, self.outer_momentum
        return (
            DEFAULT_OUTER_LEARNING_RATE if lr is None else float(lr),
            DEFAULT_OUTER_MOMENTUM if momentum is None else float(momentum),
        )

    def fragment_offset(self, fragment: int) -> int:
        """The inner step of fragment ``fragment``'s first exchange (0 for the first fragment: after H steps)."""
        return fragment * self.sync_every // self.fragments

    def exchanges_after(self, step: int) -> list[int]:
        """The fragments whose pseudo-gradients are exchanged after inner step ``step`` (counted from 1)."""
        return [
            p for p in range(self.fragments) if step >= 1 and (step - self.fragment_offset(p)) % self.sync_every == 0
        ]

    def steps_to_exchange(self, step: int) -> int:
        """The inner steps after ``step`` up to the next one that ends with an exchange, that one included (a
        fault-tolerant joiner sits out all but the last: it joins that exchange without having trained)."""
        steps = 1
        while not self.exchanges_after(step + steps):
            steps += 1
        return steps

    def applies_after(self, step: int) -> list[int]:
        """The fragments whose averaged pseudo-gradients are applied after inner step ``step`` (tau steps later)."""
        return self.exchanges_after(step - self.fragment_sync_delay)


def fragment_plan(sizes: Sequence[int], fragments: int, algorithm: str = DiLoCoConfig.name) -> list[range]:
    """Split parameters of ``sizes`` elements (in model order) into ``fragments`` contiguous groups of about equal size.

    Fragment ``p`` ends at the first parameter where the running total reaches ``(p+1)/P`` of the
    whole, keeping at least one parameter in each group. Returns the index ranges; a ValueError
    when there are fewer parameters than fragments.
    """
    count = len(sizes)
    if fragments > count:
        raise ValueError(f"{algorithm}: fragments ({fragments}) must not exceed the number of parameters ({count})")
    total = float(sum(sizes))
    ends, running, start = [], 0, 0
    for p in range(fragments - 1):
        target = total * (p + 1) / fragments
        end = start + 1
        running += sizes[start]
        # Stop where the running total reaches the target, leaving a parameter for each later fragment.
        while end < count - (fragments - 1 - p) and running < target:
            running += sizes[end]
            end += 1
        ends.append(end)
        start = end
    ends.append(count)
    return [range(begin, end) for begin, end in zip([0, *ends[:-1]], ends)]

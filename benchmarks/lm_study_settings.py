"""The LM study's training settings: the GPT, the batch, the learning-rate schedule and the token budget.

Chosen by the search in ``benchmarks/lm_study_sweep.py`` (results in ``benchmarks/results/lm-study-sweep.md``) so
that DDP fp32 on 4 ranks learns well past the corpus's bigram entropy. Every variant of ``benchmarks/lm_study.py``
trains with these, both front ends alike: the same tokens (``Corpus.batch(seed, step, rank, ...)``), the same
schedule; the Adam-type algorithms (QAdam, 1-bit Adam) with a schedule of their own, tuned in the same search.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

RANKS = 4


@dataclass(frozen=True)
class Schedule:
    """The learning rate at update ``s`` (0 for the first): ``peak * s+1 / warmup`` during the linear warm-up, then
    ``peak`` (``constant``) or a cosine from ``peak`` down to ``final_ratio * peak`` at update ``total - 1``
    (``cosine``)."""

    peak: float
    warmup: int
    total: int
    kind: Literal["cosine", "constant"] = "cosine"
    final_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not (self.peak > 0 and 0 <= self.warmup < self.total and 0 <= self.final_ratio <= 1):
            raise ValueError(f"schedule: need peak > 0, 0 <= warmup < total, 0 <= final_ratio <= 1; got {self}")
        if self.kind not in ("cosine", "constant"):
            raise ValueError(f"schedule: kind must be 'cosine' or 'constant', got {self.kind!r}")

    def factor(self, step: Any, xp: Any = math) -> Any:
        """The learning rate at update ``step`` over ``peak``; ``xp`` is ``math`` for a Python int, ``jax.numpy``
        for a traced count (optax's)."""
        warm = (step + 1) / self.warmup if self.warmup else 1.0
        if self.kind == "constant":
            return _minimum(xp, warm, 1.0)
        span = max(1, self.total - 1 - self.warmup)
        progress = _minimum(xp, _maximum(xp, (step - self.warmup) / span, 0.0), 1.0)
        cosine = self.final_ratio + (1 - self.final_ratio) * 0.5 * (1 + xp.cos(math.pi * progress))
        return _minimum(xp, warm, cosine) if self.warmup else cosine

    def rate(self, step: Any, xp: Any = math) -> Any:
        """The learning rate at update ``step``."""
        return self.peak * self.factor(step, xp)

    def optax(self) -> Any:
        """This schedule as an optax schedule (a function of the update count)."""
        import jax.numpy as jnp

        return lambda count: self.rate(count, jnp)


def _minimum(xp: Any, a: Any, b: Any) -> Any:
    return min(a, b) if xp is math else xp.minimum(a, b)


def _maximum(xp: Any, a: Any, b: Any) -> Any:
    return max(a, b) if xp is math else xp.maximum(a, b)


@dataclass(frozen=True)
class Settings:
    """What every variant of the study trains with. ``windows``: windows of ``context + 1`` corpus bytes per rank
    and step; ``steps``: the budget; ``schedule`` AdamW's (betas ``betas``, decoupled ``weight_decay``) and
    ``adam_schedule`` the Adam-type algorithms' (their own Adam, no weight decay); ``heldout_windows`` held-out
    windows evaluated every ``eval_every`` steps on rank 0's model."""

    size: str
    windows: int
    steps: int
    schedule: Schedule
    adam_schedule: Schedule
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    seed: int = 0
    ranks: int = RANKS
    heldout_windows: int = 128
    eval_every: int = 50

    def as_dict(self) -> dict[str, Any]:
        """The settings as JSON-able values (what a kept result must share with a rerun)."""
        out = asdict(self)
        out["betas"] = list(self.betas)
        return out

    def with_steps(self, steps: int) -> Settings:
        """The same settings over ``steps`` steps, both schedules stretched to them (a shorter run for checks)."""
        return replace(
            self,
            steps=steps,
            schedule=replace(self.schedule, total=steps, warmup=min(self.schedule.warmup, steps // 4)),
            adam_schedule=replace(self.adam_schedule, total=steps, warmup=min(self.adam_schedule.warmup, steps // 4)),
            eval_every=max(1, min(self.eval_every, steps // 10)),
        )

    @property
    def tokens_per_step(self) -> int:
        """Predicted bytes per step over every rank."""
        from bagua_common.workload import gpt_config

        return self.ranks * self.windows * gpt_config(self.size).context

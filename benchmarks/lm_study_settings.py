"""The LM study's training settings: the GPT, the batch, the learning-rate schedule and the token budget.

Chosen by the search in ``benchmarks/lm_study_sweep.py`` (results in ``benchmarks/results/lm-study-sweep.md``) so
that DDP fp32 on 4 ranks learns well past the corpus's bigram entropy. Every variant of ``benchmarks/lm_study.py``
trains with these, both front ends alike: the same tokens (``Corpus.batch(seed, step, rank, ...)``), the same
schedule; the Adam-type algorithms (QAdam, 1-bit Adam) with a schedule of their own, tuned in the same search.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Literal

RANKS = 4


@dataclass(frozen=True)
class Schedule:
    """The learning rate at update ``s`` (0 for the first), optax's ``warmup_cosine_decay_schedule`` (``cosine``) or
    its warm-up alone (``constant``): ``peak * s / warmup`` during the linear warm-up, then ``peak``, or a cosine
    from ``peak`` down to ``final_ratio * peak`` at update ``total``."""

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

    def factor(self, step: int) -> float:
        """The learning rate at update ``step`` over ``peak`` (torch's ``LambdaLR`` takes this)."""
        if step < self.warmup:
            return step / self.warmup
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup) / (self.total - self.warmup))
        return self.final_ratio + (1 - self.final_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def optax(self) -> Any:
        """This schedule as optax's own schedule function (of the update count)."""
        import optax

        if self.kind == "constant":
            return optax.linear_schedule(0.0, self.peak, self.warmup)
        return optax.warmup_cosine_decay_schedule(0.0, self.peak, self.warmup, self.total, self.final_ratio * self.peak)


@dataclass(frozen=True)
class Settings:
    """What every variant of the study trains with. ``windows``: windows of ``context + 1`` corpus bytes per rank
    and step; ``steps``: the budget; ``schedule`` AdamW's (betas ``betas``, decoupled ``weight_decay``) and
    ``adam_schedule`` the Adam-type algorithms' (their own Adam, betas ``adam_betas``, no weight decay);
    ``heldout_windows`` held-out windows evaluated every ``eval_every`` steps on rank 0's model."""

    size: str
    windows: int
    steps: int
    schedule: Schedule
    adam_schedule: Schedule
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1
    adam_betas: tuple[float, float] = (0.9, 0.999)
    seed: int = 0
    ranks: int = RANKS
    heldout_windows: int = 128
    eval_every: int = 50

    def as_dict(self) -> dict[str, Any]:
        """The settings as JSON-able values (what a kept result must share with a rerun)."""
        out = asdict(self)
        out["betas"], out["adam_betas"] = list(self.betas), list(self.adam_betas)
        return out

    @property
    def tokens_per_step(self) -> int:
        """Predicted bytes per step over every rank."""
        from bagua_common.workload import gpt_config

        return self.ranks * self.windows * gpt_config(self.size).context


STUDY = Settings(
    size="mini",
    windows=1,
    steps=4000,
    schedule=Schedule(peak=2e-3, warmup=100, total=4000),
    adam_schedule=Schedule(peak=2e-3, warmup=100, total=4000),
    eval_every=100,
)
"""The study's settings: the sweep's best run (``benchmarks/results/lm-study-sweep.md``: held-out 1.606 nats/byte
after 2.05M tokens at peak lr 2e-3, 1.664 at 1e-3). The Adam-type algorithms' schedule is AdamW's: their own search
(``ADAM_SEARCH`` in ``lm_study.py``: peak 1e-3 and 4e-3) ended higher at both. Their warm-up and ``b2`` searched
beside it (``ADAM_WARMUP_SEARCH``, ``ADAM_B2_SEARCH``) moved neither's ending by more than the seed does
(``docs/results/lm_study.md``): the study keeps the algorithms' defaults."""

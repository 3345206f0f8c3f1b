"""The convergence gate's run, shared by both front ends: what every algorithm trains, and how it is judged.

The model is MODEL: the ``tiny`` GPT (2 blocks of 64 channels) at half its context, 32 bytes, which costs half as
much per step and, per step, learns nearly as much (single process, 16 windows per step: held-out 2.49 after 300
steps against 2.41 with 64 bytes). Every algorithm starts from one model: MODEL after PRETRAIN_STEPS steps of plain
AdamW in one process, PRETRAIN_WINDOWS windows per step, its lr rising linearly from 0 to PRETRAIN_LR over those
steps (test_gpt_convergence_gate.pretrained). That model has left the unigram plateau but stays above BAR (held-out
2.56-2.65 nats per byte; at least START_FLOOR): each algorithm crosses the bar itself, while none pays again for
the first steps, which every optimizer that averages gradients or models passes alike.
From the start each algorithm trains STEPS steps of NRANKS x BATCH windows of the corpus (each rank's tokens from
``(seed, PRETRAIN_STEPS + step, rank)``): JAX on a mesh of NRANKS devices, BATCH windows per rank; torch on
TORCH_NODES nodes of NRANKS ranks (``local_world_size=NRANKS``), BATCH // TORCH_NODES windows per rank, so that its
hierarchical algorithms train on both levels. The optimizer is AdamW (betas 0.9 / B2) at :func:`learning_rate`, a
WARMUP-step linear warm-up to LR and a cosine decay to FINAL_LR_FRACTION of it at STEPS; the Adam-type algorithms
are their own optimizer (Adam, the same betas and schedule, after their own full-precision warm-up). Each
algorithm runs with its registry defaults except the options in OPTIONS, which fit the run into STEPS (a warm-up,
a round length, an averaging interval that a run of STEPS short steps can see).
"""

from __future__ import annotations

import math

import numpy as np

from bagua_common.workload import GPTConfig

MODEL = GPTConfig("gate", layers=2, width=64, heads=4, context=32)
"""The ``tiny`` GPT at half its context: per step it learns about as much as ``tiny`` with 64 and costs half."""
NRANKS, TORCH_NODES = 2, 2
PRETRAIN_STEPS, PRETRAIN_WINDOWS, PRETRAIN_LR = 250, 16, 5e-3
STEPS, BATCH, LR, WARMUP, FINAL_LR_FRACTION = 200, 8, 5e-3, 10, 0.1
B2, WEIGHT_DECAY = 0.95, 0.01
HELDOUT_WINDOWS = 64
BAR = 2.5
"""The held-out loss (nats per byte) every algorithm must end at or below: 0.8 below the held-out text's unigram
entropy (3.31), which byte frequencies alone cannot reach."""
START_FLOOR = 2.52
"""The shared start's held-out loss is at least this (above BAR): every algorithm crosses the bar itself."""

OPTIONS: dict[str, dict] = {
    "qadam": {"warmup_steps": 30},
    "onebit_adam": {"warmup_steps": 30},
    "async": {"sync_interval_ms": 1, "warmup_steps": 30},
    "diloco": {"sync_every": 10, "outer_learning_rate": 1.0, "outer_momentum": 0.0},
}
"""Registry name -> options other than the defaults; a name without an entry runs with its defaults. DiLoCo: 20
rounds whose outer step is the ranks' mean (lr 1, no momentum). Its default Nesterov step (lr 0.7, momentum 0.9)
is tuned for hundreds of inner steps per round; here, at 25 steps per round, it ended 0.12 above allreduce
(seed 1: 2.554 against 2.430 after 150 steps), with plain averaging every 10 steps 0.02 above. Asynchronous
averaging: 30 warm-up steps of gradient allreduce, then rounds as often as they can run (a round every 1 ms at
most); its steps last ASYNC_STEP_SECONDS in both front ends."""

ASYNC_STEP_SECONDS = 0.03
"""The least time a torch step of asynchronous averaging takes (the gate's loop sleeps the rest), as a step whose
compute runs on an accelerator does while its host thread waits. The gate's 4 torch ranks share 2 cores and compute
a step in about 8 ms; without it the averaging threads got so little CPU that a round took 100-500 ms: 1-3 rounds
in 110 steps after a 90-step warm-up, local steps of 4 windows per rank averaged every ~40 steps, which left ranks
at 2.41-2.55 (2026-12-01, one at 2.509 in CI). With it: 55-71 rounds in the 170 steps after the warm-up, every rank
within 0.04 of gradient allreduce, beside two busy processes too. JAX's 2 ranks take the same floor: without it a
CI run (2026-12-02) had 14 rounds in those 170 steps, under the 17 the gate asks, and a rerun 35; with it 59 (steps
of 25-30 ms)."""


def learning_rate(step: int) -> float:
    """The learning rate of gate step ``step`` (0-based), the same in both front ends: ``LR * step / WARMUP`` during
    the warm-up, then a cosine from LR down to ``FINAL_LR_FRACTION * LR`` at STEPS (optax's
    ``warmup_cosine_decay_schedule(0, LR, WARMUP, STEPS, FINAL_LR_FRACTION * LR)``)."""
    if step < WARMUP:
        return LR * step / WARMUP
    progress = min(1.0, (step - WARMUP) / (STEPS - WARMUP))
    return LR * (FINAL_LR_FRACTION + (1.0 - FINAL_LR_FRACTION) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def summary(params: dict[str, np.ndarray], heldout_loss: float) -> dict:
    """What the gate judges of one rank's trained model: its held-out loss, whether every parameter is finite,
    and each parameter's largest magnitude."""
    return {
        "heldout_loss": float(heldout_loss),
        "finite": all(bool(np.isfinite(v).all()) for v in params.values()),
        "max_abs": {k: float(np.abs(v).max()) for k, v in params.items()},
    }

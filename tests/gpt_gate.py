"""The convergence gate's run, shared by both front ends: what every algorithm trains, and how it is judged.

The ``tiny`` GPT, STEPS steps of NRANKS x BATCH windows of the corpus (each rank's tokens from ``(seed, step,
rank)``): JAX on a mesh of NRANKS devices, BATCH windows per rank; torch on TORCH_NODES nodes of NRANKS ranks
(``local_world_size=NRANKS``), BATCH // TORCH_NODES windows per rank, so that its hierarchical algorithms train on
both levels. AdamW (lr LR) is the optimizer of every algorithm but the Adam-type ones, which are their own
optimizer (Adam, same lr, WARMUP steps of full-precision warm-up). Each algorithm runs with its registry defaults
except the options in OPTIONS, which fit the run into STEPS (a warm-up, a round length, an averaging interval
that a few hundred short steps can see).
"""

from __future__ import annotations

import numpy as np

SIZE, NRANKS, STEPS, BATCH, LR, WEIGHT_DECAY, WARMUP = "tiny", 2, 150, 4, 3e-3, 0.01, 40
HELDOUT_WINDOWS = 32
TORCH_NODES = 2

OPTIONS: dict[str, dict] = {
    "qadam": {"warmup_steps": WARMUP},
    "onebit_adam": {"warmup_steps": WARMUP},
    "async": {"sync_interval_ms": 5, "warmup_steps": WARMUP},
    "diloco": {"sync_every": 50},
}
"""Registry name -> options other than the defaults; a name without an entry runs with its defaults."""


def summary(params: dict[str, np.ndarray], heldout_loss: float) -> dict:
    """What the gate judges of one rank's trained model: its held-out loss, whether every parameter is finite,
    and each parameter's largest magnitude."""
    return {
        "heldout_loss": float(heldout_loss),
        "finite": all(bool(np.isfinite(v).all()) for v in params.values()),
        "max_abs": {k: float(np.abs(v).max()) for k, v in params.items()},
    }

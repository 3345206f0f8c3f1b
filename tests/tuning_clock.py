"""A fake clock for the JAX tuner's timings, so that a test's search does not depend on the machine's load.

On a loaded machine one real 5-step sample of a test's tiny program ran 30x slower than the fastest sample before
it, past the tuner's timeout (4x), and its setting left the search. Here each candidate's step advances the clock
by a cost the test gives, and nothing else does: the search's samples, medians and winner follow from the costs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import bagua_jax.autotune
import bagua_jax.trainer
from bagua_jax.algorithms.base import Algorithm


class FakeClock:
    """Stands for the ``time`` module in :mod:`bagua_jax.autotune`; the costed steps advance :attr:`now`."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


def cost_tuning_steps(cost: Callable[[Algorithm], float], set_attribute: Callable[[Any, str, Any], None]) -> None:
    """Make every step that :class:`~bagua_jax.trainer.DataParallel`'s tuning times cost ``cost(candidate)`` seconds
    on a fake clock. ``set_attribute`` is ``monkeypatch.setattr`` in a test (undone after it), ``setattr`` in a
    worker process. Costs that are binary fractions keep the clock's sums and differences exact."""
    clock = FakeClock()
    tune = bagua_jax.autotune.tune_bucket_bytes

    def costed_tuning(params, algorithm, step_for, **options):
        def costed_step_for(candidate):
            step = step_for(candidate)

            def costed_step():
                clock.now += cost(candidate)
                return step()

            return costed_step

        return tune(params, algorithm, costed_step_for, **options)

    set_attribute(bagua_jax.autotune, "time", clock)
    set_attribute(bagua_jax.trainer, "tune_bucket_bytes", costed_tuning)

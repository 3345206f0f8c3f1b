"""QAdam and 1-bit Adam train a CNN and an embedding + attention model about as well as Adam (torch).

The torch counterpart of test_adam_convergence_jax.py, on the same tasks (tests/adam_tasks.py):
many coordinates have an exactly zero second moment when the warm-up ends. One job of 2 gloo
processes (adam_convergence_workers_torch.py) trains every variant; the reference is
single-process ``torch.optim.Adam`` on the same global batches. Asserted on rank 0's model, as in
the JAX test: ``adam_tasks.assert_trains_like_adam``.
"""

from __future__ import annotations

import adam_tasks
import pytest
import torch
from adam_convergence_workers_torch import TASKS, adam_reference
from multiprocess import run_ranks

ALGORITHMS = ("qadam", "onebit_adam")
VARIANTS = [(task, algorithm) for task in TASKS for algorithm in ALGORITHMS]
_cache: dict[str, dict] = {}


def trained(task: str, algorithm: str, seed: int) -> dict:
    """Rank 0's result for a variant; all variants run in one 2-rank job, once per session."""
    if "job" not in _cache:
        results = run_ranks("adam_convergence_workers_torch:job", 2, seed, VARIANTS, timeout=300)
        _cache["job"] = next(r.value for r in results if r.rank == 0)
    return _cache["job"][f"{task}/{algorithm}"]


def reference(task: str, seed: int) -> dict:
    if task not in _cache:
        torch.set_num_threads(1)
        _cache[task] = adam_reference(task, seed)
    return _cache[task]


@pytest.mark.parametrize("task, algorithm", VARIANTS)
def test_trains_like_adam(task, algorithm, seed):
    result, adam = trained(task, algorithm, seed), reference(task, seed)
    adam_tasks.assert_trains_like_adam(
        f"{task} {algorithm}", result["params"], result["loss"], adam["params"], adam["loss"]
    )

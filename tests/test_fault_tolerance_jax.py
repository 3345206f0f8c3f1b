"""The JAX trainer survives a lost member without a restart (native MPI engine, gradient allreduce).

Three members, each its own ``mpiexec -n 1`` job; member 2 fails while the others are blocked in step 3's
allreduce; a fourth process joins the running job afterwards. Checked against a NumPy replay of the same
transactions: every step committed once, the abandoned one retried on the survivors' re-partition of the same
samples (none twice, none skipped), the average taken over the new world size, the step not compiled again, the
replicas bit-identical, the joiner trained from the donor's state.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
from fault_tolerance_workers_jax import BATCH_PER_RANK, FEATURES, LR, SAMPLES, STEPS, dataset
from multiprocess import ONE_CPU_DEVICE, has_mpiexec, run_ranks

from bagua_common.fault_tolerance import DataPosition

pytestmark = pytest.mark.skipif(not has_mpiexec(), reason="needs mpiexec (the mpich wheel)")

VICTIM, FAULT_STEP, START = 2, 3, 3


def replay(sizes: dict[int, int]) -> dict[str, np.ndarray]:
    """The parameters after the committed transactions, each over its world size, in float64."""
    x, y = (a.astype(np.float64) for a in dataset())
    w, b = np.zeros(FEATURES), 0.0
    position = DataPosition(SAMPLES, BATCH_PER_RANK, seed=3)
    for t in range(1, STEPS + 1):
        n = sizes[t]
        grads = []
        for r in range(n):
            i = position.indices(r, n)
            error = x[i] @ w + b - y[i]
            grads.append((2 * x[i].T @ error / len(i), 2 * error.mean()))
        w = w - LR * np.mean([g[0] for g in grads], axis=0)
        b = b - LR * np.mean([g[1] for g in grads])
        position.advance(n)
    return {"w": w, "b": np.asarray(b)}


@pytest.mark.parametrize("fault", ["kill"])
def test_survivors_resume_and_a_joiner_trains(tmp_path: Path, fault: str):
    def react(codes):
        if fault == "stop" and all(c is not None for r, c in enumerate(codes) if r != VICTIM):
            os.kill(int((tmp_path / f"pid{VICTIM}").read_text()), signal.SIGKILL)

    results = run_ranks(
        "fault_tolerance_workers_jax:train",
        START + 1,
        VICTIM,
        fault,
        FAULT_STEP,
        START,
        launcher="mpiexec-per-rank",
        timeout=240,
        env={**ONE_CPU_DEVICE, "BAGUA_TEST_SIGNALS": str(tmp_path)},
        check=False,
        watch=react,
    )
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert results[VICTIM].returncode != 0, outputs
    members = [r for r in results if r.rank != VICTIM]
    assert all(r.returncode == 0 for r in members), outputs
    fault_time = float((tmp_path / "fault-time").read_text())
    sizes: dict[int, int] = {}
    for result in members:
        seen = result.value
        for step in seen["steps"]:
            assert sizes.setdefault(step["transaction"], step["size"]) == step["size"], outputs
    assert sorted(sizes) == list(range(1, STEPS + 1))
    assert sizes[FAULT_STEP - 1] == START and sizes[FAULT_STEP] == START - 1, sizes
    reference = replay(sizes)
    position = DataPosition(SAMPLES, BATCH_PER_RANK, seed=3)
    expected = {}
    for t in range(1, STEPS + 1):
        expected[t] = [position.indices(r, sizes[t]).tolist() for r in range(sizes[t])]
        position.advance(sizes[t])
    first = members[0].value["params"]
    for result in members:
        seen = result.value
        for step in seen["steps"]:  # each rank trained on exactly its part of the re-partition
            assert step["indices"] == expected[step["transaction"]][step["rank"]], step
        for name, value in reference.items():
            np.testing.assert_allclose(seen["params"][name], value, rtol=2e-5, atol=1e-6)
            np.testing.assert_array_equal(seen["params"][name], first[name])  # replicas bit-identical
    for result in members[:-1]:  # the survivors
        seen = result.value
        assert [s["transaction"] for s in seen["steps"]] == list(range(1, STEPS + 1))
        retried = [a for a in seen["attempts"] if a["transaction"] == FAULT_STEP]
        assert len(retried) == 2 and "committed" not in retried[0], retried  # one step lost, retried once
        assert seen["compiled"] == 1  # the membership change compiled nothing
        resume = retried[1]["start"] - fault_time
        assert 0 < resume < 20, resume
        print(f"rank {result.rank}: resumed {resume:.2f} s after the fault; recoveries {seen['recoveries']}")
    joiner = members[-1].value
    assert joiner["steps"][0]["transaction"] > FAULT_STEP and joiner["steps"][-1]["transaction"] == STEPS
    print(f"joiner: first step committed {joiner['first_commit'] - joiner['admitted']:.2f} s after admission")

"""The JAX trainer survives lost members without a restart (native MPI engine, gradient allreduce).

Four members, each its own ``mpiexec -n 1`` job. Member 3 is SIGKILLed, member 2 SIGSTOPped (a hang: found by
missed heartbeats) and member 1 raises, each while the others are blocked in a step's allreduce; then a fifth
process joins the one survivor. Checked against a NumPy replay of the same transactions: every step committed
once, each abandoned one retried on the survivors' re-partition of the same samples (none twice, none skipped),
the average taken over the new world size, the step never compiled again, the replicas bit-identical, the joiner
trained from the survivor's state, and the job marked finished in the launcher's directory at the end.
"""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from fault_tolerance_workers_jax import BATCH_PER_RANK, FEATURES, LR, SAMPLES, dataset
from multiprocess import ONE_CPU_DEVICE, has_mpiexec, run_ranks

from bagua_common.fault_tolerance import DataPosition, KVClient, job_secret
from bagua_common.fault_tolerance.node_directory import FINISHED

pytestmark = pytest.mark.skipif(not has_mpiexec(), reason="needs mpiexec (the mpich wheel)")

START, FINAL, STEPS = 4, 2, 12
FAULTS = {3: (3, "kill"), 5: (2, "stop"), 7: (1, "raise")}


def replay(sizes: dict[int, int]) -> dict[str, np.ndarray]:
    """The parameters after the committed transactions, each over its world size, in float64."""
    x, y = (a.astype(np.float64) for a in dataset())
    w, b = np.zeros(FEATURES), 0.0
    position = DataPosition(SAMPLES, BATCH_PER_RANK, seed=3)
    for t in range(1, len(sizes) + 1):
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


def test_survivors_of_a_kill_a_hang_and_an_exception_resume_and_a_joiner_trains(tmp_path: Path, launcher_directory):
    stopped = FAULTS[5][0]

    def react(codes):  # the hung member never ends by itself: end it once the others did (its mpiexec sees it later)
        if all(c is not None for r, c in enumerate(codes) if r != stopped) and codes[stopped] is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int((tmp_path / f"pid{stopped}").read_text()), signal.SIGKILL)

    results = run_ranks(
        "fault_tolerance_workers_jax:train",
        START + 1,
        FAULTS,
        START,
        FINAL,
        STEPS,
        launcher="mpiexec-per-rank",
        timeout=240,
        env={**ONE_CPU_DEVICE, "BAGUA_TEST_SIGNALS": str(tmp_path)},
        check=False,
        watch=react,
    )
    with contextlib.closing(KVClient("127.0.0.1", launcher_directory.port, 5.0, secret=job_secret())) as client:
        finished = client.check(FINISHED)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    victims = [rank for rank, _ in FAULTS.values()]
    assert all(results[v].returncode != 0 and results[v].value is None for v in victims), outputs
    assert "the victim fails on purpose" in results[FAULTS[7][0]].output, outputs
    members = [r for r in results if r.rank not in victims]
    assert all(r.returncode == 0 for r in members), outputs
    sizes: dict[int, int] = {}
    for result in members:
        for step in result.value["steps"]:
            assert sizes.setdefault(step["transaction"], step["size"]) == step["size"], outputs
    assert sorted(sizes) == list(range(1, len(sizes) + 1)) and len(sizes) >= STEPS
    assert finished is not None and int(finished) == len(sizes)  # ft.finished(): a replacement now exits
    assert [sizes[t] for t in (2, 3, 4, 5, 6, 7, 8)] == [4, 3, 3, 2, 2, 1, 1], sizes
    reference = replay(sizes)
    position = DataPosition(SAMPLES, BATCH_PER_RANK, seed=3)
    expected = {}
    for t in range(1, len(sizes) + 1):
        expected[t] = [position.indices(r, sizes[t]).tolist() for r in range(sizes[t])]
        position.advance(sizes[t])
    survivor, joiner = (r.value for r in members)
    for seen in (survivor, joiner):
        for step in seen["steps"]:  # each rank trained on exactly its part of the re-partition
            assert step["indices"] == expected[step["transaction"]][step["rank"]], step
        for name, value in reference.items():
            np.testing.assert_allclose(seen["params"][name], value, rtol=2e-5, atol=1e-6)
            np.testing.assert_array_equal(seen["params"][name], survivor["params"][name])  # bit-identical
    assert [s["transaction"] for s in survivor["steps"]] == list(range(1, len(sizes) + 1))
    for fault_step, (_, kind) in FAULTS.items():
        retried = [a for a in survivor["attempts"] if a["transaction"] == fault_step]
        assert len(retried) == 2 and "committed" not in retried[0], retried  # one step lost, retried once
        resume = retried[1]["start"] - float((tmp_path / f"fault-time-{fault_step}").read_text())
        assert 0 < resume < 20, resume
        print(f"{kind}: the survivor resumed {resume:.2f} s after the fault")
    assert survivor["compiled"] == 1  # no membership change compiled anything
    assert joiner["compiled"] == 1
    first = joiner["steps"][0]["transaction"]
    assert sizes[first - 1] == 1 and sizes[first] == 2, (first, sizes)
    print(f"joiner: first step committed {joiner['steps'][0]['end'] - joiner['admitted']:.2f} s after admission")


def test_a_survivor_that_had_not_applied_a_step_another_applied_is_given_its_state(tmp_path: Path):
    # Step 3's allreduce completes on all three members. Member 0 votes ahead and goes on; member 2 dies before its
    # vote; member 1 votes after the epoch closed, having told the next epoch it applied step 2 only.
    faults = {3: (2, "kill-before-vote")}
    results = run_ranks(
        "fault_tolerance_workers_jax:train",
        3,
        faults,
        3,
        2,
        6,
        (1, 3),
        launcher="mpiexec-per-rank",
        timeout=180,
        env={**ONE_CPU_DEVICE, "BAGUA_TEST_SIGNALS": str(tmp_path)},
        check=False,
    )
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert results[2].returncode != 0 and [r.returncode for r in results[:2]] == [0, 0], outputs
    applied, behind = results[0].value, results[1].value
    sizes = {s["transaction"]: s["size"] for s in applied["steps"]}
    assert sizes == {1: 3, 2: 3, 3: 3, 4: 2, 5: 2, 6: 2}, sizes  # step 3 counts: member 0 applied it
    for name, value in replay(sizes).items():
        np.testing.assert_allclose(applied["params"][name], value, rtol=2e-5, atol=1e-6)
        np.testing.assert_array_equal(behind["params"][name], applied["params"][name])  # bit-identical
    assert [a["transaction"] for a in applied["attempts"]] == [1, 2, 3, 4, 4, 5, 6]  # step 4 in flight: again
    # member 1 did not apply step 3 and was given member 0's state at it: nothing run twice, nothing lost
    assert [a["transaction"] for a in behind["attempts"]] == [1, 2, 3, 4, 5, 6]
    assert [s["transaction"] for s in behind["steps"]] == [1, 2, 4, 5, 6]

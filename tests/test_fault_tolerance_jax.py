"""The JAX trainer survives lost members without a restart (native MPI engine, gradient allreduce and DiLoCo).

Four members, each its own ``mpiexec -n 1`` job. Member 3 is SIGKILLed, member 2 SIGSTOPped (a hang: found by
missed heartbeats) and member 1 raises, each while the others are blocked in a step's allreduce; then a fifth
process joins the one survivor. Checked against a NumPy replay of the same transactions: every step committed
once, each abandoned one retried on the survivors' re-partition of the same samples (none twice, none skipped),
the average taken over the new world size, the step never compiled again, the replicas bit-identical, the joiner
trained from the survivor's state, and the job marked finished in the launcher's directory at the end. Under
DiLoCo, a member killed mid-round and one hung in a round's exchange cost the survivors no completed inner step:
checked against a NumPy replay of the rounds.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from fault_tolerance_workers_jax import (
    BATCH_PER_RANK,
    DILOCO_ROUND,
    FEATURES,
    LR,
    SAMPLES,
    dataset,
    mlp_params,
    prediction,
)
from multiprocess import ONE_CPU_DEVICE, TESTS, has_mpiexec, run_ranks
from ring_copies import assert_ring_copies_are_the_neighbours_weights

from bagua_common.algorithms.diloco import DiLoCoConfig
from bagua_common.comm.topology import shift_one_schedule
from bagua_common.fault_tolerance import DataPosition, KVClient, job_secret
from bagua_common.fault_tolerance.node_directory import FINISHED
from bagua_common.job.checkpoint import checkpoint_dir, checkpoint_to_restore, read_manifest
from bagua_jax.checkpoint import read_state

pytestmark = pytest.mark.skipif(not has_mpiexec(), reason="needs mpiexec (the mpich wheel)")


def run_members(
    tmp_path: Path,
    function: str,
    count: int,
    *args,
    hung: int | None = None,
    timeout: float = 240,
    env=None,
    engine: str = "tcp",
    network=None,
):
    """``fault_tolerance_workers_jax.function(*args)`` on ``count`` members over ``engine`` (TCP or MPI), each its own
    ``mpiexec -n 1`` job, with ``env`` added to their environment (and, given the network harness's ``network``, in
    its own namespace). The member ``hung`` (SIGSTOPped) never ends by itself: it is killed once the others ended."""

    def react(codes):
        if all(c is not None for r, c in enumerate(codes) if r != hung) and codes[hung] is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int((tmp_path / f"pid{hung}").read_text()), signal.SIGKILL)

    return run_ranks(
        f"fault_tolerance_workers_jax:{function}",
        count,
        *args,
        launcher="mpiexec-per-rank",
        timeout=timeout,
        env={**ONE_CPU_DEVICE, "BAGUA_TEST_SIGNALS": str(tmp_path), "FT_ENGINE": engine, **(env or {})},
        check=False,
        watch=None if hung is None else react,
        network=network,
    )


START, FINAL, STEPS = 4, 2, 12
FAULTS = {3: (3, "kill"), 5: (2, "stop"), 7: (1, "raise")}


def replayed_position(sizes: dict[int, int]) -> DataPosition:
    """The data position after the committed transactions, each over its world size."""
    position = DataPosition(SAMPLES, BATCH_PER_RANK, seed=3)
    for t in range(1, len(sizes) + 1):
        position.advance(sizes[t])
    return position


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


STEP_FUNCTIONS = ("jit(_rank_step)", "jit(_averaged)", "jit(_applied)")


def step_compilations(record: dict) -> dict[str, int]:
    """How often a member compiled its step and the halves of the one a joiner is weighed out of."""
    names = [name for _, name, *_ in record["compilations"]]
    return {name: names.count(name) for name in STEP_FUNCTIONS}


# A 1.3-MB unused layer beside the linear model: a step whose failed collectives leave JAX's effects token failed, as
# any model's larger than the linear one do (the recovery once waited on that token and raised the step's error).
LARGE_STEP = {"FT_HIDDEN": "65536"}
# PowerSGD on the linear model with a tanh layer of 32 beside it: its 5 x 32 matrix is compressed at rank 2.
POWERSGD = 'powersgd {"start_iter": 2, "rank": 2}'
POWERSGD_MODEL = {"FT_MLP": "32"}
# The per-step algorithms with state a change of members touches (residuals laid out per rank, Q, the Adams' moments).
STATEFUL_PER_STEP = [
    'bytegrad {"error_feedback": true}',
    POWERSGD,
    'qadam {"learning_rate": 0.2, "warmup_steps": 2}',
    'onebit_adam {"learning_rate": 0.2, "warmup_steps": 2}',
]


@pytest.mark.parametrize("engine", ["tcp", "mpi"])
def test_survivors_of_a_kill_a_hang_and_an_exception_resume_and_a_joiner_trains(
    tmp_path: Path, launcher_directory, engine: str
):
    results = run_members(
        tmp_path, "train", START + 1, FAULTS, START, FINAL, STEPS, hung=FAULTS[5][0], env=LARGE_STEP, engine=engine
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
            t = step["transaction"]  # a rank weighed out of the step is handed the first trainer's samples
            assert step["indices"] == expected[t][step["rank"] if step["rank"] < sizes[t] else 0], step
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
    directory = checkpoint_to_restore(tmp_path / "checkpoints")  # saved by the last members, after the changes
    assert read_manifest(directory).world_size == FINAL and len(read_state(directory)) == FINAL
    for shard in read_state(directory):
        for name, value in survivor["params"].items():
            np.testing.assert_array_equal(shard[f".params['{name}']"], value)
    # The step, and the two halves of the one a joiner is weighed out of (the average, as a member and as the joiner,
    # and the optimizer's update), each compiled once: no membership change compiled anything; the joiner compiled
    # them before it asked.
    compiled_once = {"jit(_rank_step)": 1, "jit(_averaged)": 2, "jit(_applied)": 1}
    assert step_compilations(survivor) == compiled_once, survivor["compilations"]
    assert step_compilations(joiner) == compiled_once, joiner["compilations"]
    assert all(when < joiner["admitted"] for when, name, *_ in joiner["compilations"] if name in STEP_FUNCTIONS)
    first = joiner["steps"][0]["transaction"]  # weighed out while its state arrived: the survivor alone trained it
    assert sizes[first - 1] == 1 and sizes[first] == 1 and sizes[first + 1] == 2, (first, sizes)
    assert joiner["steps"][0]["rank"] == 1 and joiner["steps"][1]["rank"] == 1
    first_end = joiner["steps"][0]["end"]
    later = sum(seconds for when, _, seconds, _ in joiner["compilations"] if joiner["admitted"] < when < first_end)
    print(
        f"joiner: first step committed {first_end - joiner['admitted']:.2f} s after admission, "
        f"{later:.3f} s of it compiling"
    )


def test_a_survivor_that_had_not_applied_a_step_another_applied_is_given_its_state(tmp_path: Path):
    # Step 3's allreduce completes on all three members. Member 0 votes ahead and goes on; member 2 dies before its
    # vote; member 1 votes after the epoch closed, having told the next epoch it applied step 2 only.
    faults = {3: (2, "kill-before-vote")}
    results = run_members(tmp_path, "train", 3, faults, 3, 2, 6, (1, 3), timeout=180)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert results[2].returncode != 0 and [r.returncode for r in results[:2]] == [0, 0], outputs
    applied, behind = results[0].value, results[1].value
    sizes = {s["transaction"]: s["size"] for s in applied["steps"]}
    # step 3 counts: member 0 applied it; member 1, given the state at it, is weighed out of step 4 meanwhile
    assert sizes == {1: 3, 2: 3, 3: 3, 4: 1, 5: 2, 6: 2}, sizes
    for name, value in replay(sizes).items():
        np.testing.assert_allclose(applied["params"][name], value, rtol=2e-5, atol=1e-6)
        np.testing.assert_array_equal(behind["params"][name], applied["params"][name])  # bit-identical
    assert [a["transaction"] for a in applied["attempts"]] == [1, 2, 3, 4, 4, 5, 6]  # step 4 in flight: again
    # member 1 did not apply step 3 and was given member 0's state at it: nothing run twice, nothing lost
    assert [a["transaction"] for a in behind["attempts"]] == [1, 2, 3, 4, 5, 6]
    assert [s["transaction"] for s in behind["steps"]] == [1, 2, 4, 5, 6]


def test_members_whose_step_timed_out_on_a_slow_member_go_on_together(tmp_path: Path):
    # Member 1 starts step 3 past the collective timeout, alive: member 0's allreduce times out and closes the epoch
    # with nobody lost, and the next epoch has the same members. Its communicator must be a new one: the closed
    # epoch's is revoked (every later collective failed, and both members aborted).
    results = run_members(tmp_path, "train", 2, {3: (1, "slow")}, 2, 2, 6, env={"FT_COMM_TIMEOUT": "4"}, timeout=180)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [0, 0], outputs
    first, second = (r.value for r in results)
    sizes = {s["transaction"]: s["size"] for s in first["steps"]}
    assert sizes == dict.fromkeys(range(1, 7), 2), sizes
    for name, value in replay(sizes).items():
        np.testing.assert_allclose(first["params"][name], value, rtol=2e-5, atol=1e-6)
        np.testing.assert_array_equal(second["params"][name], first["params"][name])  # bit-identical
    for seen in (first, second):
        retried = [a for a in seen["attempts"] if a["transaction"] == 3]
        assert len(retried) >= 2 and "committed" not in retried[0], retried  # the timed-out step, run again
        assert seen["recoveries"] and all(r["size"] == 2 for r in seen["recoveries"]), seen["recoveries"]


def test_members_whose_step_times_out_at_every_attempt_stop_naming_the_timeout(tmp_path: Path):
    # Member 1 starts step 3 past the 2-s collective timeout at every attempt, alive: every retry times out alike, and
    # the job retried forever without training. The third failure of the step with nobody lost stops both members,
    # each naming the step, the timeout and what to do.
    started = time.monotonic()
    results = run_members(tmp_path, "train", 2, {3: (1, "stalls")}, 2, 2, 6, env={"FT_COMM_TIMEOUT": "2"}, timeout=120)
    seconds = time.monotonic() - started
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert all(r.returncode not in (0, None) for r in results), outputs
    for result in results:
        assert "NoProgress: fault tolerance: transaction 3 failed 3 times in a row" in result.output, outputs
        assert "BAGUA_COMM_TIMEOUT" in result.output, outputs
    assert seconds < 60, seconds  # three attempts of about 2-3.5 s each, then both stop


def test_members_that_stop_with_no_progress_under_the_launcher_end_the_job_naming_why():
    # Their slots start no replacement (each would wait for a job that is gone, then end the slot anyway), and the
    # launcher's summary ends with NoProgress: JAX's exit no longer raises the abandoned step's error again from the
    # ordering tokens it waits for (two tracebacks in the summary's last lines, NoProgress scrolled out).
    launch = [sys.executable, "-m", "bagua_launch", "--fault-tolerant", "--mpi", "--nproc-per-node", "2"]
    env = {**os.environ, **ONE_CPU_DEVICE, "BAGUA_COMM_TIMEOUT": "2"}
    started = time.monotonic()
    result = subprocess.run([*launch, str(TESTS / "stalling_job_jax.py")], capture_output=True, text=True, env=env)
    seconds, output = time.monotonic() - started, result.stdout + result.stderr
    assert result.returncode == 1, output
    assert "after the members stopped the job on an error a replacement would meet too" in output, output
    assert "starting a replacement" not in output, output
    last_lines = result.stderr.rpartition("last lines of rank")[2]
    assert re.search(r"NoProgress: fault tolerance: transaction \d+ failed 3 times in a row", last_lines), output
    assert "Exception ignored in atexit callback" not in output, output
    assert seconds < 60, seconds  # three attempts of about 2-3.5 s each, then both stop


def test_a_member_that_raises_is_taken_for_lost_as_the_exception_ends_its_program(tmp_path: Path):
    # Member 2 raises in step 3's collective, and its process then takes 6 s more to end (an exit handler, as a GPU
    # runtime's teardown may): alive meanwhile, its heartbeats and sockets would keep the others waiting in the
    # collective. Its membership closes its connections and store as the exception ends the program, before that
    # handler runs: the others resume at once, as after a SIGKILL.
    results = run_members(tmp_path, "train", 3, {3: (2, "raise")}, 3, 2, 6, env={"FT_SLOW_EXIT": "6"}, timeout=120)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [0, 0, 1] and "fails on purpose" in results[2].output, outputs
    retried = [a for a in results[0].value["attempts"] if a["transaction"] == 3]
    resume = retried[-1]["start"] - float((tmp_path / "fault-time-3").read_text())
    assert len(retried) == 2 and 0 < resume < 2, (retried, resume)


@pytest.mark.parametrize(("kind", "member"), [("pause", 2), ("partition", 0)])
def test_a_member_taken_for_dead_while_alive_joins_again_and_trains_on(tmp_path: Path, request, kind: str, member: int):
    # pause: member 2 is stopped in step 3 past dead_after, then goes on. partition: member 0, the coordinator, loses
    # its link in step 3 for as long, running (each member in its own network namespace); alone, it is a minority and
    # must train nothing by itself. Either way the others, a majority, went on without it, coordinated by one of
    # them. It joins the job again as a new member, is given their state (weighed out of its first step) and trains
    # to the end with them; it exited with Evicted before.
    network = request.getfixturevalue("network") if kind == "partition" else None
    results = run_members(tmp_path, "train", 3, {3: (member, kind)}, 3, 3, 8, timeout=180, network=network)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [0, 0, 0], outputs
    back = results[member].value
    first, second = (r.value for r in results if r.rank != member)
    sizes = {s["transaction"]: s["size"] for s in first["steps"]}
    assert sizes[1] == sizes[2] == 3 and sizes[3] == 2, sizes  # step 3 retried by the two
    # Back from a pause, its step 3 may complete against the others' abandoned first attempt (MPI matches the calls)
    # and be applied here alone: the state it is given on joining again replaces it. Cut off, it completes nothing.
    (again,) = back["recoveries"]  # its one recovery: the epoch that admitted it again
    back_steps = [s for s in back["steps"] if s["epoch"] >= again["epoch"]]
    rejoined = back_steps[0]["transaction"]  # weighed out of it, then trained by all three
    assert [(s["transaction"], s["epoch"]) for s in back["steps"][:2]] == [(1, 0), (2, 0)], back["steps"]
    if kind == "partition":
        assert len(back["steps"]) == 2 + len(back_steps), f"it trained alone: {back['steps']}"
    assert rejoined > 3 and [s["transaction"] for s in back_steps] == list(range(rejoined, len(sizes) + 1))
    assert sizes[rejoined] == 2 and all(sizes[t] == 3 for t in sizes if t > rejoined), sizes
    for name, value in replay(sizes).items():
        np.testing.assert_allclose(back["params"][name], value, rtol=2e-5, atol=1e-6)
        for other in (first, second):
            np.testing.assert_array_equal(other["params"][name], back["params"][name])  # bit-identical
    retried = [a for a in first["attempts"] if a["transaction"] == 3]
    resume = retried[-1]["start"] - float((tmp_path / "fault-time-3").read_text())
    assert len(retried) == 2 and 0 < resume < 10, (retried, resume)  # dead_after (1.5 s), then at once
    print(f"{kind}: the others resumed {resume:.2f} s after it; it trained again from step {rejoined}")


def test_a_coordinator_cut_off_in_a_checkpoint_commits_nothing_alone_and_a_restart_goes_on_from_the_last(
    tmp_path: Path, network
):
    # The members save after every step; member 0, the coordinator, which commits each save, loses its link past
    # dead_after in the save after step 2, its part written, before the others said theirs were (each member in its
    # own network namespace). It must commit nothing it does not know whole, and the other two leave that save
    # uncommitted too; they train and save steps 3 and 4 as two (member 1 committing), and save with member 0 again
    # once it is back with their state. A restart of the whole job from the last save starts from the state all three
    # ended with, the data where they left it.
    env = {"FT_SAVE_EVERY_STEP": "1", "FT_CUT_OFF_IN_SAVE": "0:2"}
    results = run_members(tmp_path, "train", 3, {}, 3, 3, 10, env=env, timeout=180, network=network)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [0, 0, 0], outputs
    back, *majority = (r.value for r in results)
    sizes = {s["transaction"]: s["size"] for s in majority[0]["steps"]}
    returned = back["steps"][2]["transaction"]  # weighed out of it, admitted at the commit before
    trained = [s["transaction"] for s in back["steps"]]
    assert trained == [1, 2, *range(returned, len(sizes) + 1)] and returned > 5, f"it trained alone: {back['steps']}"

    def committed(member: dict) -> list[tuple[int, str]]:
        return [(s["step"], s["folder"]) for s in member["saves"] if s["folder"] is not None]

    with pytest.raises(FileNotFoundError):
        read_manifest(checkpoint_dir(tmp_path / "checkpoints", 2))
    # every step's save commits but the one it was cut off in and its admission's (it sits out the state's travel)
    expected = [t for t in sizes if t not in (2, returned - 1)]
    assert [step for step, _ in committed(majority[0])] == expected, majority[0]["saves"]
    assert committed(majority[1]) == committed(majority[0])
    assert [(step, folder) for step, folder in committed(back) if step != 2] == [
        (step, folder) for step, folder in committed(majority[0]) if step < 2 or step >= returned
    ]
    worlds = {step: read_manifest(Path(folder)).world_size for step, folder in committed(majority[0])}
    assert worlds == {t: 2 if 2 < t < returned else 3 for t in expected}, worlds
    for name, value in replay(sizes).items():
        np.testing.assert_allclose(back["params"][name], value, rtol=2e-5, atol=1e-6)
        for other in majority:
            np.testing.assert_array_equal(other["params"][name], back["params"][name])

    restart = tmp_path / "restart"
    restart.mkdir()
    shutil.copytree(tmp_path / "checkpoints", restart / "checkpoints")
    restarted = run_members(restart, "train", 3, {}, 3, 3, 2, env={"FT_RESTORE": "1"}, timeout=120)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in restarted)
    assert [r.returncode for r in restarted] == [0, 0, 0], outputs
    for member in restarted:
        for name, value in back["params"].items():
            np.testing.assert_array_equal(member.value["first_params"][name], value)
    sizes |= {len(sizes) + s["transaction"]: s["size"] for s in restarted[0].value["steps"]}
    for name, value in replay(sizes).items():
        np.testing.assert_allclose(restarted[0].value["params"][name], value, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm", STATEFUL_PER_STEP, ids=lambda algorithm: algorithm.partition(" ")[0])
def test_a_member_taken_for_dead_joins_again_under_each_per_step_algorithm(tmp_path: Path, algorithm: str):
    # As above, with the algorithms whose state a change of members touches: ByteGrad's and the compressed Adams'
    # residuals laid out per rank (reset, and their steps compiled for another world size), PowerSGD's Q and the Adams'
    # moments (kept, and given to the member joining again). All three end bit-identical, having trained.
    env = {"FT_ALGORITHM": algorithm, **(POWERSGD_MODEL if algorithm == POWERSGD else {})}
    results = run_members(tmp_path, "train", 3, {3: (2, "pause")}, 3, 3, 8, timeout=180, env=env)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [0, 0, 0], outputs
    first, second, back = (r.value for r in results)
    sizes = {s["transaction"]: s["size"] for s in first["steps"]}
    assert sizes[3] == 2 and sizes[max(sizes)] == 3, sizes  # step 3 retried by the two, then three again
    assert len(back["recoveries"]) == 1 and back["steps"][-1]["transaction"] == max(sizes), back["recoveries"]
    for member in (second, back):
        for name, value in first["params"].items():
            np.testing.assert_array_equal(member["params"][name], value)  # bit-identical
    x, y = dataset()
    loss = np.mean((prediction(first["params"], x) - y) ** 2)
    assert loss < 0.5 * np.mean(y**2), loss  # it trained: below half the loss of the zero parameters it started at


def test_a_joiner_takes_its_first_step_weighed_out_while_its_state_arrives(tmp_path: Path):
    # Two members, then a joiner whose state the holder starts sending 3 s late: the members train the next step on
    # their own samples without waiting for it (under CI's load their step took 0.5 s: the joiner's start-up); the
    # joiner sends zeros in it, keeps the members' average and applies it to the state once it arrived.
    delay = 3.0
    results = run_members(tmp_path, "train", 3, {}, 2, 3, 5, env={"FT_STATE_DELAY": str(delay)}, timeout=180)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [0, 0, 0], outputs
    holder, other, joiner = (r.value for r in results)
    sizes = {s["transaction"]: s["size"] for s in holder["steps"]}
    first = joiner["steps"][0]["transaction"]
    assert sizes[first] == 2 and all(sizes[t] == 3 for t in sizes if t > first), sizes  # weighed out of `first`
    for name, value in replay(sizes).items():
        np.testing.assert_allclose(joiner["params"][name], value, rtol=2e-5, atol=1e-6)
        for member in (holder, other):
            np.testing.assert_array_equal(member["params"][name], joiner["params"][name])  # bit-identical
    for member in (holder, other):  # the members' step did not wait for the state
        step = next(s for s in member["steps"] if s["transaction"] == first)
        assert step["end"] - step["start"] < delay / 2, step
    assert joiner["steps"][0]["end"] - joiner["admitted"] > delay  # its step was applied to the state, once there


@pytest.mark.parametrize(
    "algorithm", ["gradient_allreduce", *STATEFUL_PER_STEP], ids=lambda algorithm: algorithm.partition(" ")[0]
)
def test_each_per_step_algorithm_survives_a_kill_and_admits_a_joiner(tmp_path: Path, algorithm: str):
    # Three members; the last is SIGKILLed in step 3, a joiner is admitted once it committed. ByteGrad's and the
    # compressed Adams' layouts follow the world size (compiled again at each change); their state has per-rank
    # residuals (reset), QAdam's and 1-bit Adam's moments and PowerSGD's step and Q (kept, and given to the joiner).
    # Gradient allreduce's and PowerSGD's joiners take their first step weighed out.
    weighs_out = algorithm == "gradient_allreduce" or algorithm.startswith("powersgd")
    env = {"FT_ALGORITHM": algorithm, **(LARGE_STEP if algorithm == "gradient_allreduce" else {})}
    if algorithm == POWERSGD:
        env.update(POWERSGD_MODEL)
    results = run_members(tmp_path, "train", 4, {3: (2, "kill")}, 3, 3, 8, env=env)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert results[2].returncode != 0 and all(results[r].returncode == 0 for r in (0, 1, 3)), outputs
    survivors, joiner = [results[0].value, results[1].value], results[3].value
    sizes: dict[int, int] = {}
    for seen in (*survivors, joiner):
        for step in seen["steps"]:
            assert sizes.setdefault(step["transaction"], step["size"]) == step["size"], sizes
    assert [sizes[t] for t in range(1, 5)] == [3, 3, 2, 2] and sizes[max(sizes)] == 3, sizes
    retried = [a for a in survivors[0]["attempts"] if a["transaction"] == 3]
    assert len(retried) == 2 and "committed" not in retried[0], retried  # one step lost, retried once
    assert joiner["steps"][0]["transaction"] > 3
    for seen in (survivors[1], joiner):  # the replica checks passed on the way; the ends agree bit for bit
        for name, value in survivors[0]["params"].items():
            np.testing.assert_array_equal(seen["params"][name], value)
    x, y = dataset()
    loss = np.mean((prediction(survivors[0]["params"], x) - y) ** 2)
    assert loss < 0.5 * np.mean(y**2), loss  # it trained: below half the loss of the zero parameters it started at
    if algorithm.startswith("powersgd"):
        assert np.any(survivors[0]["params"]["mlp_in"] != mlp_params(32)["mlp_in"])  # the compressed matrix trained
    if weighs_out:  # the survivors alone trained the joiner's first step; every step, compiled once, ran on every size
        assert sizes[joiner["steps"][0]["transaction"]] == 2, (joiner["steps"][0], sizes)
        compiled_once = {"jit(_rank_step)": 1, "jit(_averaged)": 2, "jit(_applied)": 1}
        for seen in (*survivors, joiner):
            assert step_compilations(seen) == compiled_once, seen["compilations"]
        assert all(when < joiner["admitted"] for when, name, *_ in joiner["compilations"] if name in STEP_FUNCTIONS)


DECENTRALIZED = 'decentralized {"peer_selection_mode": "shift_one"}'


def replay_decentralized(
    records: dict[int, dict],
    start: tuple[np.ndarray, float] = (np.zeros(FEATURES), 0.0),
    position: DataPosition | None = None,
    rounds_before: int = 0,
    interval: int = 1,
) -> dict[int, tuple[np.ndarray, float]]:
    """Each process's parameters (w, b) after the committed steps of decentralized SGD with shift_one, in float64:
    every rank steps from the average of its own and its round's peer's weights (of every rank's, while their number
    is odd), by its own gradient at its own weights. The ranks of each step are the processes' records (a rank no
    record has is the lost member's); a process first seen in a step, or seen again after steps it missed (a member
    taken for dead), starts from that step's rank 0's weights, or ``start`` in the first step. A step some members sat
    out (a joiner's first) is trained by the others from their own weights, without averaging, and the joiner starts
    from rank 0's weights before it; so is a step a process took by itself, one behind the others at a change (its
    exchange failed where theirs completed). A job restarted from a
    checkpoint passes its ``position`` and the steps it had taken, ``rounds_before`` (the pairs' schedule goes on from
    there). Exchanging every ``interval`` steps, the steps between train each rank's own weights."""
    x, y = (a.astype(np.float64) for a in dataset())
    places: dict[int, dict[int, int]] = {}
    sizes: dict[int, int] = {}
    sat_out: set[int] = set()
    alone: set[tuple[int, int]] = set()  # (step, process)
    for process, record in records.items():
        for step in record["steps"]:
            places.setdefault(step["transaction"], {})[step["rank"]] = process
            sizes[step["transaction"]] = step["size"]
            if step["members"] > step["size"]:
                sat_out.add(step["transaction"])
            if step["alone"]:
                alone.add((step["transaction"], process))
    params: dict[int, tuple[np.ndarray, float]] = {}
    entering = params  # the weights a process first seen starts from (rank 0's), before a step a joiner sat out
    position = position or DataPosition(SAMPLES, BATCH_PER_RANK, seed=3)
    for t in sorted(sizes):
        n = sizes[t]
        for process in set(places[t].values()) - set(places.get(t - 1, {}).values()):
            params.pop(process, None)  # back after steps it missed: its own weights are stale
        ranks = [places[t].get(r, -1) for r in range(n)]
        for process in ranks:
            params.setdefault(process, entering.get(ranks[0], start))
        entering = dict(params) if t in sat_out else params
        for process in places[t].values():  # one sitting t out holds rank 0's weights from before it
            params.setdefault(process, entering.get(ranks[0], start))
        peers = shift_one_schedule(n)[(rounds_before + (t - 1) // interval) % (n // 2)] if n % 2 == 0 else None
        stepped = {}
        for r, process in enumerate(ranks):
            w, b = params[process]
            i = position.indices(r, n)
            error = x[i] @ w + b - y[i]
            if t in sat_out or (t, process) in alone or (t - 1) % interval:
                group = [process]
            else:
                group = ranks if peers is None else [process, ranks[peers[r]]]
            average_w = np.mean([params[q][0] for q in group], axis=0)
            average_b = np.mean([params[q][1] for q in group])
            stepped[process] = (average_w - LR * 2 * x[i].T @ error / len(i), average_b - LR * 2 * error.mean())
        params.update(stepped)
        position.advance(n)
    return params


def four_members_lose_one_then_admit_one(tmp_path: Path, algorithm: str) -> dict[int, dict]:
    """The records (by process) of four members training ``algorithm`` whose last is SIGKILLed in step 3, and of the
    process that joins the three survivors; checked to have ended with four members, the step the kill interrupted
    lost once (retried by the three) unless a survivor applied it (its exchange completed first): then it counts, and
    each survivor whose own exchange failed took it by itself, one behind the others."""
    results = run_members(tmp_path, "train", 5, {3: (3, "kill")}, 4, 4, 8, env={"FT_ALGORITHM": algorithm})
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode == 0 for r in results] == [True, True, True, False, True], outputs
    records = {r.rank: r.value for r in results if r.rank != 3}
    sizes = {s["transaction"]: s["size"] for s in records[0]["steps"]}
    alone = {p for p in range(3) if any(s["alone"] for s in records[p]["steps"])}
    applied = {  # with the four: its attempt in the epoch of four ended with step 3 committed, not taken by itself
        p
        for p in range(3)
        for a in records[p]["attempts"]
        if (a["transaction"], a["size"], a.get("committed"), a.get("alone")) == (3, 4, 3, False)
    }
    assert not alone or applied, (alone, applied)  # one took it by itself only where another applied it
    assert [sizes[t] for t in range(1, 5)] == [4, 4, 4 if applied else 3, 3], sizes
    assert records[0]["steps"][-1]["members"] == 4, records[0]["steps"][-1]
    for process in range(3):  # step 3 attempted once where taken (by itself or not), else retried once
        tried = [a for a in records[process]["attempts"] if a["transaction"] == 3]
        assert len(tried) == (1 if applied else 2) and "committed" in tried[-1], tried
    for process, record in records.items():  # each compiled its step once in the loop, the sizes after ahead
        in_loop = [c for c in record["compilations"] if c[1] == "jit(_rank_step)" and c[3] == "MainThread"]
        assert len(in_loop) == 1, record["compilations"]
        if process == 4:  # the joiner: for the job's size with it, before it asked
            assert in_loop[0][0] < record["admitted"], (in_loop, record["admitted"])
    return records


def test_decentralized_survivors_of_a_kill_average_over_all_while_odd_and_a_joiner_starts_from_a_member(
    tmp_path: Path,
):
    # Four members pair their weights (shift_one); the last is SIGKILLed in step 3, while its peer waits in their
    # exchange and the other pair's completed: that pair applied the step (voted one ahead: step 2 had every vote),
    # the peer takes it by itself, one behind them, and the three go on from step 4, averaging over all three (an odd
    # number to pair); a joiner is then admitted with the first member's weights and the pairs start again. Every
    # rank's weights drift their own way, each as the float64 replay of its own steps says, and only the step is
    # compared across the members.
    records = four_members_lose_one_then_admit_one(tmp_path, DECENTRALIZED)
    alone = [p for p, record in records.items() if any(s["alone"] for s in record["steps"])]
    assert alone == [shift_one_schedule(4)[(3 - 1) % 2][3]], alone  # the victim's peer in step 3
    replayed = replay_decentralized(records)
    for process, record in records.items():
        np.testing.assert_allclose(record["params"]["w"], replayed[process][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(record["params"]["b"], replayed[process][1], rtol=1e-5, atol=1e-6)
    assert len({records[p]["params"]["w"].tobytes() for p in records}) == len(records)  # each drifted its own way


def test_asynchronous_averaging_survives_a_kill_with_a_member_one_behind_and_admits_a_joiner(tmp_path: Path):
    # Four members average their weights in the background every 10 ms after a 2-step warm-up (a gradient allreduce
    # each step, every vote awaited). After it their steps exchange nothing and vote one ahead. Member 1 votes for step
    # 3 only once the epoch closed; the others apply it (every vote for step 2 is in) and member 3 is SIGKILLed as
    # step 4 starts. Members 0 and 2 retry step 4 among the three; member 1, one step behind them, takes step 3 by
    # itself, as it computed it, the round its thread may have finished meanwhile dropped. The rounds start again over
    # the three, then over the four once a joiner is admitted with the first member's state (the members wait for it),
    # and every member, the joiner too, completes rounds in the last epoch. The replicas' check (after each change and
    # every second step) compares the step and the data position only: the weights are each member's own.
    env = {"FT_ALGORITHM": 'async {"sync_interval_ms": 10, "warmup_steps": 2}', "FT_STEP_SECONDS": "0.05"}
    results = run_members(tmp_path, "train", 5, {4: (3, "kill")}, 4, 4, 12, (1, 3), env=env, timeout=180)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode == 0 for r in results] == [True, True, True, False, True], outputs
    records = {r.rank: r.value for r in results if r.rank != 3}
    alone = {p: [s["transaction"] for s in record["steps"] if s["alone"]] for p, record in records.items()}
    assert alone == {0: [], 1: [3], 2: [], 4: []}, alone
    for process in (0, 2):  # step 4 failed with the four and was retried by the three
        tried = [(a["size"], "committed" in a) for a in records[process]["attempts"] if a["transaction"] == 4]
        assert tried == [(4, False), (3, True)], (process, tried)
    (recovery, admission) = records[1]["recoveries"]
    assert (recovery["size"], recovery["caught_up"], admission["size"]) == (3, True, 4), records[1]["recoveries"]
    assert [s["transaction"] for s in records[1]["steps"]][:4] == [1, 2, 3, 4], records[1]["steps"]
    assert all(record["rounds"] > 0 for record in records.values()), {p: r["rounds"] for p, r in records.items()}
    for process in (0, 1, 2):  # the rounds' functions for 3 and 4 members were compiled ahead, not in the changes
        threads = [thread for _, name, _, thread in records[process]["compilations"] if name == "jit(correct)"]
        assert threads[0] == "MainThread" and all(t.startswith("bagua-ft-compile") for t in threads[1:]), threads
    last = {p: (record["steps"][-1]["transaction"], record["steps"][-1]["members"]) for p, record in records.items()}
    assert set(last.values()) == {(last[0][0], 4)}, last
    final = {p: record["params"]["w"].tobytes() for p, record in records.items()}
    assert len(set(final.values())) == len(final)  # each member's own weights


def test_asynchronous_averaging_rounds_failed_by_a_member_that_left_early_are_a_recovery_not_an_error(tmp_path: Path):
    # After a 2-step warm-up the steps exchange nothing. Member 3 leaves the job once its vote for step 5 returned
    # applied (its membership closed, the job not finished, as a program that skips finished() at its end does) and
    # its process ends, its averaging thread with it. A member that leaves is no failure to the membership, and the
    # steps exchange nothing (nor do the replicas' checks, only after a change here): the first to see it gone are the
    # others' averaging threads, whose next round fails on its closed sockets. The thread fails the epoch at once, or
    # the round's error does as a member applies a committed step: else the members would wait for its vote for step 6
    # until the test's timeout. The three recover from the step they applied, losing none (one still making its batch
    # for step 6 when another applied it is given the state), and average again in the new epoch.
    env = {"FT_ALGORITHM": 'async {"sync_interval_ms": 10, "warmup_steps": 2}', "FT_STEP_SECONDS": "0.05"}
    env["FT_HASH_EVERY"] = "0"
    results = run_members(tmp_path, "train", 4, {5: (3, "leave-after-vote")}, 4, 3, 10, env=env, timeout=120)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [0, 0, 0, 0], outputs
    for process, record in ((r.rank, r.value) for r in results if r.rank != 3):
        assert [r["size"] for r in record["recoveries"]] == [3], (process, record["recoveries"])
        steps = [(s["transaction"], s["members"]) for s in record["steps"]]
        assert steps[:5] == [(t, 4) for t in range(1, 6)] and steps[-1] == (10, 3), (process, steps)
        transactions = [t for t, _ in steps]
        assert transactions == sorted(set(transactions)) and len(transactions) >= 9, (process, steps)
        assert record["rounds"] > 0, process


@pytest.mark.parametrize("engine", ["tcp", "mpi"])
def test_a_decentralized_member_one_behind_before_its_step_began_is_given_the_state(tmp_path: Path, engine: str):
    # Exchanging every third step (steps 1, 4, 7), the steps between vote one ahead and exchange nothing: the others
    # apply step 5 while member 2 has not begun it (it makes its batch, slowly), and member 3 is killed as step 6
    # starts (the replicas, checked every second step, are not checked in between: a check would wait for member 2).
    # The survivors wait for member 2 in their rebuild (TCP) or their meeting before the shrink (MPI) past the 3-s
    # timeout, fail that epoch and take the next one, with member 2 in it. Member 2 is one step behind the others
    # and its join record says it cannot take that step by itself (it had no batch): it is given the first member's
    # weights at step 5 and sits out step 6 while they travel, taking no step alone. Every rank's weights are the
    # float64 replay's of its own steps.
    algorithm = 'decentralized {"peer_selection_mode": "shift_one", "communication_interval": 3}'
    env = {"FT_ALGORITHM": algorithm, "FT_COMM_TIMEOUT": "3"}
    faults = {5: (2, "slow"), 6: (3, "kill")}
    results = run_members(tmp_path, "train", 4, faults, 4, 3, 8, env=env, timeout=180, engine=engine)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode == 0 for r in results] == [True, True, True, False], outputs
    records = {r.rank: r.value for r in results if r.rank != 3}
    for process, record in records.items():
        (recovery,) = record["recoveries"]
        assert (recovery["size"], recovery["caught_up"]) == (3, False), (process, record["recoveries"])
        assert not any(s["alone"] for s in record["steps"]), process
    behind = records[2]["steps"]
    assert [(s["transaction"], s["size"], s["members"]) for s in behind[4:6]] == [(6, 2, 3), (7, 3, 3)], behind
    replayed = replay_decentralized(records, interval=3)
    for process, record in records.items():
        np.testing.assert_allclose(record["params"]["w"], replayed[process][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(record["params"]["b"], replayed[process][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm", [DECENTRALIZED, "low_precision_decentralized"], ids=["decentralized", "low"])
def test_a_decentralized_joiner_sits_out_one_step_while_its_state_travels_and_its_peers_do_not_wait(
    tmp_path: Path, algorithm: str
):
    # Three members pair their weights (shift_one; over all three while odd), or mix them on the low-precision ring.
    # The holder starts sending a joiner's state 2 s late (a slow link) and the members' step after the admission
    # computes 2 s longer. They train that step on all its samples without exchanging weights (the joiner has none to
    # exchange yet) while the state travels, so it ends about 2 s after the step before (2.5 s here), not 4 (the
    # transfer, then the step: 4.2 s when the holder waits for its transfer first). The joiner votes for it, its state
    # one step on, and trains from the next step on the ring of four: decentralized, every rank's weights are the
    # float64 replay's of its own steps; low precision, every copy of a neighbour's weights is that neighbour's own at
    # the end (restarted by all four at the start of the step after the one the joiner sat out).
    delay = 2.0
    env = {"FT_ALGORITHM": algorithm, "FT_STATE_DELAY": str(delay), "FT_ADMITTING_STEP_SECONDS": str(delay)}
    results = run_members(tmp_path, "train", 4, {}, 3, 4, 6, env=env, timeout=180)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [0, 0, 0, 0], outputs
    records = {r.rank: r.value for r in results}
    sat_out, trained = records[3]["steps"][:2]  # its first step's result: its state's loss on the first one's samples
    assert (sat_out["size"], sat_out["members"], trained["size"]) == (3, 4, 4), records[3]["steps"]
    t = sat_out["transaction"]
    assert sat_out["indices"] == next(s["indices"] for s in records[0]["steps"] if s["transaction"] == t)
    for member in (0, 1, 2):  # their first step with the joiner a member: the one it sat out, not waited for
        steps = records[member]["steps"]
        admitting = next(i for i, step in enumerate(steps) if step["members"] == 4)
        before, members_step = steps[admitting - 1], steps[admitting]
        assert members_step["end"] - before["end"] < 2 * delay - 0.5, (before, members_step)
        assert (members_step["transaction"], members_step["size"]) == (sat_out["transaction"], 3), members_step
    if algorithm == "low_precision_decentralized":
        assert_ring_copies_are_the_neighbours_weights(records.values())
        return
    before = {p: {**r, "steps": [s for s in r["steps"] if s["transaction"] < t]} for p, r in records.items()}
    w, b = replay_decentralized(before)[0]  # the first member's weights as it was admitted
    x, y = (a.astype(np.float64) for a in dataset())
    i = np.asarray(sat_out["indices"])
    np.testing.assert_allclose(sat_out["loss"], np.mean((x[i] @ w + b - y[i]) ** 2), rtol=1e-5)
    replayed = replay_decentralized(records)
    for process, record in records.items():
        np.testing.assert_allclose(record["params"]["w"], replayed[process][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(record["params"]["b"], replayed[process][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm", [DECENTRALIZED, "low_precision_decentralized"], ids=["decentralized", "low"])
def test_a_partitioned_decentralized_member_returns_with_a_members_weights(tmp_path: Path, network, algorithm: str):
    # Decentralized weights drift, so no hash can tell a member back from a partition that its own are stale. Member
    # 0, the coordinator, loses its link in step 3 past dead_after (each member in its own network namespace); the
    # other two go on as a pair. Back, it joins again as a new member: it sits out one step and starts from the first
    # member's weights, not the ones it kept. Every rank's weights are the float64 replay's of its own steps; low
    # precision, every copy of a neighbour's weights is that neighbour's own at the end.
    env = {"FT_ALGORITHM": algorithm}
    results = run_members(tmp_path, "train", 3, {3: (0, "partition")}, 3, 3, 8, env=env, timeout=180, network=network)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [0, 0, 0], outputs
    records = {r.rank: r.value for r in results}
    back = records[0]["steps"]
    assert [s["transaction"] for s in back[:2]] == [1, 2], back  # then nothing alone
    sat_out = back[2]
    assert sat_out["transaction"] > 3 and (sat_out["size"], sat_out["members"]) == (2, 3), back
    if algorithm == "low_precision_decentralized":
        assert_ring_copies_are_the_neighbours_weights(records.values())
        return
    replayed = replay_decentralized(records)
    for process, record in records.items():
        np.testing.assert_allclose(record["params"]["w"], replayed[process][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(record["params"]["b"], replayed[process][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["gradient_allreduce", POWERSGD], ids=lambda a: a.partition(" ")[0])
def test_a_joiner_whose_state_holder_dies_before_sending_is_given_the_state_by_the_next_one(
    tmp_path: Path, algorithm: str
):
    # Three members, then a joiner weighed out of its first step; the holder is SIGKILLed a second into the admission,
    # before it sent the state. The joiner's wait for it gives up when the survivors close the epoch, and the next
    # epoch's holder sends it (under PowerSGD, its step count and Q first, again): the three end bit-identical, as the
    # replay of the committed steps (gradient allreduce).
    env = {"FT_STATE_DELAY": "1", "FT_STATE_HOLDER_DIES": "1", "FT_ALGORITHM": algorithm}
    env.update(LARGE_STEP if algorithm == "gradient_allreduce" else POWERSGD_MODEL)
    results = run_members(tmp_path, "train", 4, {}, 3, 3, 8, env=env, timeout=180)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode == 0 for r in results] == [False, True, True, True], outputs
    assert (tmp_path / "holder-died").exists()
    survivor, other, joiner = (r.value for r in results[1:])
    sizes = {s["transaction"]: s["size"] for s in survivor["steps"]}
    for name, value in survivor["params"].items():
        for member in (other, joiner):
            np.testing.assert_array_equal(member["params"][name], value)  # bit-identical
    if algorithm == "gradient_allreduce":
        for name, value in replay(sizes).items():
            np.testing.assert_allclose(joiner["params"][name], value, rtol=2e-5, atol=1e-6)
    assert [r["size"] for r in survivor["recoveries"]] == [4, 3], survivor["recoveries"]  # the admission, the death
    assert joiner["steps"][0]["size"] == 2, joiner["steps"]  # weighed out again, of the survivors' step


def test_low_precision_decentralized_copies_start_again_from_the_new_neighbours_after_a_kill_and_an_admission(
    tmp_path: Path,
):
    # Four members on a ring; the last is SIGKILLed in step 3 and the three survivors' copies of their neighbours'
    # weights start again from their new neighbours' (sent once in full precision); a joiner is then admitted with the
    # first member's state and every copy starts again on the ring of four. Each exchange adds the same decoded
    # difference to a copy as to the weights it copies, so a copy left from another ring would never match again: at
    # the end each member's left and right copies are, bit for bit, its neighbours' own.
    records = four_members_lose_one_then_admit_one(tmp_path, "low_precision_decentralized").values()
    assert_ring_copies_are_the_neighbours_weights(records)
    x, y = dataset()
    for record in records:
        loss = np.mean((prediction(record["params"], x) - y) ** 2)
        assert loss < 0.5 * np.mean(y**2), loss  # every member trained


def test_a_powersgd_job_restarted_from_its_checkpoint_admits_a_joiner_weighed_out_on_a_flax_train_state(
    tmp_path: Path,
):
    # Three members train PowerSGD (compressed from step 2) on a flax TrainState and save at the end. A job of two
    # restarts from that checkpoint and admits a third process after its first step: the joiner is given the restored
    # step count and Q first (its placeholder's would take the exact branch while the members take the compressed
    # one) and is weighed out of the members' next step; all three end bit-identical, each with a flax TrainState.
    env = {"FT_ALGORITHM": POWERSGD, "FT_FLAX": "1", **POWERSGD_MODEL}
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    results = run_members(first, "train", 3, {}, 3, 3, 4, env=env)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [0, 0, 0], outputs
    saved = results[0].value["params"]
    second.mkdir()
    shutil.copytree(first / "checkpoints", second / "checkpoints")
    results = run_members(second, "train", 3, {}, 2, 3, 6, env={**env, "FT_RESTORE": "1"})
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [0, 0, 0], outputs
    *members, joiner = (r.value for r in results)
    for member in members:  # restored into two members as saved by three
        for name, value in saved.items():
            np.testing.assert_array_equal(member["first_params"][name], value)
    sizes = {s["transaction"]: s["size"] for s in members[0]["steps"]}
    assert sizes[joiner["steps"][0]["transaction"]] == 2, (joiner["steps"][0], sizes)  # weighed out
    assert [r["state_class"] for r in (*members, joiner)] == ["flax.training.train_state.TrainState"] * 3
    for seen in (members[1], joiner):
        for name, value in members[0]["params"].items():
            np.testing.assert_array_equal(seen["params"][name], value)
    assert np.any(members[0]["params"]["mlp_in"] != saved["mlp_in"])  # the compressed matrix trained on
    x, y = dataset()
    loss = np.mean((prediction(members[0]["params"], x) - y) ** 2)
    assert loss < 0.5 * np.mean(y**2), loss


def test_a_decentralized_job_restarted_from_its_checkpoint_starts_from_the_mean_and_admits_a_joiner_on_flax(
    tmp_path: Path,
):
    # Four members pair their weights (shift_one) on a flax TrainState, drift apart and save. A job of three restarts
    # from that checkpoint: each member starts from the mean of the four saved weights (drifted parameters' rule), the
    # data from the position saved, and averages over all three (an odd number to pair); a process admitted after
    # its first step starts from the first member's weights and the pairs start again, going on with the schedule's
    # round where the saved steps left it. Every member's weights end as the float64 replay of its own steps says,
    # each its own, each in a flax TrainState.
    env = {"FT_ALGORITHM": DECENTRALIZED, "FT_FLAX": "1"}
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    results = run_members(first, "train", 4, {}, 4, 4, 3, env=env)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [0, 0, 0, 0], outputs
    saved = {r.rank: r.value for r in results}
    np.testing.assert_allclose(saved[0]["params"]["w"], replay_decentralized(saved)[0][0], rtol=1e-5, atol=1e-6)
    assert len({record["params"]["w"].tobytes() for record in saved.values()}) == 4  # each drifted its own way
    second.mkdir()
    shutil.copytree(first / "checkpoints", second / "checkpoints")
    results = run_members(second, "train", 4, {}, 3, 4, 4, env={**env, "FT_RESTORE": "1"})
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [0, 0, 0, 0], outputs
    records = {r.rank: r.value for r in results}
    mean = {name: np.mean([saved[p]["params"][name] for p in saved], axis=0) for name in ("w", "b")}
    for process in range(3):  # restored into three members as saved by four
        for name, value in mean.items():
            np.testing.assert_allclose(records[process]["first_params"][name], value, rtol=1e-6, atol=1e-7)
    sizes = {s["transaction"]: s["size"] for s in records[0]["steps"]}
    assert sizes[1] == 3 and records[0]["steps"][-1]["members"] == 4 and records[3]["steps"][0]["transaction"] > 1
    saved_sizes = {s["transaction"]: s["size"] for s in saved[0]["steps"]}
    start = (mean["w"].astype(np.float64), float(mean["b"]))
    replayed = replay_decentralized(records, start, replayed_position(saved_sizes), rounds_before=len(saved_sizes))
    for process, record in records.items():
        np.testing.assert_allclose(record["params"]["w"], replayed[process][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(record["params"]["b"], replayed[process][1], rtol=1e-5, atol=1e-6)
        assert record["state_class"] == "flax.training.train_state.TrainState"
    assert len({records[p]["params"]["w"].tobytes() for p in records}) == 4  # each drifted its own way again


def test_a_member_lost_while_the_survivors_shrink_the_communicator_stops_them_naming_it(tmp_path: Path):
    # Rank 3 is killed in step 3; rank 2 dies inside the survivors' shrink to ranks 0-2. MPI cannot tell a dead peer,
    # and MPICH can neither abandon the pending shrink nor build another communicator past it: the others wait for
    # the communicator's timeout (5 s here), then stop with an error that names the shrink, instead of hanging.
    timeout = 5
    env = {"FT_KILL_IN_SHRINK": "2", "FT_COMM_TIMEOUT": str(timeout)}
    started = time.monotonic()
    results = run_members(tmp_path, "train", 4, {3: (3, "kill")}, 4, 2, 6, env=env, timeout=120, engine="mpi")
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert all(r.returncode not in (0, None) for r in results), outputs
    for survivor in results[:2]:
        assert f"MPI shrink of communicator 'world' to 'world' did not complete within {timeout} s" in survivor.output
    assert time.monotonic() - started < 60, outputs


@pytest.mark.parametrize(
    ("engine", "where"), [("tcp", "start"), ("tcp", "connect"), ("mpi", "meeting")], ids=lambda p: p
)
def test_a_member_lost_while_the_survivors_rebuild_the_communicator_costs_them_one_more_epoch(
    tmp_path: Path, engine: str, where: str
):
    # Rank 3 is killed in step 3; rank 2 dies in the survivors' rebuild of the communicator for ranks 0-2. Over TCP:
    # before it published its address (the others wait for it in the store), or as it would connect (rank 1 waits
    # for its connection, and it never connects to rank 0 or 1); over MPI, before it arrived at the survivors'
    # meeting in the store, which comes before their shrink. Its death closes that epoch, which abandons the build
    # (the meeting); ranks 0 and 1 take the next epoch and go on, long before the communicator's timeout (60 s here).
    env = {"FT_KILL_IN_REBUILD": f"2:{where}", "FT_COMM_TIMEOUT": "60"}
    results = run_members(tmp_path, "train", 4, {3: (3, "kill")}, 4, 2, 6, env=env, timeout=120, engine=engine)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode == 0 for r in results] == [True, True, False, False], outputs
    first, second = (r.value for r in results[:2])
    sizes = {s["transaction"]: s["size"] for s in first["steps"]}
    assert sizes == {s["transaction"]: s["size"] for s in second["steps"]}, outputs
    assert [sizes[t] for t in sorted(sizes)] == [4, 4] + [2] * (len(sizes) - 2), sizes
    for name, value in replay(sizes).items():
        np.testing.assert_allclose(first["params"][name], value, rtol=2e-5, atol=1e-6)
        np.testing.assert_array_equal(second["params"][name], first["params"][name])  # bit-identical
    retried = [a for a in first["attempts"] if a["transaction"] == 3]
    assert len(retried) == 2 and "committed" not in retried[0], retried  # one step lost
    resume = retried[1]["start"] - float((tmp_path / "fault-time-3").read_text())
    assert resume < 15, resume  # not the communicator's timeout
    [recovery] = first["recoveries"]  # one recovery, through two epochs: the one rank 2 died in, and the next
    assert recovery["size"] == 2 and recovery["epoch"] == retried[0]["epoch"] + 2, first["recoveries"]
    print(f"death in the rebuild ({engine}, {where}): the survivors resumed {resume:.2f} s after the first death")


@pytest.mark.parametrize(
    ("engine", "victim", "where"),
    [
        ("mpi", "member", "meeting"),
        ("mpi", "joiner", "meeting"),
        ("mpi", "joiner", "connect"),
        ("tcp", "member", "start"),
    ],
)
def test_a_death_during_a_joiners_admission_costs_one_more_epoch_and_the_joiner_trains_in_it(
    tmp_path: Path, engine: str, victim: str, where: str
):
    # member: four members, the joiner asking in step 3, in which member 3 is SIGKILLed: the survivors' recovery
    # admits it, and member 2 dies there, before it arrived at the members' meeting (MPI) or published its address
    # (TCP). joiner: three members admit the joiner after step 1, and it dies before it arrived at the meeting, or
    # after it, as it would connect to the group's port. Either death closes the admitting epoch; the others take the
    # next one. Over MPI the joiner waited for the group's port under the failed epoch, past the communicator's
    # timeout (60 s here), and the others' grow waited for it in vain; and a joiner dead before it connected left the
    # others' accept waiting until the timeout, where it failed and stopped them.
    if victim == "member":
        env, faults, start, final = (
            {"FT_KILL_IN_REBUILD": f"2:{where}", "FT_START_JOINER_AFTER": "2"},
            {3: (3, "kill-once-asked")},
            4,
            3,
        )
        expected = [True, True, False, False, True]
    else:
        env, faults, start, final = {"FT_KILL_IN_REBUILD": f"3:{where}", "FT_START_JOINER_AFTER": "1"}, {}, 3, 3
        expected = [True, True, True, False]
    env["FT_COMM_TIMEOUT"] = "60"
    started = time.monotonic()
    results = run_members(tmp_path, "train", start + 1, faults, start, final, 6, env=env, timeout=150, engine=engine)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode == 0 for r in results] == expected, outputs
    trained = [r.value for r in results if r.returncode == 0]
    first = trained[0]
    admitting = int((tmp_path / "admitting-epoch").read_text())
    [failed] = [a for a in first["attempts"] if "committed" not in a]  # the step the admitting epoch was to train
    assert failed["epoch"] < admitting, (failed, admitting)
    assert [r["epoch"] for r in first["recoveries"]] == [admitting + 1], first["recoveries"]  # through two epochs
    sizes = {s["transaction"]: s["size"] for s in first["steps"]}
    for seen in trained[1:]:  # the joiner's from its first step on
        theirs = {s["transaction"]: s["size"] for s in seen["steps"]}
        assert theirs == {t: sizes[t] for t in theirs}, (theirs, sizes)
    if victim == "member":  # the joiner weighed out of its first step, in the epoch after the one that admitted it
        joiner = trained[-1]
        assert joiner["steps"][0]["transaction"] == 3 and joiner["steps"][0]["epoch"] == admitting + 1, joiner["steps"]
        assert [sizes[t] for t in sorted(sizes)] == [4, 4, 2] + [3] * (len(sizes) - 3), sizes
    else:
        assert set(sizes.values()) == {3}, sizes
    for name, value in replay(sizes).items():
        for seen in trained:
            np.testing.assert_allclose(seen["params"][name], value, rtol=2e-5, atol=1e-6)
            np.testing.assert_array_equal(seen["params"][name], first["params"][name])  # bit-identical
    assert time.monotonic() - started < 60, outputs  # no wait for the communicator's timeout


def test_a_member_lost_in_a_checkpoint_leaves_it_uncommitted_and_a_restart_goes_on_from_the_next_one(tmp_path: Path):
    results = run_members(tmp_path, "train_and_save", 3, 3, 4, 2, timeout=120)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode == 0 for r in results] == [True, True, False], outputs
    survivors = [r.value for r in results[:2]]
    sizes = {int(t): n for t, n in survivors[0]["sizes"].items()}
    assert sizes == {1: 3, 2: 3, 3: 2, 4: 2}, sizes
    assert [s["saved"][0] for s in survivors] == [None, None]  # the member died in it: not committed
    with pytest.raises(FileNotFoundError):
        read_manifest(tmp_path / "checkpoints" / "step_000000002")
    last = Path(survivors[0]["saved"][1])
    assert survivors[1]["saved"][1] == str(last) and read_manifest(last).world_size == 2
    reference = replay(sizes)
    for shard in read_state(last):
        for name, value in reference.items():
            np.testing.assert_allclose(shard[f".params['{name}']"], value, rtol=2e-5, atol=1e-6)
            np.testing.assert_array_equal(shard[f".params['{name}']"], survivors[0]["params"][name])

    # the whole job restarts from it with 3 ranks: the data goes on where the 2 survivors left it
    restarted = run_members(tmp_path, "train_and_save", 3, 3, 7, -1, True, timeout=120)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in restarted)
    assert [r.returncode for r in restarted] == [0, 0, 0], outputs
    sizes |= {int(t): n for t, n in restarted[0].value["sizes"].items()}
    assert sizes == {1: 3, 2: 3, 3: 2, 4: 2, 5: 3, 6: 3, 7: 3}, sizes
    for name, value in replay(sizes).items():
        np.testing.assert_allclose(restarted[0].value["params"][name], value, rtol=2e-5, atol=1e-6)
        for member in restarted[1:]:
            np.testing.assert_array_equal(member.value["params"][name], restarted[0].value["params"][name])
    assert read_manifest(checkpoint_to_restore(tmp_path / "checkpoints")).metadata["data_position"] == {
        "num_samples": SAMPLES,
        "seed": 3,
        **dict(zip(("epoch", "offset"), replayed_position(sizes).state())),
    }


def replay_diloco(sizes: dict[int, int], config: DiLoCoConfig) -> tuple[dict[str, np.ndarray], list[dict]]:
    """DiLoCo's round start and each rank's parameters after the steps ``sizes`` gives (each with the number of ranks
    that trained it on their partition), in float64: SGD inside, Nesterov SGD (0.7, 0.9) on the mean pseudo-gradient
    of each fragment due (fragment 0 is ``b``, 1 is ``w``: the leaves in tree order), taken when its exchange starts
    and averaged over the ranks that apply it ``fragment_sync_delay`` steps later (a rank lost meanwhile counts no
    more); a rank that appears takes rank 0's parameters (a joiner that sat out the round: the round start)."""
    x, y = (a.astype(np.float64) for a in dataset())
    start = {"w": np.zeros(FEATURES), "b": np.zeros(())}
    fragments = [["b", "w"]] if config.fragments == 1 else [["b"], ["w"]]
    momentum = {k: np.zeros_like(v) for k, v in start.items()}
    models = {0: dict(start)}
    pending: dict[str, list[np.ndarray]] = {}  # by parameter: each rank's pseudo-gradient, in rank order
    position = DataPosition(SAMPLES, BATCH_PER_RANK, seed=3)
    for t in range(1, len(sizes) + 1):
        n = sizes[t]
        models = {r: models[r] if r in models else dict(models[0]) for r in range(n)}
        for model, r in zip(models.values(), range(n)):
            i = position.indices(r, n)
            error = x[i] @ model["w"] + model["b"] - y[i]
            model["w"] = model["w"] - LR * 2 * x[i].T @ error / len(i)
            model["b"] = model["b"] - LR * 2 * error.mean()
        position.advance(n)
        for k in (k for p in config.exchanges_after(t) for k in fragments[p]):
            pending[k] = [start[k] - model[k] for model in models.values()]
        for k in (k for p in config.applies_after(t) for k in fragments[p]):
            delta = np.mean(pending.pop(k)[:n], axis=0)
            momentum[k] = delta + 0.9 * momentum[k]
            start[k] = start[k] - 0.7 * (delta + 0.9 * momentum[k])
            for model in models.values():
                model[k] = start[k]
    return start, list(models.values())


def test_a_diloco_job_restarted_from_its_checkpoints_trains_on_as_if_never_stopped(tmp_path: Path):
    # 2 members train 2 rounds of 2 steps and save after each; the whole job restarts from the last with 3, which
    # train on into the middle of their second round: the round start, the outer momentum and the data position
    # carry over (checked against a float64 replay of all 7 steps), each member's inner steps drift on its own
    first = run_members(tmp_path, "train_and_save", 2, 2, 4, -1, False, True, timeout=120)
    assert [r.returncode for r in first] == [0, 0], [r.output[-3000:] for r in first]
    assert first[0].value["saved"] == [str(checkpoint_dir(tmp_path / "checkpoints", s)) for s in (2, 4)]
    restarted = run_members(tmp_path, "train_and_save", 3, 3, 7, -1, True, True, timeout=120)
    assert [r.returncode for r in restarted] == [0, 0, 0], [r.output[-3000:] for r in restarted]
    sizes = {1: 2, 2: 2, 3: 2, 4: 2} | {int(t): n for t, n in restarted[0].value["sizes"].items()}
    assert sizes == {1: 2, 2: 2, 3: 2, 4: 2, 5: 3, 6: 3, 7: 3}, sizes
    start, models = replay_diloco(sizes, DiLoCoConfig(sync_every=2))
    for name in start:
        for rank, member in enumerate(restarted):
            np.testing.assert_allclose(member.value["round_start"][name], start[name], rtol=2e-5, atol=1e-6)
            np.testing.assert_allclose(member.value["params"][name], models[rank][name], rtol=2e-5, atol=1e-6)
            np.testing.assert_array_equal(member.value["round_start"][name], restarted[0].value["round_start"][name])
        assert not np.allclose(models[1][name], models[2][name])  # mid-round: the members' own parameters differ


@pytest.mark.parametrize(
    ("options", "tolerance"),  # 8-bit codes: the replay is float64 (observed 0.002 apart)
    [
        ({}, {"rtol": 2e-5, "atol": 1e-6}),
        ({"outer_exchange": "uint8", "error_feedback": True}, {"atol": 1e-2}),
        ({"fragments": 2, "outer_exchange": "uint8", "error_feedback": True}, {"atol": 1e-2}),
    ],
    ids=["diloco", "diloco-uint8", "streaming-uint8"],
)
def test_diloco_survivors_of_a_hang_mid_round_and_a_kill_in_an_exchange_lose_no_inner_step(
    tmp_path: Path, options: dict, tolerance: dict
):
    # Member 2 hangs at inner step 5 (found by its missed heartbeats): members 0 and 1 train on to the next exchange
    # (DiLoCo: step 8; Streaming, its second fragment: step 6), which fails there and is retried by the two. Member
    # 1 is killed in the exchange of step 12: member 0 retries it alone. A joiner starts then and is admitted after an
    # exchange; under DiLoCo it sits out the round (member 0 trains it alone) and joins its exchange contributing zero.
    config = DiLoCoConfig(sync_every=DILOCO_ROUND, **options)
    faults = {5: (2, "stop"), 12: (1, "kill")}
    noticed = next(t for t in range(5, 13) if config.exchanges_after(t))

    results = run_members(tmp_path, "train_diloco", 4, faults, 3, 2, 20, options, hung=faults[5][0])
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert results[0].returncode == 0 and results[3].returncode == 0, outputs
    assert results[1].returncode != 0 and results[2].returncode != 0, outputs
    survivor, joiner = results[0].value, results[3].value
    sizes = {s["step"]: s["trainers"] for s in survivor["steps"]}
    members = {s["step"]: s["size"] for s in survivor["steps"]}
    assert list(sizes) == list(range(1, len(sizes) + 1)), sizes  # every inner step done once: none lost
    assert [sizes[t] for t in range(1, 13)] == [3] * (noticed - 1) + [2] * (12 - noticed) + [1], sizes
    admitted_at = min(t for t in members if t > 12 and members[t] == 2)
    assert config.exchanges_after(admitted_at - 1), admitted_at  # admitted after an exchange
    assert all(members[t] == (1 if t < admitted_at else 2) for t in range(13, len(sizes) + 1)), members
    sits_out = config.fragments == 1
    first = min(s["step"] for s in joiner["steps"])
    trains_from = admitted_at + config.sync_every if sits_out else admitted_at
    if sits_out:  # it computed only the round's exchange step, on member 0's samples, weighed zero
        assert first == trains_from - 1 and [s["trainers"] for s in joiner["steps"]][:1] == [1], joiner["steps"]
    else:
        assert first == admitted_at
    assert all(sizes[t] == (1 if t < trains_from else 2) for t in range(13, len(sizes) + 1)), sizes
    failed = [a["step"] for a in survivor["attempts"] if "end" not in a]
    assert failed[:2] == [noticed, 12] and set(failed[2:]) <= {admitted_at}, failed  # only exchanges ran again
    exchanges = sum(bool(config.exchanges_after(t)) for t in sizes)
    assert survivor["committed"] == joiner["committed"] == exchanges
    position = DataPosition(SAMPLES, BATCH_PER_RANK, seed=3)
    expected = {}
    for t in range(1, len(sizes) + 1):
        expected[t] = [position.indices(r, sizes[t]).tolist() for r in range(sizes[t])]
        position.advance(sizes[t])
    for seen in (survivor, joiner):
        for step in seen["steps"]:
            assert step["indices"] == expected[step["step"]][step["rank"]], step
    start, models = replay_diloco(sizes, config)
    for name in start:
        np.testing.assert_allclose(survivor["round_start"][name], start[name], **tolerance)
        np.testing.assert_array_equal(joiner["round_start"][name], survivor["round_start"][name])  # bit-identical
        for seen in (survivor, joiner):  # Streaming's last step leaves its second fragment mid-round: each its own
            model = models[seen["steps"][-1]["rank"]]
            np.testing.assert_allclose(seen["params"][name], model[name], **tolerance)
    for fault_step, exchange in ((5, noticed), (12, 12)):
        tries = [a for a in survivor["attempts"] if a["step"] == exchange]
        resume = tries[1]["start"] - float((tmp_path / f"fault-time-{fault_step}").read_text())
        assert 0 < resume < 20, resume
        print(f"{faults[fault_step][1]} at step {fault_step}: the survivors' exchange ran again {resume:.2f} s later")


def test_a_diloco_member_lost_while_the_survivors_rebuild_costs_no_inner_step(tmp_path: Path):
    # Member 2 is killed in the exchange of step 8; member 1 dies in the rebuild that follows, as it would connect
    # (TCP). Member 0 takes the epoch after and runs the exchange again alone: no inner step runs twice, and its round
    # start is the replayed one.
    config = DiLoCoConfig(sync_every=DILOCO_ROUND)
    env = {"FT_KILL_IN_REBUILD": "1:connect"}
    results = run_members(tmp_path, "train_diloco", 3, {8: (2, "kill")}, 3, 1, 12, {}, env=env, timeout=120)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode == 0 for r in results] == [True, False, False], outputs
    survivor = results[0].value
    sizes = {s["step"]: s["trainers"] for s in survivor["steps"]}
    assert list(sizes) == list(range(1, len(sizes) + 1)), sizes  # every inner step done once: none lost
    assert [sizes[t] for t in sorted(sizes)] == [3] * 7 + [1] * (len(sizes) - 7), sizes
    assert [a["step"] for a in survivor["attempts"] if "end" not in a] == [8]  # only the exchange ran again
    [recovery] = survivor["recoveries"]  # through two epochs: the one member 1 died in, and the next
    assert recovery["size"] == 1, survivor["recoveries"]
    start, _ = replay_diloco(sizes, config)
    for name in start:
        np.testing.assert_allclose(survivor["round_start"][name], start[name], rtol=2e-5, atol=1e-6)


def test_a_diloco_member_taken_for_dead_mid_round_joins_again_and_sits_out_a_round(tmp_path: Path):
    # Member 2 is stopped at inner step 5 past dead_after, then goes on: the two others retried the round's exchange
    # (step 8) without it. It trains its own inner steps to that exchange, finds there that they went on, joins again
    # and sits out the round it is admitted into (contributing zero to its exchange), then trains with them.
    config = DiLoCoConfig(sync_every=DILOCO_ROUND)
    # On MPI: over TCP's ring sums the rejoined member's parameters after the last exchange came out 1 ulp off the
    # round start (its update is the round start minus its own parameters, added back), a DiLoCo rounding the MPI
    # engine's sums happen not to show here.
    results = run_members(tmp_path, "train_diloco", 3, {5: (2, "pause")}, 3, 3, 20, {}, timeout=180, engine="mpi")
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [0, 0, 0], outputs
    first, second, back = (r.value for r in results)
    sizes = {s["step"]: s["trainers"] for s in first["steps"]}
    members = {s["step"]: s["size"] for s in first["steps"]}
    assert list(sizes) == list(range(1, len(sizes) + 1)), sizes  # every inner step done once: none lost
    assert [sizes[t] for t in range(1, 9)] == [3] * 7 + [2], sizes  # the exchange of step 8 retried by the two
    admitted_at = min(t for t in members if t > 8 and members[t] == 3)
    trains_from = admitted_at + DILOCO_ROUND
    assert config.exchanges_after(admitted_at - 1) and trains_from <= len(sizes), (admitted_at, sizes)
    assert all(sizes[t] == (2 if t < trains_from else 3) for t in range(9, len(sizes) + 1)), sizes
    (again,) = back["recoveries"]  # its one recovery: the epoch that admitted it again
    back_steps = [s for s in back["steps"] if s["epoch"] >= again["epoch"]]
    # Its first step back is the exchange of the round it sits out, on the first member's samples, weighed zero
    # (recorded under the step it was at when it called: the rejoin happened inside that call).
    assert (back_steps[0]["trainers"], back_steps[0]["rank"]) == (2, 0), back_steps
    assert [s["step"] for s in back_steps[1:]] == list(range(trains_from, len(sizes) + 1))
    assert first["committed"] == second["committed"] == back["committed"]
    start, _ = replay_diloco(sizes, config)
    for name in start:
        np.testing.assert_allclose(first["round_start"][name], start[name], rtol=1e-5, atol=1e-6)
        for seen in (second, back):
            np.testing.assert_array_equal(seen["round_start"][name], first["round_start"][name])  # bit-identical
            np.testing.assert_array_equal(seen["params"][name], first["params"][name])  # the last step exchanged


@pytest.mark.parametrize("asks", ["after", "before"])
def test_streaming_diloco_survivors_retry_an_overlapped_exchange_among_themselves_and_admit_a_joiner(
    tmp_path: Path, asks: str
):
    # Fragment 1 (w) is exchanged after steps 2, 6, 10, ... on a thread while the next step computes, and applied
    # after 3, 7, 11; fragment 0 (b) after 4, 8, 12, applied after 5, 9, 13. Member 2 dies as it starts step 6: the
    # exchange the others start there waits for it on the thread until the epoch closes, which revokes the thread's
    # communicator with the world's. Step 7 applies it: the two survivors rebuild both communicators and run that
    # exchange again among themselves, with the pseudo-gradients they took at step 6 (no inner step lost). The
    # survivors start step 7 once they saw the epoch close: it is not run there, so the exchange they queued at
    # step 6 is still theirs to drop (it ran among members that are gone), not to wait for again. A joiner that asks
    # after that recovery is admitted once an exchange was applied and trains from the next step; one that asked
    # before it is admitted by it and sits out step 7 (computing member 0's, weighed zero): it did not start the
    # exchange applied there, and adds nothing to it (given member 0's pseudo-gradient with the state, it would count
    # member 0 twice). The round start ends bit-identical.
    options = {"fragments": 2, "fragment_sync_delay": 1}
    config = DiLoCoConfig(sync_every=DILOCO_ROUND, **options)
    env = {"FT_AWAIT_CLOSE_AT": "7"} | ({"FT_START_JOINER_AFTER": "7"} if asks == "after" else {})
    faults = {6: (2, "kill" if asks == "after" else "kill-once-asked")}
    results = run_members(tmp_path, "train_diloco", 4, faults, 3, 3, 16, options, env=env)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode == 0 for r in results] == [True, True, False, True], outputs
    survivor, other, joiner = results[0].value, results[1].value, results[3].value
    sizes = {s["step"]: s["trainers"] for s in survivor["steps"]}
    assert list(sizes) == list(range(1, len(sizes) + 1)), sizes  # every inner step done once: none lost
    admitted_at = min(s["step"] for s in joiner["steps"])
    if asks == "before":
        assert admitted_at == 7 and joiner["steps"][0]["trainers"] == 2 and joiner["steps"][0]["rank"] == 0
        trains_from = 8
    else:  # admitted by an exchange's application
        assert admitted_at > 7 and config.applies_after(admitted_at - 1), admitted_at
        trains_from = admitted_at
    assert [sizes[t] for t in range(1, len(sizes) + 1)] == [3] * 6 + [2] * (trains_from - 7) + [3] * (
        len(sizes) - trains_from + 1
    ), sizes
    failed = [a["step"] for a in survivor["attempts"] if "end" not in a]
    assert failed[:1] == [7] and set(failed[1:]) <= {admitted_at}, failed  # only applications ran again
    assert survivor["committed"] == joiner["committed"] == sum(bool(config.applies_after(t)) for t in sizes)
    start, models = replay_diloco(sizes, config)
    for name in start:
        np.testing.assert_allclose(survivor["round_start"][name], start[name], rtol=2e-5, atol=1e-6)
        for seen in (other, joiner):
            np.testing.assert_array_equal(seen["round_start"][name], survivor["round_start"][name])  # bit-identical
        for seen in (survivor, other, joiner):
            model = models[seen["steps"][-1]["rank"]]
            np.testing.assert_allclose(seen["params"][name], model[name], rtol=2e-5, atol=1e-6)
    retried = [a for a in survivor["attempts"] if a["step"] == 7][1]
    resumed = retried["end"] - float((tmp_path / "fault-time-6").read_text())
    assert 0 < resumed < 20, resumed  # not revoked with the world, the exchange's wait lasted the 60-s timeout
    print(f"a kill while an overlapped exchange waited for it: the survivors had applied it {resumed:.2f} s later")


def test_saves_while_a_diloco_joiner_sits_out_write_nothing_and_the_exchange_it_joins_saves_everyone(tmp_path: Path):
    results = run_members(tmp_path, "train_diloco_saving", 2, 1, 2, 6, timeout=120)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode for r in results] == [0, 0], outputs
    member, joiner = results[0].value, results[1].value
    admitted = min(int(t) for t, n in member["sizes"].items() if n == 2)
    joined = admitted + DILOCO_ROUND - 1  # the round's exchange, its first step
    assert admitted % DILOCO_ROUND == 1, member["sizes"]
    for step, folder in member["saves"]:  # nothing while it sat out; everyone's from its exchange on
        if step != admitted - 1:  # after the step that ends the epoch to admit it: written or not, by its timing
            assert (folder is None) == (admitted <= step < joined), member["saves"]
    assert [step for step, _ in joiner["saves"]][0] == joined and all(f for _, f in joiner["saves"]), joiner["saves"]
    assert read_manifest(Path(joiner["saves"][0][1])).world_size == 2


def test_diloco_joiner_admitted_at_a_retried_exchange_contributes_nothing_to_it(tmp_path: Path):
    # Member 2 is killed at inner step 6, once the joiner asked. Members 0 and 1 notice at the exchange of step 8,
    # whose recovery also admits the joiner: it joins the retried exchange at once, with a zero pseudo-gradient. The
    # state is a flax TrainState, which the joiner gets back as one.
    config = DiLoCoConfig(sync_every=DILOCO_ROUND)
    results = run_members(tmp_path, "train_diloco", 4, {6: (2, "kill-once-asked")}, 3, 3, 16, {}, True)
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode == 0 for r in results] == [True, True, False, True], outputs
    survivor, joiner = results[0].value, results[3].value
    sizes = {s["step"]: s["trainers"] for s in survivor["steps"]}
    assert [sizes[t] for t in range(1, 13)] == [3] * 7 + [2] + [3] * 4, sizes
    assert [s["step"] for s in joiner["steps"]][:2] == [8, 9] and joiner["steps"][0]["trainers"] == 2
    assert survivor["state_class"] == joiner["state_class"] == "flax.training.train_state.TrainState"
    start, models = replay_diloco(sizes, config)
    for name in start:
        np.testing.assert_allclose(survivor["round_start"][name], start[name], rtol=2e-5, atol=1e-6)
        np.testing.assert_array_equal(joiner["round_start"][name], survivor["round_start"][name])


def test_a_member_lost_while_a_joiner_is_late_for_its_state_costs_the_others_one_recovery(tmp_path: Path):
    # Three members, then a joiner weighed out of its first step starts its side of the state's transfer 1.5 s late,
    # and member 1 is SIGKILLed meanwhile. The chaos run at 100 Mbit/s found the holder blocked in its step for the
    # joiner (the transfer's communicator was accepted on a thread, which holds MPICH's lock) and the survivors'
    # shrink hanging until the communicator's timeout (20 s here); now the three go on together at once.
    env = {"FT_KILL_WHILE_STATE_TRAVELS": "1", "FT_COMM_TIMEOUT": "20"}
    started = time.monotonic()
    results = run_members(tmp_path, "train", 4, {}, 3, 3, 8, env=env, timeout=180)
    assert (tmp_path / "victim-died").exists()
    holder, _ = two_members_and_the_joiner_trained_on(results)
    assert time.monotonic() - started < 20  # no wait for the communicator's timeout
    assert [r["size"] for r in holder["recoveries"]] == [4, 3], holder["recoveries"]  # the admission, the death


def two_members_and_the_joiner_trained_on(results) -> tuple[dict, dict]:
    """After member 1 of three died during a joiner's admission: members 0 and 2 and the joiner ended the job
    together, bit-identical, the joiner's parameters those of the committed steps replayed. Returns the holder's
    (member 0's) and the joiner's records."""
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert [r.returncode == 0 for r in results] == [True, False, True, True], outputs
    holder, other, joiner = (r.value for r in (results[0], results[2], results[3]))
    for name, value in holder["params"].items():
        for member in (other, joiner):
            np.testing.assert_array_equal(member["params"][name], value)  # bit-identical
    sizes = {s["transaction"]: s["size"] for s in holder["steps"]}
    for name, value in replay(sizes).items():
        np.testing.assert_allclose(joiner["params"][name], value, rtol=2e-5, atol=1e-6)
    return holder, joiner


def test_a_member_lost_while_the_state_communicator_is_split_costs_the_others_one_more_epoch(tmp_path: Path):
    # Three members admit a joiner weighed out of its first step; member 1 dies as they split the communicator the
    # state travels over. Over TCP the split fails at once: the others, the joiner too, take the next epoch, where
    # the joiner is given the state, and the three train on together.
    env = {"FT_KILL_IN_STATE_SPLIT": "1", "FT_COMM_TIMEOUT": "20"}
    started = time.monotonic()
    results = run_members(tmp_path, "train", 4, {}, 3, 3, 8, env=env, timeout=120)
    holder, joiner = two_members_and_the_joiner_trained_on(results)
    assert time.monotonic() - started < 60
    assert [r["size"] for r in holder["recoveries"]] == [3], holder["recoveries"]  # one: the admission, then the death
    assert [r["size"] for r in joiner["recoveries"]] == [3], joiner["recoveries"]


def test_a_member_lost_while_the_state_communicator_is_split_stops_the_others_naming_it_instead_of_hanging(
    tmp_path: Path,
):
    # Three members admit a joiner weighed out of its first step; member 1 dies as they split the communicator the
    # state travels over. MPI_Comm_split never returns then: the others give it up once the epoch closes (a
    # heartbeat's dead_after, 1.5 s) and stop naming it, instead of waiting for good.
    env = {"FT_KILL_IN_STATE_SPLIT": "1", "FT_COMM_TIMEOUT": "20"}
    started = time.monotonic()
    results = run_members(tmp_path, "train", 4, {}, 3, 4, 8, env=env, timeout=120, engine="mpi")
    outputs = "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-3000:]}" for r in results)
    assert all(r.returncode not in (0, None) for r in results), outputs
    for other in (results[0], results[2], results[3]):
        assert "closed while the state's communicator was being split" in other.output, outputs
    assert time.monotonic() - started < 60, outputs

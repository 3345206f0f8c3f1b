"""Fault-tolerant torch jobs over gloo: ranks die, hang, raise or lag, and the survivors go on without a restart.

Each job runs ``fault_tolerance_workers_torch.py`` in plain processes (forked with torch imported,
:mod:`fork_server`; RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, ``BAGUA_FAULT_TOLERANCE=1``) with short heartbeats (50 ms, dead after 1 s), several
faults per job, and a joiner started while it runs. Asserted, per failure: the survivors' seconds
from the failure seen to the step running again, at most one step lost, every sample of the epoch
trained exactly once across the changes of members, and (by the job's own replica check after
every change and every 5 steps, plus the final parameters' digests) bit-identical replicas.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from fault_tolerance_job_torch import DEAD_AFTER, Job
from multiprocess import free_port
from ring_copies import assert_ring_copies_are_the_neighbours_weights

from bagua_common.fault_tolerance import DataPosition
from bagua_common.job.checkpoint import checkpoint_dir, read_manifest
from bagua_torch.algorithms.decentralized import shift_one_peer

pytest.importorskip("torch")

RESUME_BAR = 2.0  # seconds from a failure seen to the step running again (issue 42: <= 2 s after a SIGKILL)


@pytest.fixture
def jobs():
    started: list[Job] = []

    def start(*args, **kwargs) -> Job:
        started.append(Job(*args, **kwargs))
        return started[-1]

    yield start
    for job in started:
        job.close()


def check_every_sample_once(*runs: Job, lost_parts: int = 0) -> None:
    """The committed steps' samples of the job's ``runs`` (one, or a run and its restart), over the ranks in rank
    order, are the epoch's order: none twice, none skipped. ``lost_parts`` (rank, step) parts may be missing (DiLoCo:
    the steps count for the survivors until they notice a death, and the dead rank's parts of them are lost with its
    pseudo-gradient)."""
    steps: dict[int, dict[int, list[int]]] = {}
    worlds: dict[int, int] = {}
    for e in [e for job in runs for e in list(job.events)]:
        if e["event"] == "step":
            steps.setdefault(e["step"], {})[e["rank"]] = e["indices"]
            worlds[e["step"]] = e["world"]
    reference = DataPosition(96, batch_per_rank=4, seed=3)
    missing = 0
    for step in sorted(steps):
        world = worlds[step]
        parts = np.array_split(reference.step_samples(world), world)
        missing += world - len(steps[step])
        for rank, indices in steps[step].items():
            assert indices == parts[rank].tolist(), f"step {step}, rank {rank}; each step's members: {worlds}"
        reference.advance(world)
    assert missing <= lost_parts
    assert sorted(steps) == list(range(1, max(steps) + 1))


def test_a_survivor_goes_on_alone_after_its_peer_is_killed_mid_allreduce(jobs):
    # 2 ranks, rank 1 SIGKILLed in its backward pass; the optimizer is fused over the model's buckets, which the
    # survivor lays out again for its new world
    kill = [{"rank": 1, "step": 2, "where": "backward", "kind": "kill"}]
    job = jobs(2, "gradient_allreduce", kill, steps=3, world=1, fused=True)
    job.finish()
    (survivor,) = job.pids(rank=0)
    ends = job.of(survivor, "end")
    assert ends, job.output()
    (recovery,) = ends[0]["recoveries"]
    assert recovery["size"] == 1 and recovery["steps_lost"] == 1 and recovery["seconds"] < RESUME_BAR, recovery
    assert [e["step"] for e in job.of(survivor, "retry")] == [2]  # the step in flight, run again alone
    assert ends[0]["step"] == 3
    check_every_sample_once(job)


def test_gradient_allreduce_survives_a_kill_a_death_in_recovery_and_a_slow_rank_and_replaces_them(jobs):
    faults = [
        {"rank": 3, "step": 3, "where": "backward", "kind": "kill"},  # the others wait in the allreduce
        {"rank": 2, "step": 3, "where": "recovery", "kind": "kill"},  # ... and one more dies in that recovery
        {"rank": 1, "step": 5, "where": "forward", "kind": "slow"},  # a slow rank is waited for, not dropped
    ]
    job = jobs(4, "gradient_allreduce", faults, steps=10, world=4, launcher=True)  # the launcher replaces ranks
    job.finish()
    survivors = job.pids(rank=0) + job.pids(rank=1)
    replacements = job.pids(joiner=True)
    assert len(survivors) == 2 and len(replacements) == 2, job.output()
    ends = [job.of(pid, "end") for pid in survivors + replacements]
    assert all(ends), job.output()
    assert len({e[0]["digest"] for e in ends}) == 1  # bit-identical replicas, the replacements' too
    for pid in survivors:
        recoveries = job.of(pid, "end")[0]["recoveries"]
        sizes = [r["size"] for r in recoveries]  # 4 -> 3 -> 2, or 4 -> 2 when both deaths fall in one recovery
        assert sizes[: sizes.index(2) + 1] in ([3, 2], [2]) and sizes[-1] == 4, recoveries
        assert all(r["seconds"] < RESUME_BAR for r in recoveries), recoveries
        assert sum(r["steps_lost"] for r in recoveries) == 1  # the step in flight, run again
        assert [e["step"] for e in job.of(pid, "retry")] == [3]
        for joined in (r for r in recoveries if r["joined"]):
            assert joined["seconds"] < 1.0, joined  # the members' wait for a joiner: its state's transfer
    for pid in replacements:
        first = job.of(pid, "step")[0]
        before = [e["step"] for e in job.of(survivors[0], "step") if e["step"] < first["step"]]
        assert first["step"] == max(before) + 1  # it trains the step after it was admitted
        assert job.of(pid, "end")[0]["joined"] < 5.0  # from asking to be admitted to ready
    check_every_sample_once(job)


def test_ranks_whose_step_times_out_at_every_attempt_stop_naming_the_timeout(jobs):
    # Rank 1 starts step 3 past the 2-s collective timeout at every attempt, alive: every retry times out alike, and the
    # job retried forever without training. The third failure of the step with nobody lost stops both ranks.
    faults = [{"rank": 1, "step": 3, "where": "forward", "kind": "slow", "seconds": 3.5, "every": True}]
    job = jobs(2, "gradient_allreduce", faults, steps=6, world=2, env={"BAGUA_COMM_TIMEOUT": "2"})
    job.finish(timeout=60)
    assert all(p.returncode not in (0, None) for p in job.procs), job.output()
    text = "".join(job.text)
    assert text.count("NoProgress: fault tolerance: transaction 3 failed 3 times in a row") == 2, job.output()
    assert "BAGUA_COMM_TIMEOUT" in text and not job.of(job.pids(rank=0)[0], "end"), job.output()


def test_a_survivor_that_had_not_applied_a_step_another_applied_gets_its_state_and_loses_nothing(jobs):
    # Step 4's collectives complete everywhere. Rank 0 votes ahead and applies it at once; rank 2 dies before its
    # vote; rank 1's vote comes after the epoch closed, its record saying it applied step 3 only.
    faults = [
        {"rank": 2, "step": 4, "where": "vote", "kind": "kill"},
        {"rank": 1, "step": 4, "where": "vote", "kind": "late"},
    ]
    job = jobs(3, "gradient_allreduce", faults, steps=6, world=2)
    job.finish()
    (applied,), (behind,) = job.pids(rank=0), job.pids(rank=1)
    ends = [job.of(pid, "end") for pid in (applied, behind)]
    assert all(ends), job.output()
    # (one step past 6: rank 1 takes part in step 5 weighed out, given rank 0's state of step 4 meanwhile)
    assert ends[0][0]["digest"] == ends[1][0]["digest"] and ends[0][0]["step"] == ends[1][0]["step"] == 7
    (failed_next,) = ends[0][0]["recoveries"]  # rank 0 was in step 5 when it saw the death: it runs 5 again
    assert failed_next["steps_lost"] == 1 and [e["step"] for e in job.of(applied, "retry")] == [5]
    (given,) = ends[1][0]["recoveries"]  # rank 1 is given rank 0's state at step 4: it loses no step
    assert given["steps_lost"] == 0 and given["seconds"] < RESUME_BAR, given
    assert not job.of(behind, "retry") and [e["step"] for e in job.of(behind, "step")] == list(range(1, 8))
    assert [e["world"] for e in job.of(applied, "step")][4] == 1 and [
        e["step"] for e in job.of(behind, "state_loaded")
    ] == [4]
    check_every_sample_once(job, lost_parts=1)  # rank 2 trained its part of step 4, and died before reporting it


@pytest.mark.parametrize(
    ("algorithm", "lost_parts"),
    # DiLoCo's survivors train on to the round's exchange (step 4): the dead rank's parts of steps 3 and 4 are lost
    [("gradient_allreduce", 0), ('diloco {"sync_every": 2}', 2)],
    ids=["gradient_allreduce", "diloco"],
)
def test_a_member_lost_in_a_checkpoint_leaves_it_uncommitted_and_a_restart_goes_on_from_the_next_one(
    jobs, tmp_path, algorithm, lost_parts
):
    # 3 ranks save after steps 2, 4 and 6; rank 2 dies in the first save, its part written: the survivors' save is not
    # committed, they recover and commit the next ones, with 2 members; the whole job restarts from the last with 3
    kill = [{"rank": 2, "step": 2, "where": "save", "kind": "kill"}]
    saves = {"FT_CHECKPOINTS": str(tmp_path), "FT_SAVE_AT": "2,4,6"}
    first = jobs(3, algorithm, kill, steps=4, world=2, env=saves)
    first.finish()
    survivors = first.pids(rank=0) + first.pids(rank=1)
    ends = [first.of(pid, "end")[0] for pid in survivors]
    end = ends[0]["step"]
    assert [e["step"] for e in ends] == [end, end] and ends[0]["digest"] == ends[1]["digest"], first.output()
    committed = [str(checkpoint_dir(tmp_path, s)) for s in (4, 6) if s <= end]
    for pid in survivors:
        assert [e["folder"] for e in first.of(pid, "saved")] == [None, *committed], first.output()
    with pytest.raises(FileNotFoundError):
        read_manifest(checkpoint_dir(tmp_path, 2))
    assert read_manifest(committed[-1]).world_size == 2

    restarted = jobs(3, algorithm, [], steps=end + 3, world=3, env={"FT_CHECKPOINTS": str(tmp_path)})
    restarted.finish()
    members = restarted.pids()
    assert len(members) == 3
    for pid in members:
        (restored,) = restarted.of(pid, "restored")
        assert restored["step"] == end and restored["digest"] == ends[0]["digest"], restored
    assert len({restarted.of(pid, "end")[0]["step"] for pid in members}) == 1
    assert restarted.of(members[0], "end")[0]["step"] >= end + 3
    equal = "replicated" if algorithm.startswith("diloco") else "digest"  # DiLoCo's parameters drift in a round
    assert len({restarted.of(pid, "end")[0][equal] for pid in members}) == 1
    check_every_sample_once(first, restarted, lost_parts=lost_parts)


def test_a_coordinator_cut_off_in_a_checkpoint_commits_nothing_alone_and_a_restart_goes_on_from_the_majoritys(
    jobs, tmp_path, network
):
    # The members save after every step; rank 0, the coordinator, which commits each save, loses its link for 4.5 s
    # in the save after step 2, its part written. Alone it must commit nothing: ranks 1 and 2 leave that save
    # uncommitted, go on as a majority (rank 1 committing their saves, of two ranks) and save with rank 0 again once it
    # is back. The whole job then restarts from the last save, with the state every member ended with.
    partition = [{"rank": 0, "step": 2, "where": "save", "kind": "partition", "seconds": DEAD_AFTER + 1.5}]
    saves = {"FT_CHECKPOINTS": str(tmp_path), "FT_SAVE_AT": ",".join(map(str, range(2, 100)))}
    first = jobs(3, "gradient_allreduce", partition, steps=8, world=3, step_seconds=0.1, env=saves, network=network)
    first.finish()
    coordinator, majority = first.pids(rank=0)[0], first.pids(rank=1) + first.pids(rank=2)
    ends = [first.of(pid, "end") for pid in (coordinator, *majority)]
    assert all(ends) and len({e[0]["digest"] for e in ends}) == 1, first.output()
    end = ends[0][0]["step"]
    with pytest.raises(FileNotFoundError):
        read_manifest(checkpoint_dir(tmp_path, 2))
    back = [e["step"] for e in first.of(coordinator, "saved") if e["folder"] is not None]
    assert back and back[0] > 3 and back == list(range(back[0], end + 1)), first.of(coordinator, "saved")
    for pid in majority:
        saved = [e["step"] for e in first.of(pid, "saved") if e["folder"] is not None]
        assert saved == list(range(3, end + 1)), first.of(pid, "saved")
        worlds = [read_manifest(checkpoint_dir(tmp_path, step)).world_size for step in saved]
        assert worlds == [2] * (back[0] - 3) + [3] * (end + 1 - back[0]), worlds
    restarted = jobs(3, "gradient_allreduce", [], steps=end + 2, world=3, env={"FT_CHECKPOINTS": str(tmp_path)})
    restarted.finish()
    for pid in restarted.pids():
        (restored,) = restarted.of(pid, "restored")
        assert restored["step"] == end and restored["digest"] == ends[0][0]["digest"], restored
    check_every_sample_once(first, restarted)


def test_a_joiner_admitted_before_a_restarted_jobs_first_commit_is_given_the_restored_state(jobs, tmp_path):
    # the first run ends with step 4's checkpoint; its restart of 3 ranks loses rank 2 in step 5 (slow, then killed)
    # while a joiner waits: the survivors' next epoch admits it before anything was committed since the restore, and
    # it must be given the restored state (step, optimizer, data position), not rank 0's parameters alone
    saves = {"FT_CHECKPOINTS": str(tmp_path), "FT_SAVE_AT": "4"}
    first = jobs(2, "gradient_allreduce", [], steps=4, world=2, env=saves)
    first.finish()
    faults = [
        {"rank": 2, "step": 5, "where": "forward", "kind": "slow", "seconds": 4},
        {"rank": 2, "step": 5, "where": "backward", "kind": "kill"},
    ]
    restarted = jobs(3, "gradient_allreduce", faults, steps=8, world=3, env={"FT_CHECKPOINTS": str(tmp_path)})
    restarted.join()
    restarted.finish()
    (joiner,) = restarted.pids(joiner=True)
    trained = [e["step"] for e in restarted.of(joiner, "step")]
    assert trained[:1] == [5], restarted.output()  # admitted before step 5 committed
    members = restarted.pids(rank=0) + restarted.pids(rank=1) + [joiner]
    ends = [restarted.of(pid, "end")[0] for pid in members]
    assert len({(e["step"], e["digest"]) for e in ends}) == 1 and ends[0]["step"] >= 8, restarted.output()
    check_every_sample_once(first, restarted)


def test_when_every_rank_dies_the_launcher_restarts_the_job_from_its_last_checkpoint(jobs, tmp_path):
    # both ranks SIGKILLed in step 12: their replacements find no member to join within the quorum timeout, the
    # slots end, and torch's agent restarts the job (one of --max-restarts), whose ranks restore step 10's checkpoint
    kills = [{"rank": r, "step": 12, "where": "forward", "kind": "kill"} for r in range(2)]
    saves = {"FT_CHECKPOINTS": str(tmp_path), "FT_SAVE_AT": "5,10", "BAGUA_FT_QUORUM_TIMEOUT": "2"}
    job = jobs(2, "gradient_allreduce", kills, steps=16, world=2, launcher=True, env=saves, max_restarts=1)
    job.finish(timeout=180)
    assert job.procs[0].returncode == 0, job.output()
    assert len(job.pids(joiner=True)) == 2 and "found no member of the job left" in "".join(job.text), job.output()
    restarted = job.pids(rank=0)[1:] + job.pids(rank=1)[1:]
    assert len(restarted) == 2, job.output()
    restored = [job.of(pid, "restored")[0] for pid in restarted]
    assert [r["step"] for r in restored] == [10, 10] and restored[0]["digest"] == restored[1]["digest"]
    ends = [job.of(pid, "end")[0] for pid in restarted]
    assert [e["step"] for e in ends] == [16, 16] and ends[0]["digest"] == ends[1]["digest"]
    data = DataPosition(96, batch_per_rank=4, seed=3)  # the data went on from step 10: steps 11 and 12 again, alike
    for _ in range(10):
        data.advance(2)
    for step in range(11, 17):
        parts = np.array_split(data.step_samples(2), 2)
        for pid in restarted:
            (trained,) = [e for e in job.of(pid, "step") if e["step"] == step]
            assert trained["indices"] == parts[trained["rank"]].tolist(), (step, trained)
        data.advance(2)


def test_a_node_whose_only_rank_died_gets_a_replacement_that_finds_where_the_coordinator_went(jobs):
    """Two nodes' launchers (bagua-launch --nnodes 2 --nproc-per-node 1): rank 0, the coordinator, dies; its node's
    directory was written only by it, so its replacement learns where the coordinator went (rank 1's node) from the
    other launcher, through the rendezvous store (bagua_launch.directory_relay), and joins."""
    faults = [{"rank": 0, "step": 3, "where": "backward", "kind": "kill"}]
    job = jobs(2, "gradient_allreduce", faults, steps=8, world=2, launcher=True, nodes=2)
    job.finish()
    assert [p.returncode for p in job.procs] == [0, 0], job.output()
    replacements = job.pids(joiner=True)
    assert len(replacements) == 1, job.output()
    ends = [job.of(pid, "end") for pid in job.pids(rank=1) + replacements]
    assert all(ends) and len({e[0]["digest"] for e in ends}) == 1, job.output()
    check_every_sample_once(job)


@pytest.mark.parametrize("lost", [2, 0])  # 0: the rank whose store the others register at
def test_a_rank_lost_before_the_job_formed_is_started_again_as_itself_by_the_launcher(jobs, lost):
    # the rank dies before it registers: the others wait for it, so its slot starts it again as the same rank, not
    # as a joiner of a job that does not exist yet (which waited for its timeout while the others waited for it)
    faults = [{"rank": lost, "step": 0, "where": "formation", "kind": "kill"}]
    job = jobs(3, "gradient_allreduce", faults, steps=3, world=3, launcher=True)
    job.finish()
    assert not job.pids(joiner=True) and len(job.pids(rank=lost)) == 1, job.output()
    ends = [job.of(pid, "end") for pid in job.pids()]
    assert len(ends) == 3 and all(ends), job.output()
    assert all(e[0]["step"] == 3 and e[0]["recoveries"] == [] for e in ends), ends
    text = "".join(job.text)
    assert f"rank {lost} ended (killed by SIGKILL)" in text and "the job had not formed yet" in text
    check_every_sample_once(job)


def test_powersgd_survives_a_hang_and_the_coordinators_exception(jobs):
    faults = [
        {"rank": 1, "step": 3, "where": "forward", "kind": "stop"},  # SIGSTOP: only heartbeats tell
        {"rank": 0, "step": 6, "where": "before_vote", "kind": "raise"},  # the coordinator raises, its store goes
    ]
    job = jobs(4, "powersgd", faults, steps=9, world=2)
    job.finish()
    survivors = job.pids(rank=2) + job.pids(rank=3)
    ends = [job.of(pid, "end") for pid in survivors]
    assert all(ends), job.output()
    assert ends[0][0]["digest"] == ends[1][0]["digest"]  # parameters, and PowerSGD's Q by the replica check
    for end in ends:
        hang, error = end[0]["recoveries"]
        assert hang["size"] == 3 and error["size"] == 2
        assert hang["seconds"] < DEAD_AFTER + RESUME_BAR, hang
        assert error["seconds"] < RESUME_BAR, error
    assert "rank 0 fails on purpose" in "".join(job.text)
    # rank 0 raised after its collectives of step 6: the survivors applied step 6 with its gradient averaged in,
    # and it died before reporting its part
    check_every_sample_once(job, lost_parts=1)


def finish_with_a_joiner_after_the_first_step(job: Job, ranks: tuple[int, ...]) -> tuple[list[int], int]:
    """Start a joiner once a step was reported, wait for the job's end; returns the processes of ``ranks`` and the
    joiner's (asserted: all of them ended on the same step with bit-identical parameters)."""
    job.wait_until(lambda: any(e.get("step", 0) >= 1 for e in list(job.events)))
    job.join()
    job.finish()
    members, (joiner,) = [pid for rank in ranks for pid in job.pids(rank=rank)], job.pids(joiner=True)
    ends = [job.of(pid, "end") for pid in [*members, joiner]]
    assert all(ends), job.output()
    assert len({e[0]["digest"] for e in ends}) == 1 and len({e[0]["step"] for e in ends}) == 1
    return members, joiner


# PowerSGD compresses the first layer (16 x 6) after two exact steps; without error feedback, whose residuals restart
# at the admission in this job but not in the job of two alone (test_powersgd_torch.py checks them weighed out).
POWERSGD_WEIGHED_OUT = 'powersgd {"rank": 1, "min_compression_rate": 1, "start_iter": 2, "error_feedback": false}'


@pytest.mark.parametrize(
    ("algorithm", "fused"),
    [
        pytest.param("gradient_allreduce", False, id="gradient_allreduce"),
        # The optimizer fused onto the buckets (bagua_torch.fuse_optimizer) steps in the wrapped one's place: the vote
        # and the optimizer state sent, loaded and hashed must be the fused one's (neither was: its members never
        # voted, so never admitted the joiner, and the joiner's momentum stayed zero).
        pytest.param("gradient_allreduce", True, id="gradient_allreduce-fused"),
        pytest.param("bytegrad", False, id="bytegrad"),
        pytest.param(POWERSGD_WEIGHED_OUT, False, id="powersgd"),
        pytest.param('qadam {"warmup_steps": 2}', False, id="qadam"),  # its momentum averaged after the warm-up
        pytest.param('onebit_adam {"warmup_steps": 2}', False, id="onebit_adam"),
    ],
)
def test_a_joiner_takes_part_in_its_first_step_weighed_out_while_its_state_arrives(jobs, algorithm, fused):
    # Steps of 1 s; the joiner's state takes 0.6 s more to leave rank 0 (a slow link). The joiner
    # is sent the step and data position at once, takes part in the next step with zero gradients that the average
    # leaves out, and loads the rest of the state before its optimizer applies that step: the state travels while
    # the step computes, so that step takes the members no longer than the 0.6 s the transfer was slowed by (before,
    # they waited for the whole transfer first). The loop's own collective (a logged loss) spans all three.
    faults = [{"rank": 0, "step": 0, "where": "state", "kind": "slow", "seconds": 0.6}]
    env = {"FT_LOOP_ALLREDUCE": "1", "FT_REPORT_PARAMS": "1"}
    job = jobs(2, algorithm, faults, steps=4, world=3, step_seconds=1.0, env=env, fused=fused)
    members, joiner = finish_with_a_joiner_after_the_first_step(job, (0, 1))
    assert job.of(members[0], "fault")  # the slow transfer happened
    (loaded,) = job.of(joiner, "state_loaded")
    first = job.of(joiner, "step")[0]
    assert first["step"] == loaded["step"] + 1 and first["world"] == 2 and first["summed"] == 3, first
    assert first["step"] > 2  # past PowerSGD's exact steps and QAdam's warm-up: the joiner was given the count first
    for pid in members:
        (admitted,) = job.of(pid, "end")[0]["recoveries"]
        assert admitted["joined"] == 1 and admitted["seconds"] < 0.5, admitted
        before, step = [e for e in job.of(pid, "step") if e["step"] in (loaded["step"], first["step"])]
        assert step["world"] == 2 and loaded["t"] < step["t"] < before["t"] + 1.0 + 0.6, (before, step, loaded)
    steps = [e for pid in job.pids() for e in job.of(pid, "step")]
    assert all(e["summed"] == len(job.pids()) or e["step"] < first["step"] for e in steps)
    check_every_sample_once(job)  # the joiner's first step is split between the two that trained it
    # That step averaged the two that trained it, as a job of those two alone does, and the joiner applied it to the
    # state it loaded: all three hold the same parameters after it. Up to the rescaled mean's rounding; ByteGrad's
    # 8-bit codes, chunked by 3 ranks rather than 2, move it by less than 5% of the step's largest change (the
    # joiner's zeros left in the average moved it by 9%). QAdam's 8-bit momentum, divided by the frozen variance's
    # root, moves the step by 7% of its norm (the joiner's zeros left in it: 30%). 1-bit signs chunked by 3 ranks are
    # another code (each element its chunk's mean magnitude), 138% of the norm away from the two's: its weighing is
    # checked bit for bit against a simulation (test_qadam_onebit_torch.py), here that the three hold the same state.
    if algorithm.startswith("onebit_adam"):
        return
    alone = jobs(2, algorithm, [], steps=first["step"], world=2, env={"FT_REPORT_PARAMS": "1"}, fused=fused)
    alone.finish()
    before, expected = (
        np.array([e["params"] for e in alone.of(alone.pids(rank=0)[0], "step") if e["step"] == step][0])
        for step in (first["step"] - 1, first["step"])
    )
    for pid in [*members, joiner]:
        (after,) = [e["params"] for e in job.of(pid, "step") if e["step"] == first["step"]]
        if algorithm.startswith("bytegrad"):
            assert np.abs(after - expected).max() <= 0.05 * np.abs(expected - before).max()
        elif algorithm.startswith("qadam"):
            assert np.linalg.norm(after - expected) <= 0.15 * np.linalg.norm(expected - before)
        else:
            np.testing.assert_allclose(after, expected, rtol=1e-5, atol=1e-7)


def test_a_joiner_weighed_out_while_its_state_holder_hangs_stops_waiting_when_the_epoch_fails(jobs):
    # Rank 0, the state's holder, is SIGSTOPped once connected to the joiner, half a second before sending the
    # tensors: the step the joiner is weighed out of has completed, and the joiner waits for the state before
    # applying it. Missed heartbeats fail the epoch; the joiner's wait gives up then, not at its transfer's 60-s
    # timeout, and rank 1 gives the joiner the state in the next epoch.
    faults = [{"rank": 0, "step": 0, "where": "state_tensors", "kind": "stop", "after": 0.5}]
    job = jobs(3, "gradient_allreduce", faults, steps=60, world=3, step_seconds=0.05)
    survivors, joiner = finish_with_a_joiner_after_the_first_step(job, (1, 2))
    (stopped,) = job.of(job.pids(rank=0)[0], "fault")
    first = job.of(joiner, "step")[0]
    assert first["t"] - (stopped["time"] + 0.5) < DEAD_AFTER + 2 * RESUME_BAR, (stopped, first)
    for pid in survivors:
        *_, failure = job.of(pid, "end")[0]["recoveries"]
        assert failure["size"] == 3 and failure["seconds"] < DEAD_AFTER + RESUME_BAR, failure
    check_every_sample_once(job)


def test_a_joiner_lost_in_the_step_it_is_weighed_out_of_leaves_the_next_steps_unscaled(jobs):
    # The first joiner dies in its first step, before that step's allreduce completes: the members abandon it and
    # retry it on their own, unweighed (the reducers' factor lasts one step, and an epoch's change rebuilds them). A
    # second joiner is then weighed out of its first step. Every step the two members trained matches a job of those
    # two alone.
    faults = [{"rank": None, "step": 0, "where": "joiner_forward", "kind": "kill"}]
    env = {"FT_REPORT_PARAMS": "1"}
    job = jobs(2, "gradient_allreduce", faults, steps=6, world=3, step_seconds=0.2, env=env)
    job.wait_until(lambda: any(e.get("step", 0) >= 1 for e in list(job.events)))
    job.join()
    job.wait_until(lambda: any(e.get("event") == "fault" for e in list(job.events)))
    job.join()
    job.finish()
    members = job.pids(rank=0) + job.pids(rank=1)
    assert all(job.of(pid, "end") for pid in members), job.output()
    trained_by_two = [e for e in job.of(members[0], "step") if e["world"] == 2]
    last = trained_by_two[-1]["step"]
    assert any(e["step"] > last for e in job.of(members[0], "step"))  # the second joiner trained with them
    alone = jobs(2, "gradient_allreduce", [], steps=last, world=2, env=env)
    alone.finish()
    expected = {e["step"]: e["params"] for e in alone.of(alone.pids(rank=0)[0], "step")}
    for pid in members:
        for event in (e for e in job.of(pid, "step") if e["world"] == 2):
            np.testing.assert_allclose(event["params"], expected[event["step"]], rtol=1e-5, atol=1e-7)


def finish_with_a_joiner_on_one_round_start(
    job: Job, ranks: tuple[int, ...] = (0, 1)
) -> tuple[list[int], list[int], list[list[dict]]]:
    """Start a joiner, wait for the job's end; returns the processes of ``ranks``, the joiner's, and the end events of
    each (asserted: every one ended, all on the same DiLoCo round start, the joiner's too)."""
    job.join()
    job.finish()
    members, joiner = [pid for rank in ranks for pid in job.pids(rank=rank)], job.pids(joiner=True)
    ends = [job.of(pid, "end") for pid in members + joiner]
    assert all(ends), job.output()
    assert len({e[0]["replicated"] for e in ends}) == 1
    return members, joiner, ends


def test_streaming_diloco_retries_an_overlapped_exchange_among_the_survivors_and_takes_a_joiner(jobs):
    # Fragment 1 is exchanged after steps 2, 6, 10 (on the worker thread, applied a step later), fragment 0 after
    # 4, 8: rank 2 dies inside fragment 1's overlapped exchange of step 6.
    options = {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1}
    faults = [{"rank": 2, "step": 6, "where": "exchange", "kind": "kill"}]
    job = jobs(3, f"diloco {json.dumps(options)}", faults, steps=12, world=3)
    job.wait_until(lambda: any(e.get("step", 0) >= 9 for e in list(job.events)))
    survivors, joiner, ends = finish_with_a_joiner_on_one_round_start(job)
    for pid in survivors:
        assert not job.of(pid, "retry")  # no completed inner step lost
        steps = [e["step"] for e in job.of(pid, "step")]
        assert steps == list(range(1, len(steps) + 1))
        failure, joined = job.of(pid, "end")[0]["recoveries"]
        assert failure["size"] == 2 and failure["steps_lost"] == 0 and failure["seconds"] < RESUME_BAR, failure
        assert joined["size"] == 3 and joined["joined"] == 1 and joined["seconds"] < 1.0, joined
    check_every_sample_once(job, lost_parts=2)  # rank 2's parts of step 6 (it died in) and 7 (its death noticed)


def test_a_streaming_diloco_joiner_admitted_where_an_exchange_is_retried_adds_nothing_to_it(jobs):
    # Rank 2 dies inside fragment 1's overlapped exchange of step 6 once a joiner asked: the survivors' recovery
    # admits the joiner, and the exchange retried there is the two survivors' mean. The joiner, given rank 0's state
    # with rank 0's pseudo-gradient in it, sends zeros for that exchange, uncounted: not rank 0's a second time.
    options = {"sync_every": 4, "fragments": 2, "fragment_sync_delay": 1}
    faults = [{"rank": 2, "step": 6, "where": "exchange", "kind": "kill", "once": ["joiner-asked"], "after": 0.3}]
    job = jobs(3, f"diloco {json.dumps(options)}", faults, steps=12, world=3, env={"FT_REPORT_PARAMS": "1"})
    job.wait_until(lambda: any(e.get("event") == "fault" for e in list(job.events)))
    survivors, joiner, ends = finish_with_a_joiner_on_one_round_start(job)
    for end in ends[:2]:
        (change,) = end[0]["recoveries"]  # the death and the admission in one recovery
        assert change["size"] == 3 and change["joined"] == 1 and change["steps_lost"] == 0, change
    tried = [[e for e in job.of(pid, "exchange") if e["step"] == 6] for pid in survivors + joiner]
    assert [len(t) for t in tried] == [2, 2, 1], tried  # the survivors' first try, then everyone's retry
    own = [np.asarray(t[-1]["values"], np.float32) for t in tried]
    np.testing.assert_array_equal(own[0], tried[0][0]["values"])  # each survivor retries its own pseudo-gradient
    assert not own[2].any() and own[0].any() and own[1].any()
    for pid in survivors + joiner:
        (mean,) = [e["mean"] for e in job.of(pid, "exchanged") if e["step"] == 6]  # the first try never ended
        np.testing.assert_allclose(mean, (own[0] + own[1]) / 2, rtol=1e-6, atol=1e-7)


def test_diloco_survivors_train_on_to_the_rounds_exchange_after_a_death_in_an_inner_step(jobs):
    # Rank 1 lags by 0.3 s (6 steps) from step 3; rank 2 dies in step 4's forward pass. The others notice at
    # different inner steps (they communicate nothing), train on to the exchange after step 10, which fails on
    # both, and retry it between the two of them.
    faults = [{"rank": 1, "step": 3, "where": "forward", "kind": "slow"}]
    faults += [{"rank": 2, "step": 4, "where": "forward", "kind": "kill"}]
    job = jobs(3, 'diloco {"sync_every": 10}', faults, steps=20, world=2, step_seconds=0.05)
    job.finish()
    survivors = job.pids(rank=0) + job.pids(rank=1)
    ends = [job.of(pid, "end") for pid in survivors]
    assert all(ends), job.output()
    assert ends[0][0]["replicated"] == ends[1][0]["replicated"]
    for pid in survivors:
        assert not job.of(pid, "retry")  # no completed inner step lost
        assert [e["step"] for e in job.of(pid, "step")] == list(range(1, 21))
        (failure,) = job.of(pid, "end")[0]["recoveries"]
        assert failure["size"] == 2 and failure["steps_lost"] == 0, failure
    check_every_sample_once(job, lost_parts=7)  # rank 2's parts of steps 4 to 10, gone with its pseudo-gradient
    # the retried first exchange carries each survivor's own inner steps and inner optimizer state (the recovery
    # before the job's first commit gave none another's)
    exchanges = [job.of(pid, "exchange") for pid in survivors]
    first = min(e["step"] for e in exchanges[0])
    retried = [[e for e in events if e["step"] == first][-1] for events in exchanges]
    for kept in ("pseudo_gradient", "inner"):
        assert retried[0][kept] != retried[1][kept], kept


def test_a_diloco_joiner_sits_out_its_first_round_while_its_state_arrives_and_its_peers_wait_for_nothing(jobs):
    # Rounds of 20 steps of 0.1 s; the joiner's state takes 1 s more to leave rank 0 (a slow link), yet the peers
    # train on: the state is a copy sent in the background, and the joiner joins the round's exchange with a zero
    # pseudo-gradient that is not counted, which gives it the new round start.
    # The loop makes a collective of its own each step: over the members training the step while the joiner sits out.
    faults = [{"rank": 0, "step": 0, "where": "state", "kind": "slow", "seconds": 1.0}]
    loop = {"FT_LOOP_ALLREDUCE": "1"}
    job = jobs(2, 'diloco {"sync_every": 20}', faults, steps=50, world=3, step_seconds=0.1, env=loop)
    alone = jobs(2, 'diloco {"sync_every": 20}', [], steps=100, world=2)  # beside it: the same two, never joined
    peers, joiner, ends = finish_with_a_joiner_on_one_round_start(job)
    assert job.of(peers[0], "fault")  # the slow transfer happened
    first = job.of(joiner[0], "step")[0]["step"]
    assert first > 20 and first % 20 == 1, first  # it trains from the round after the one it sat out
    for pid in peers:
        (joined,) = job.of(pid, "end")[0]["recoveries"]
        assert joined["size"] == 3 and joined["joined"] == 1 and joined["seconds"] < 0.5, joined
        times = [e["t"] for e in job.of(pid, "step")]
        assert max(b - a for a, b in zip(times, times[1:])) < 0.6, times  # no step waited for the state
    check_every_sample_once(job)  # the round sat out is split between the two that trained it
    steps = [e for pid in job.pids() for e in job.of(pid, "step")]
    assert all(e["summed"] == e["world"] for e in steps) and {e["world"] for e in steps} == {2, 3}
    # The exchange the joiner sat out averaged the two that trained, as a job of those two alone does (up to the
    # rounding of the rescaled mean): the job ended in the round after it, on the round start it gave.
    alone.finish()
    rounds = {e["step"]: e["round_start"] for e in alone.of(alone.pids(rank=0)[0], "step") if "round_start" in e}
    np.testing.assert_allclose(ends[0][0]["replicated_values"], rounds[first - 1], rtol=1e-5, atol=1e-7)


def test_a_diloco_joiner_sitting_out_the_round_leaves_every_checkpoint_and_sample_where_they_belong(jobs, tmp_path):
    # Rounds of 7 steps; the members save after every step. While the joiner sits out a round (inside its exchange),
    # their saves write nothing; the exchange step it joined from its sit-out is counted as trained by the members
    # alone, on every member (its data position stays the joiner's, checked by the job's replica check after it).
    # An epoch of the data is 12 steps of the two: no exchange before step 84 ends one, where the count would not show.
    saves = {"FT_CHECKPOINTS": str(tmp_path), "FT_SAVE_AT": ",".join(str(s) for s in range(1, 80))}
    saves["FT_LOOP_ALLREDUCE"] = "1"  # and a collective of the loop's own: over the members training the step
    job = jobs(2, 'diloco {"sync_every": 7}', [], steps=30, world=3, step_seconds=0.05, env=saves)
    job.wait_until(lambda: any(e.get("step", 0) >= 3 for e in list(job.events)))
    members, (joiner,), ends = finish_with_a_joiner_on_one_round_start(job)
    first = job.of(joiner, "step")[0]["step"]  # the step after the exchange it joined
    assert first % 7 == 1 and first < 84, first
    for pid in members:
        (joined,) = job.of(pid, "end")[0]["recoveries"]  # the admission only: no failure
        unsaved = [e["step"] for e in job.of(pid, "saved") if e["folder"] is None]
        assert unsaved and unsaved == list(range(unsaved[0], first)) and first - unsaved[0] <= 7, unsaved
    assert all(e["folder"] for e in job.of(joiner, "saved"))
    assert read_manifest(checkpoint_dir(tmp_path, first)).world_size == 3
    check_every_sample_once(job)
    steps = [e for pid in job.pids() for e in job.of(pid, "step")]
    assert all(e["summed"] == e["world"] for e in steps) and {e["world"] for e in steps} == {2, 3}


def test_a_diloco_joiner_sits_out_with_the_fused_optimizer_and_an_8_bit_exchange(jobs):
    # The sit-out above, with the optimizer fused over the buckets and the pseudo-gradients sent as 8-bit min-max
    # chunks: the joiner's zeros encode exactly, and the average still counts the two that trained. Against the job
    # of those two alone, the chunks' quantization differs (3 ranks' chunks against 2), within 2% of the round's
    # change; counting the joiner would take a third of it away.
    algorithm = 'diloco {"sync_every": 20, "outer_exchange": "uint8"}'
    faults = [{"rank": 0, "step": 0, "where": "state", "kind": "slow", "seconds": 1.0}]
    job = jobs(2, algorithm, faults, steps=50, world=3, step_seconds=0.1, fused=True)
    alone = jobs(2, algorithm, [], steps=100, world=2, fused=True)
    _, joiner, ends = finish_with_a_joiner_on_one_round_start(job)
    first = job.of(joiner[0], "step")[0]["step"]
    assert first > 20 and first % 20 == 1, first
    check_every_sample_once(job)
    alone.finish()
    rounds = {e["step"]: e["round_start"] for e in alone.of(alone.pids(rank=0)[0], "step") if "round_start" in e}
    after, before = np.array(rounds[first - 1]), np.array(rounds[first - 21])
    difference = np.abs(np.array(ends[0][0]["replicated_values"]) - after).max()
    assert difference < 0.02 * np.abs(after - before).max(), (difference, np.abs(after - before).max())


def test_a_diloco_joiner_whose_state_holder_dies_while_sending_is_given_the_state_again(jobs):
    # Rank 0 (the coordinator, holding the state) dies in its sending thread: the others train on to the round's
    # exchange, the joiner's transfer fails; in the next epoch rank 1 gives the joiner the state at the exchange,
    # and the joiner sits out that exchange (the retried one) with a zero pseudo-gradient.
    faults = [{"rank": 0, "step": 0, "where": "state", "kind": "kill"}]
    job = jobs(3, 'diloco {"sync_every": 20}', faults, steps=50, world=3, step_seconds=0.05)
    survivors, _, _ = finish_with_a_joiner_on_one_round_start(job, ranks=(1, 2))
    for pid in survivors:
        assert not job.of(pid, "retry")  # no completed inner step lost
        steps = [e["step"] for e in job.of(pid, "step")]
        assert steps == list(range(1, len(steps) + 1))
        # the survivors may meet the death entering the admission's epoch (making the trainers' group): one recovery
        *admission, failure = job.of(pid, "end")[0]["recoveries"]
        assert len(admission) <= 1 and all(r["size"] == 4 and r["joined"] == 1 for r in admission), admission
        assert failure["size"] == 3 and failure["joined"] == 1 and failure["steps_lost"] == 0, failure
    check_every_sample_once(job, lost_parts=20)  # rank 0's parts of the round it died in


DECENTRALIZED_SHIFT_ONE = 'decentralized {"peer_selection_mode": "shift_one"}'


def death_before_the_vote() -> list[dict]:
    """Rank 3 dies before its vote at step 4, and ranks 0-2 vote once the epoch closed. Rank 3 dies once the others
    reached their votes: a decentralized step has no collective before its vote, and a rank 3 ahead of a peer still
    in step 3's exchange (after that step's commit) would end that exchange instead, losing no step."""
    late = [{"rank": r, "step": 4, "where": "vote", "kind": "late"} for r in range(3)]
    voting = [f"{r}-4-vote" for r in range(3)]
    return [{"rank": 3, "step": 4, "where": "vote", "kind": "kill", "once": voting}, *late]


@pytest.mark.parametrize(
    "algorithm",
    [
        # the momentum was averaged and written, then the step did not commit: put back, then the step again
        'onebit_adam {"warmup_steps": 2}',
        'qadam {"warmup_steps": 2}',
        # the residuals restart at zero (they are laid out per rank)
        'bytegrad {"error_feedback": true}',
        # shift_one left with 3 ranks: those rounds average over all
        DECENTRALIZED_SHIFT_ONE,
        # the copies of the neighbours' weights start again from the new neighbours'
        "low_precision_decentralized",
    ],
)
def test_a_death_before_the_vote_puts_the_algorithms_state_back(jobs, algorithm):
    # rank 3 dies before its vote, and the others' votes come after the epoch closed: nobody applies step 4
    job = jobs(4, algorithm, death_before_the_vote(), steps=7, world=3)
    job.finish()
    survivors = job.pids(rank=0) + job.pids(rank=1) + job.pids(rank=2)
    ends = [job.of(pid, "end") for pid in survivors]
    assert all(ends), job.output()
    if "decentralized" not in algorithm:  # replicated: parameters (and Adam's moments) checked equal too
        assert len({e[0]["digest"] for e in ends}) == 1
    if algorithm == "low_precision_decentralized":  # each copy is the bits its neighbour holds, on the new ring
        copies = {e[0]["rank"]: e[0]["copies"] for e in ends}
        for rank, held in copies.items():
            assert held["left"] == copies[(rank - 1) % 3]["weights"], rank
            assert held["right"] == copies[(rank + 1) % 3]["weights"], rank
    for pid in survivors:
        (recovery,) = job.of(pid, "end")[0]["recoveries"]
        assert recovery["size"] == 3 and recovery["steps_lost"] == 1 and recovery["seconds"] < RESUME_BAR
        assert [e["step"] for e in job.of(pid, "retry")] == [4]
    check_every_sample_once(job)


def test_decentralized_training_with_the_fused_optimizer_carries_its_momentum_through_a_death(jobs):
    # The death before the vote above, under decentralized SGD with momentum whose optimizer is fused over the
    # buckets (bagua_torch.fuse_optimizer), which are laid out again for the survivors: each survivor keeps its own
    # weights and the fused optimizer's momentum through the change and ends, bit for bit up to the fused update's
    # rounding, where the same job with the plain optimizer ends.
    faults = death_before_the_vote()
    ends = {}
    for fused in (True, False):
        job = jobs(4, DECENTRALIZED_SHIFT_ONE, faults, steps=7, world=3, fused=fused, env={"FT_REPORT_PARAMS": "1"})
        job.finish()
        survivors = job.pids(rank=0) + job.pids(rank=1) + job.pids(rank=2)
        assert all(job.of(pid, "end") for pid in survivors), job.output()
        for pid in survivors:
            (recovery,) = job.of(pid, "end")[0]["recoveries"]
            assert recovery["size"] == 3 and recovery["steps_lost"] == 1, recovery
        ends[fused] = {job.rank_of(pid): np.array(job.of(pid, "step")[-1]["params"]) for pid in survivors}
        check_every_sample_once(job)
    for rank, params in ends[False].items():
        np.testing.assert_allclose(ends[True][rank], params, rtol=1e-5, atol=1e-6, err_msg=f"rank {rank}")
    assert len({params.tobytes() for params in ends[True].values()}) == 3  # each drifted its own way


@pytest.mark.parametrize(
    ("interval", "fused"), [(1, False), (1, True), (2, False)], ids=["plain", "fused", "every-second-step"]
)
def test_decentralized_survivors_of_a_hang_mid_exchange_go_on(jobs, interval, fused):
    # Rank 3 hangs (SIGSTOP) in its backward pass at step 3: its shift_one peer waits for its weights in their
    # exchange (gloo's send and recv, which torch cannot abort) until the missed heartbeats close the epoch, and gives
    # up there (it failed on the work's missing abort()). The other pair's exchange completed: voting one ahead (step
    # 2 had every vote), they applied step 3 and lose their attempt at step 4, blocked on the two others. The peer,
    # one step behind them, takes step 3 by itself (its own gradient, its weights unaveraged; with its optimizer fused
    # over the buckets too): no survivor loses a step it trained, and the three go on, averaging over all three.
    # Rank 3's part of step 3 is lost with it. Exchanging every second step, step 3 (iteration 2) exchanges too.
    hang = {"rank": 3, "step": 3, "where": "backward", "kind": "stop"}
    algorithm = f'decentralized {{"peer_selection_mode": "shift_one", "communication_interval": {interval}}}'
    job = jobs(4, algorithm, [hang], steps=6, world=3, fused=fused, env={"FT_REPORT_PARAMS": "1"})
    job.finish()
    survivors = [pid for rank in range(3) for pid in job.pids(rank=rank)]
    ends = [job.of(pid, "end") for pid in survivors]
    assert all(ends), job.output()
    peer = shift_one_peer(3, 2 // interval, 4)  # step 3 is iteration 2
    for pid in survivors:
        (recovery,) = job.of(pid, "end")[0]["recoveries"]
        alone = job.rank_of(pid) == peer
        assert recovery["size"] == 3 and recovery["seconds"] < RESUME_BAR, recovery
        assert (recovery["caught_up"], recovery["steps_lost"]) == ((1, 0) if alone else (0, 1)), (pid, recovery)
        assert [e["step"] for e in job.of(pid, "retry")] == ([] if alone else [4])
    (pid,) = job.pids(rank=peer)
    before, taken = job.of(pid, "step")[1:3]
    np.testing.assert_allclose(taken["params"], sgd_step_alone(before, taken["indices"]), rtol=1e-5, atol=1e-6)
    check_every_sample_once(job, lost_parts=1)


def test_a_decentralized_member_one_behind_before_its_optimizer_steps_is_given_the_state(jobs):
    # Exchanging every second step (steps 1, 3, 5, ...), the steps between vote one ahead and exchange nothing: ranks
    # 0, 1 and 3 apply step 4 while rank 2 still computes its forward pass (slow), and rank 3 is killed as it starts
    # step 5. Rank 2 is one step behind the others, and its join record says it cannot take that step by itself (its
    # gradients were not complete): it abandons its attempt at step 4, is given the state holder's weights and
    # optimizer state at step 4, bit for bit, takes no step alone and sits out step 5 while the state travels; ranks
    # 0 and 1 lose their attempt at step 5. Rank 2's part of step 4 is lost, and rank 3's with its weights.
    slow = DEAD_AFTER + 1  # the epoch closes while rank 2 is still in its forward pass (its heartbeats go on)
    faults = [
        {"rank": 2, "step": 4, "where": "forward", "kind": "slow", "seconds": slow},
        {"rank": 3, "step": 5, "where": "forward", "kind": "kill"},
    ]
    algorithm = 'decentralized {"peer_selection_mode": "shift_one", "communication_interval": 2}'
    job = jobs(4, algorithm, faults, steps=7, world=3)
    job.finish()
    survivors = [pid for rank in range(3) for pid in job.pids(rank=rank)]
    assert all(job.of(pid, "end") for pid in survivors), job.output()
    for pid in survivors:
        (recovery,) = job.of(pid, "end")[0]["recoveries"]
        behind = job.rank_of(pid) == 2
        assert (recovery["size"], recovery["joined"], recovery["caught_up"]) == (3, 1, 0), (pid, recovery)
        assert recovery["steps_lost"] == (0 if behind else 1), (pid, recovery)
        # the others resume once rank 2 is out of its slow forward pass and takes part in the new epoch's groups
        assert recovery["seconds"] < (RESUME_BAR if behind else slow + RESUME_BAR), (pid, recovery)
        assert [e["step"] for e in job.of(pid, "retry")] == ([4] if behind else [5]), pid
    entered = [e for pid in survivors for e in job.of(pid, "entered")]
    (holder,) = [e for e in entered if e["rank"] == e["holder"]]
    (given,) = [e for pid in job.pids(rank=2) for e in job.of(pid, "entered")]
    assert (given["params"], given["optimizer"]) == (holder["params"], holder["optimizer"])
    assert [(e["step"], e["world"]) for e in job.of(given["pid"], "step") if e["step"] > 3] == [(6, 3), (7, 3)]
    check_every_sample_once(job, lost_parts=1)


def sgd_step_alone(before: dict, indices: list[int]) -> np.ndarray:
    """Plain torch's parameters after one step of the workers' model and SGD, unaveraged, on ``indices``, from the
    parameters and momentum of step report ``before``."""
    import torch
    from fault_tolerance_workers_torch import LEARNING_RATE, MOMENTUM, regression_net, samples

    net = regression_net()
    torch.nn.utils.vector_to_parameters(torch.tensor(before["params"]), net.parameters())
    x, y = samples()
    optimizer = torch.optim.SGD(net.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    torch.nn.functional.mse_loss(net(x[indices]), y[indices]).backward()
    params = list(net.parameters())
    for p, buffer in zip(params, torch.tensor(before["momentum"]).split([p.numel() for p in params])):
        optimizer.state[p]["momentum_buffer"] = buffer.view_as(p).clone()
    optimizer.step()
    return torch.nn.utils.parameters_to_vector(net.parameters()).detach().numpy()


def ended_together(job: Job) -> tuple[list[int], int, dict[int, list[dict]]]:
    """The processes of the job's three members and of its joiner, and each one's end report, checked present and at
    one step."""
    members, (joiner,) = [pid for rank in range(3) for pid in job.pids(rank=rank)], job.pids(joiner=True)
    ends = {pid: job.of(pid, "end") for pid in [*members, joiner]}
    assert all(ends.values()), job.output()
    assert len({e[0]["step"] for e in ends.values()}) == 1
    return members, joiner, ends


def state_given(job: Job, members: list[int], joiner: int) -> tuple[dict, dict, int]:
    """The joiner's ``entered`` report, its state holder's of the same epoch, and the last step the holder reported
    before it."""
    (entered,) = job.of(joiner, "entered")
    ((holding, holder),) = [
        (pid, e)
        for pid in members
        for e in job.of(pid, "entered")
        if e["epoch"] == entered["epoch"] and e["rank"] == entered["holder"]
    ]
    return entered, holder, max(e["step"] for e in job.of(holding, "step") if e["t"] <= holder["t"])


@pytest.mark.parametrize(
    ("algorithm", "fused"),
    [
        pytest.param(DECENTRALIZED_SHIFT_ONE, False, id="decentralized"),
        pytest.param(DECENTRALIZED_SHIFT_ONE, True, id="decentralized-fused"),
        pytest.param("low_precision_decentralized", False, id="low_precision_decentralized"),
    ],
)
def test_a_decentralized_joiner_starts_from_the_first_members_weights_and_optimizer_state(jobs, algorithm, fused):
    # Three members drift apart (shift_one averages over all three while their number is odd; the low-precision
    # ring exchanges compressed differences); a fourth process joins after the first step. It enters with the
    # state holder's weights and optimizer state (the fused optimizer's, where the optimizer is fused), bit for bit,
    # trains on its share of the samples from the second step after its admission (it sits out the first while the
    # state travels), and (low precision) every copy of a neighbour's weights on the ring of four is that
    # neighbour's own at the end: the members restarted theirs when the joiner had its weights.
    job = jobs(3, algorithm, [], steps=5, world=4, fused=fused)
    job.wait_until(lambda: any(e.get("step", 0) >= 1 for e in list(job.events)))
    job.join()
    job.finish()
    members, joiner, ends = ended_together(job)
    entered, holder, before = state_given(job, members, joiner)
    assert entered["optimizer_tensors"] > 0  # momentum, from the steps the members took
    assert (entered["params"], entered["optimizer"]) == (holder["params"], holder["optimizer"])
    assert job.of(joiner, "step")[0]["step"] == before + 2
    if algorithm == "low_precision_decentralized":
        assert_ring_copies_are_the_neighbours_weights(e[0] for e in ends.values())
    check_every_sample_once(job)


@pytest.mark.parametrize(
    "algorithm", [DECENTRALIZED_SHIFT_ONE, "low_precision_decentralized"], ids=["decentralized", "low"]
)
def test_a_decentralized_joiner_sits_out_one_step_while_its_state_travels_and_its_peers_do_not_wait(jobs, algorithm):
    # Steps of 1 s; the joiner's state takes 0.6 s more to leave rank 0 (a slow link). The three members train the
    # step after the admission on all its samples without exchanging weights (the joiner has none to exchange yet)
    # while the state travels, so that step takes them no longer than the 0.6 s the transfer was slowed by (before,
    # they waited for the whole transfer first). The joiner votes for it once it has the state and trains from the
    # next step: paired on the ring of four (shift_one), or (low precision) on the ring whose copies of the
    # neighbours' weights everyone restarts at that step's start.
    faults = [{"rank": 0, "step": 0, "where": "state", "kind": "slow", "seconds": 0.6}]
    job = jobs(3, algorithm, faults, steps=4, world=4, step_seconds=1.0)
    job.wait_until(lambda: any(e.get("step", 0) >= 1 for e in list(job.events)))
    job.join()
    job.finish()
    members, joiner, ends = ended_together(job)
    assert job.of(members[0], "fault")  # the slow transfer happened
    (entered,) = job.of(joiner, "entered")
    first = job.of(joiner, "step")[0]
    assert first["world"] == 4, first
    for pid in members:
        (admitted,) = job.of(pid, "end")[0]["recoveries"]
        assert admitted["joined"] == 1 and admitted["seconds"] < 0.5, admitted
        before, sat_out = [e for e in job.of(pid, "step") if e["step"] in (first["step"] - 2, first["step"] - 1)]
        assert sat_out["world"] == 3 and before["t"] < entered["t"], (before, entered)
        assert sat_out["t"] < before["t"] + 1.0 + 0.6, (before, sat_out, entered)
    if algorithm == "low_precision_decentralized":
        assert_ring_copies_are_the_neighbours_weights(e[0] for e in ends.values())
    check_every_sample_once(job)  # the step it sat out is split among the three members


@pytest.mark.parametrize(
    ("warmup", "fused"), [(2, False), (100, False), (2, True)], ids=["averaging", "warm-up", "fused"]
)
def test_asynchronous_averaging_survives_a_death_with_a_member_one_behind_and_admits_a_joiner(jobs, warmup, fused):
    # Four ranks average their weights in the background every 20 ms (after `warmup` steps of gradient allreduce).
    # Rank 2 votes for step 4 only once the epoch closed, and rank 3 dies as step 5 begins: ranks 0 and 1, which
    # applied step 4 (voting one ahead: step 3 had every vote), lose their attempt at step 5; rank 2, one step
    # behind them, takes step 4 by itself (its own gradient after the warm-up, the rounds stopped and their last
    # result dropped: torch's SGD step on that gradient), so no survivor loses a step it trained. A fourth process
    # then joins with the first member's weights and optimizer state, which take 1.5 s more to leave rank 0 (a slow
    # link); after the warm-up it sits out one step while they travel, its peers' admission not waiting for them,
    # and its averaging rounds with them start once it trained a step (during the warm-up the members wait for the
    # state instead: it takes part in their next gradient allreduce). The same with the optimizer fused over the
    # buckets, which are laid out again for each epoch's members.
    faults = [
        {"rank": 2, "step": 4, "where": "vote", "kind": "late"},
        {"rank": 3, "step": 5, "where": "forward", "kind": "kill", "once": ["2-4-vote"]},
        {"rank": 0, "step": 0, "where": "state", "kind": "slow", "seconds": 1.5},
    ]
    algorithm = f'async {{"sync_interval_ms": 20, "warmup_steps": {warmup}}}'
    env = {"FT_REPORT_PARAMS": "1"}
    job = jobs(4, algorithm, faults, steps=30, world=4, step_seconds=0.05, fused=fused, env=env)
    job.wait_until(lambda: any(e["event"] == "retry" for e in list(job.events)))
    job.join()
    job.finish()
    members, joiner, ends = ended_together(job)
    for pid in members:
        lost, admitted = job.of(pid, "end")[0]["recoveries"]
        behind = job.rank_of(pid) == 2
        assert lost["size"] == 3 and lost["seconds"] < RESUME_BAR, lost
        assert (lost["caught_up"], lost["steps_lost"]) == ((1, 0) if behind else (0, 1)), (pid, lost)
        assert [e["step"] for e in job.of(pid, "retry")] == ([] if behind else [5])
        assert admitted["joined"] == 1 and (admitted["seconds"] < 0.5) == (warmup == 2), admitted
    assert [f["where"] for f in job.of(members[0], "fault")] == ["state"]  # the slow transfer happened
    (behind,) = job.pids(rank=2)
    taken = {e["step"]: e for e in job.of(behind, "step")}
    alone = sgd_step_alone(taken[3], taken[4]["indices"])  # after the warm-up: its own gradient
    assert np.allclose(taken[4]["params"], alone, rtol=1e-5, atol=1e-6) == (warmup == 2)
    entered, holder, before = state_given(job, members, joiner)
    assert (entered["params"], entered["optimizer"]) == (holder["params"], holder["optimizer"])
    assert job.of(joiner, "step")[0]["step"] == before + (2 if warmup == 2 else 1)
    rounds = [e[0]["rounds"] for e in ends.values()]  # the last epoch's, the joiner's among them
    assert all(r >= 1 for r in rounds) if warmup == 2 else rounds == [0] * 4, rounds
    check_every_sample_once(job)


def joiners_group(monkeypatch) -> tuple[Any, Any]:
    """A fault-tolerant job's :class:`FaultTolerance` and group as a joiner has them before its loop starts (nothing
    reaches the network), to wrap models on in this process."""
    import torch

    from bagua_torch.fault_tolerance import start_fault_tolerance
    from bagua_torch.job import BaguaProcessGroup

    monkeypatch.setenv("BAGUA_FT_JOIN", "1")
    cpu = torch.device("cpu")
    job = start_fault_tolerance(None, None, "127.0.0.1", free_port(), "gloo", cpu, 10.0)
    return job, BaguaProcessGroup(job.communicators, 0, 1, 0, 1, cpu, "gloo", False, fault_tolerance=job)


@pytest.mark.parametrize(
    ("algorithm", "options", "refusal"),
    [
        # a user's own algorithm declares no rule for its state
        ("your own", {}, r"^fault tolerance: YourOwn cannot continue in-process.*the elastic restart"),
        # Each member wraps its model alone before the job forms: its tuner's broadcasts would reach itself only.
        ("gradient_allreduce", {"autotune": "once"}, r"^fault tolerance: autotune cannot tune.*bucket_tuner\.current"),
    ],
)
def test_what_cannot_continue_in_process_is_refused_naming_what_to_do(monkeypatch, algorithm, options, refusal):
    import torch

    import bagua_torch
    from bagua_torch.algorithms import Algorithm, GradientAllReduceAlgorithm

    class YourOwn(Algorithm):
        def reify(self, context):
            return GradientAllReduceAlgorithm().reify(context)

    _, group = joiners_group(monkeypatch)
    net = torch.nn.Linear(4, 1)
    algorithm = YourOwn() if algorithm == "your own" else algorithm
    with pytest.raises(ValueError, match=refusal):
        bagua_torch.with_bagua(
            net, [torch.optim.SGD(net.parameters(), lr=0.1)], algorithm, process_group=group, **options
        )


@pytest.mark.parametrize("algorithm", ["powersgd", "decentralized", "low_precision_decentralized"])
def test_a_loaded_checkpoint_is_what_a_change_of_members_carries(monkeypatch, algorithm):
    # A restarted job loads its checkpoint before its first commit; a change of members before that commit carries
    # the algorithm's state as of the last commit, which must be the checkpoint's (it was the fresh wrap's: step 0).
    import torch

    import bagua_torch

    _, group = joiners_group(monkeypatch)
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 1))
    options = {"min_compression_rate": 1} if algorithm == "powersgd" else {}
    model = bagua_torch.with_bagua(
        net, [torch.optim.SGD(net.parameters(), lr=0.1)], algorithm, process_group=group, **options
    )
    impl = model.algorithm_impl
    saved = impl.state_dict()
    saved["step"] = 7
    if algorithm == "powersgd":
        saved["qs"] = [q + 1 for q in saved["qs"]]
    impl.load_state_dict(saved)
    carried = impl.carried_state()
    assert carried["step"] == 7
    if algorithm == "powersgd":
        assert all(torch.equal(q.reshape(-1), s) for q, s in zip(carried["qs"], saved["qs"]))


def test_a_restart_is_refused_a_checkpoint_without_a_data_position_and_a_joiner_any(monkeypatch, tmp_path):
    import torch

    import bagua_torch
    from bagua_torch import checkpoint

    job, group = joiners_group(monkeypatch)
    net = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    model = bagua_torch.with_bagua(net, [optimizer], "gradient_allreduce", process_group=group)
    data = DataPosition(16, batch_per_rank=2)
    with pytest.raises(ValueError, match=r"a joiner receives the members' state: call steps\(\) alone"):
        job.restore(tmp_path, data)
    checkpoint.save(tmp_path, model, [optimizer], step=1)  # bagua_torch.checkpoint's own: no data position
    job.membership = object()  # a first member's, from here on
    with pytest.raises(ValueError, match=r"records no data position: it was not written by a fault-tolerant job"):
        job.restore(tmp_path, data)


@pytest.mark.parametrize(
    ("algorithm", "fused"),
    [
        pytest.param("gradient_allreduce", False, id="gradient_allreduce"),
        pytest.param("gradient_allreduce", True, id="gradient_allreduce-fused"),
        # the state a member back from a partition must be given, not keep: its residuals, Q, momenta
        pytest.param('bytegrad {"error_feedback": true}', False, id="bytegrad"),
        pytest.param('powersgd {"rank": 1, "min_compression_rate": 1, "start_iter": 2}', False, id="powersgd"),
        pytest.param('qadam {"warmup_steps": 2}', False, id="qadam"),
        pytest.param('onebit_adam {"warmup_steps": 2}', False, id="onebit_adam"),
    ],
)
def test_a_partitioned_coordinator_stops_training_and_joins_the_majority_again_once_its_link_is_back(
    jobs, network, algorithm, fused
):
    # Rank 0, the coordinator, loses its link in step 3's backward pass, for 4.5 s: to ranks 1 and 2 it is a hang (no
    # heartbeat, no closed connection), so they take it for dead after dead_after, form the next epoch at rank 1 (a
    # majority of the 3) and go on. Rank 0 alone is a minority: it must not train on by itself (a job split in two),
    # and once its link is back it finds itself out of the job and joins it again, given the majority's state (the
    # job compares every member's hash of it, the algorithm's and the optimizer's too, after each change).
    partition = [{"rank": 0, "step": 3, "where": "backward", "kind": "partition", "seconds": DEAD_AFTER + 1.5}]
    job = jobs(3, algorithm, partition, steps=8, world=3, step_seconds=0.1, fused=fused, network=network)
    job.finish()
    coordinator, majority = job.pids(rank=0)[0], job.pids(rank=1) + job.pids(rank=2)
    ends = [job.of(pid, "end") for pid in (coordinator, *majority)]
    assert all(ends), job.output()
    assert len({e[0]["digest"] for e in ends}) == 1  # bit-identical replicas, the partitioned member's too
    for pid in majority:
        (lost, rejoined) = job.of(pid, "end")[0]["recoveries"]
        assert lost["size"] == 2 and lost["steps_lost"] == 1 and lost["seconds"] < RESUME_BAR, lost
        assert rejoined["size"] == 3 and rejoined["joined"] == 1, rejoined
        assert [e["step"] for e in job.of(pid, "retry")] == [3]
    # The coordinator trained steps 1 and 2, then nothing until it was admitted again: that step (weighed out while
    # the state reached it) and the rest, all in the new epoch; the majority trained the steps between as two.
    back = [e["step"] for e in job.of(coordinator, "step")]
    readmitted = back[2]
    assert back == [1, 2, *range(readmitted, ends[0][0]["step"] + 1)] and readmitted > 3, back
    assert {e["world"] for e in job.of(majority[0], "step") if 3 <= e["step"] <= readmitted} == {2}
    check_every_sample_once(job, lost_parts=0)


@pytest.mark.parametrize(
    "algorithm", [DECENTRALIZED_SHIFT_ONE, "low_precision_decentralized"], ids=["decentralized", "low"]
)
def test_a_partitioned_decentralized_member_returns_with_a_members_weights(jobs, network, algorithm):
    # Decentralized weights drift, so no hash can tell a member back from a partition that its own are stale. Rank 0 of
    # 3 loses its link in step 3's backward pass for 4.5 s; ranks 1 and 2 go on as a pair (shift_one; the
    # low-precision ring of two). Back, rank 0 enters the job again as a joiner: with its state holder's weights and
    # optimizer state, bit for bit, not the ones it kept; it sits out one step, and (low precision) every copy of a
    # neighbour's weights on the ring of three is that neighbour's own at the end. Over three ranks decentralized
    # averaging is an allreduce before the vote: step 3 is lost and retried by the pair. Low precision votes before
    # its ring exchange (in the optimizer's post-hook), one ahead: the pair applied step 3, whose exchange then
    # failed, and rank 0's part of it is lost with the weights it kept.
    partition = [{"rank": 0, "step": 3, "where": "backward", "kind": "partition", "seconds": DEAD_AFTER + 1.5}]
    job = jobs(3, algorithm, partition, steps=8, world=3, step_seconds=0.1, network=network)
    job.finish()
    coordinator, majority = job.pids(rank=0)[0], job.pids(rank=1) + job.pids(rank=2)
    ends = {pid: job.of(pid, "end") for pid in (coordinator, *majority)}
    assert all(ends.values()), job.output()
    low = algorithm == "low_precision_decentralized"
    for pid in majority:
        (lost, rejoined) = ends[pid][0]["recoveries"]
        assert lost["size"] == 2 and lost["steps_lost"] == int(not low) and lost["seconds"] < RESUME_BAR, lost
        assert rejoined["size"] == 3 and rejoined["joined"] == 1, rejoined
    (entered,) = job.of(coordinator, "entered")
    (holder,) = [
        e for pid in majority for e in job.of(pid, "entered") if (e["epoch"], e["rank"]) == (entered["epoch"], 0)
    ]
    assert entered["holder"] == 0 and entered["optimizer_tensors"] > 0  # momentum, from the steps the pair took
    assert (entered["params"], entered["optimizer"]) == (holder["params"], holder["optimizer"])
    back = [e["step"] for e in job.of(coordinator, "step")]
    assert back[:2] == [1, 2] and back[2] > 4, back  # nothing trained alone; one step sat out after its admission
    assert back[2:] == list(range(back[2], ends[coordinator][0]["step"] + 1)), back
    if low:
        assert_ring_copies_are_the_neighbours_weights(e[0] for e in ends.values())
    check_every_sample_once(job, lost_parts=int(low))


def test_a_rank_that_raises_is_taken_for_lost_as_the_exception_ends_its_program(jobs):
    # Rank 2 raises in step 3's backward pass, and its process then takes 6 s more to end (an exit handler, as a GPU
    # runtime's teardown may; each rank an interpreter of its own, not forked). Its membership closes
    # its connections and store as the exception ends the program, before that handler and torch's own run: the
    # others resume at once, as after a SIGKILL, not once the process has ended.
    fault = [{"rank": 2, "step": 3, "where": "backward", "kind": "raise"}]
    job = jobs(3, "gradient_allreduce", fault, steps=6, world=2, env={"FT_SLOW_EXIT": "6"}, forked=False)
    job.finish()
    survivors = job.pids(rank=0) + job.pids(rank=1)
    ends = [job.of(pid, "end") for pid in survivors]
    assert all(ends) and len({e[0]["digest"] for e in ends}) == 1, job.output()
    for end in ends:
        (recovery,) = end[0]["recoveries"]
        assert recovery["size"] == 2 and recovery["steps_lost"] == 1, recovery
    (fault_seen,) = job.of(job.pids(rank=2)[0], "fault")
    retried = min(e["t"] for pid in survivors for e in job.of(pid, "step") if e["step"] == 3)
    assert retried - fault_seen["t"] < 2, (fault_seen, retried)
    check_every_sample_once(job)


def test_a_rank_cut_off_for_good_stops_naming_the_partition_and_the_majority_trains_on(jobs, network):
    # Rank 2's link goes down in step 3's backward pass and stays down: ranks 1 and 0 go on without it; rank 2 waits
    # for a majority for the quorum timeout (3 s here), then stops naming why, having trained nothing alone.
    partition = [{"rank": 2, "step": 3, "where": "backward", "kind": "partition"}]
    settings = {"BAGUA_FT_QUORUM_TIMEOUT": "3"}
    job = jobs(3, "gradient_allreduce", partition, steps=8, world=2, env=settings, network=network)
    job.finish(timeout=60)
    cut_off = job.pids(rank=2)[0]
    survivors = job.pids(rank=0) + job.pids(rank=1)
    ends = [job.of(pid, "end") for pid in survivors]
    assert all(ends) and len({e[0]["digest"] for e in ends}) == 1, job.output()
    for pid in survivors:
        (recovery,) = job.of(pid, "end")[0]["recoveries"]
        assert recovery["size"] == 2 and recovery["steps_lost"] == 1 and recovery["seconds"] < RESUME_BAR, recovery
    assert not job.of(cut_off, "end") and [e["step"] for e in job.of(cut_off, "step")] == [1, 2], job.output()
    (process,) = [p for p in job.procs if p.pid == cut_off]
    assert process.returncode != 0 and "NoQuorum: fault tolerance: the members reachable at" in "".join(job.text)
    check_every_sample_once(job, lost_parts=1)

"""The shared fault-tolerance core: the members' store, the decision register, epochs, commit and recovery.

Members run as threads of this process (each with its own store on a real socket); a member
"dies" when its store and connections close, as they do when its process ends, which the
coordinator sees at once. The hang (a stopped process, only heartbeats tell) runs members as
processes and stops one with SIGSTOP (``fault_tolerance_member.py``).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from contextlib import closing

import pytest
from multiprocess import TESTS, free_port

from bagua_common.fault_tolerance import (
    Decision,
    FaultToleranceSettings,
    InProcessClient,
    KVClient,
    KVServer,
    Membership,
    NoProgress,
    NoQuorum,
    StoreUnreachable,
    job_secret,
)
from bagua_common.fault_tolerance.admission import job_size
from bagua_common.fault_tolerance.decision import commit_transaction
from bagua_common.fault_tolerance.epoch import Epoch, Member, close_epoch
from bagua_common.fault_tolerance.errors import NO_JOB_STATUS, Evicted, NoJobToJoin
from bagua_common.fault_tolerance.formation import probe, process_ended
from bagua_common.fault_tolerance.node_directory import job_stopped
from bagua_common.fault_tolerance.progress import RETRIES_WITHOUT_PROGRESS
from bagua_common.fault_tolerance.settings import temporary_job_secret

FAST = FaultToleranceSettings(heartbeat_period=0.05, dead_after=0.6, quorum_timeout=3.0)
SECRET = job_secret()  # conftest's, inherited by the members started as processes


def together(calls):
    """Run the calls on threads at once; return their results in order (re-raising the first error)."""
    results, errors = [None] * len(calls), []

    def run(i, call):
        try:
            results[i] = call()
        except BaseException as error:  # noqa: BLE001 (reported to the test's thread)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    if errors:
        raise errors[0]
    return results


@pytest.fixture
def members(request):
    """``members(n)``: n members forming epoch 0 together; closed at the end."""
    made = []

    def make(n: int, settings: FaultToleranceSettings = FAST) -> list[Membership]:
        port = free_port()
        group = together(
            [lambda r=r: Membership.start(settings, r, n, "127.0.0.1", port, timeout=20) for r in range(n)]
        )
        made.extend(group)
        return group

    yield make
    for m in reversed(made):  # the coordinator last: it waits for the others to leave
        m.close()


def die(member: Membership) -> None:
    """End ``member`` as its process ending does: its store and connections close, without leaving (close())."""
    member._stopping.set()
    for client in (member._monitor_client, member._local, member.epoch.store):
        if client is not None:
            client.close()
    member._server.close()


def commit_all(group, transaction):
    return together([lambda m=m: m.commit(m.epoch, transaction) for m in group])


# --- the store ---------------------------------------------------------------------------


@pytest.mark.parametrize("reached", ["over a socket", "in-process"])
def test_store_operations_and_a_waiting_get(reached):
    server = KVServer("127.0.0.1", secret=SECRET)
    client = KVClient("127.0.0.1", server.port, 5, secret=SECRET) if reached == "over a socket" else None
    client = client or server.in_process_client()
    try:
        assert client.get("k") is None
        assert client.add("n", 2) == 2 and client.add("n", -5) == -3
        assert client.add_and_check("n", 1, "c") == (-2, None)  # the counter, and another key as it was: unset
        assert client.compare_set("c", b"", b"one") == b"one"
        assert client.add_and_check("n", 1, "c") == (-1, b"one")
        assert client.compare_set("c", b"zero", b"two") == b"one"  # expected value differs: unchanged
        assert client.compare_set("c", b"one", b"two") == b"two"

        def set_late() -> None:
            with closing(KVClient("127.0.0.1", server.port, 5, secret=SECRET)) as late:
                late.set("late", b"x")

        setter = threading.Timer(0.2, set_late)
        setter.start()
        started = time.monotonic()
        assert client.get("late", wait=5) == b"x"
        assert time.monotonic() - started < 2  # woken by the set, not by the wait's end
        setter.join(5)  # its reply is on the way: the store closes after it
        assert client.delete("c") and client.check("c") is None
    finally:
        client.close()
        server.close()


def test_a_closed_store_refuses_and_a_registered_connection_is_reported():
    gone = []
    server = KVServer("127.0.0.1", on_disconnect=gone.append, secret=SECRET)
    member = KVClient("127.0.0.1", server.port, 5, member="7:someone", secret=SECRET)
    member.close()
    deadline = time.monotonic() + 5
    while not gone and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gone == ["7:someone"]
    port, own = server.port, server.in_process_client()
    server.close()
    with pytest.raises(StoreUnreachable) as caught:
        KVClient("127.0.0.1", port, 1, secret=SECRET)
    assert caught.value.refused
    with pytest.raises(StoreUnreachable):
        own.check("k")


def test_a_store_serves_only_clients_that_prove_the_jobs_secret(tmp_path, monkeypatch):
    server = KVServer("127.0.0.1", secret=SECRET)
    member = KVClient("127.0.0.1", server.port, 5, secret=SECRET)
    try:
        assert server._listener.getsockname()[0] == "127.0.0.1"  # the job's address only, not every interface
        member.set("ft/current", b"the job")
        with pytest.raises(StoreUnreachable, match="does not hold the job's secret"):
            KVClient("127.0.0.1", server.port, 5, secret=b"another job's secret").set("ft/current", b"forged")
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:  # a request without the proof
            raw.recv(4096)  # the store's greeting
            raw.sendall(struct.pack("!BII", 1, len(b"ft/current"), 6) + b"ft/current" + b"forged")
            assert raw.recv(9)[:1] == b"\x02" and raw.recv(9) == b""  # denied, then closed
        assert member.check("ft/current") == b"the job"
        impostor = KVServer("127.0.0.1", secret=b"another job's secret")  # a process on a member's port
        with pytest.raises(StoreUnreachable, match="refused this client"):
            KVClient("127.0.0.1", impostor.port, 5, secret=SECRET)
        impostor.close()
    finally:
        member.close()
        server.close()
    path = tmp_path / "secret"
    path.write_text("x" * 32)
    monkeypatch.setenv("BAGUA_FT_SECRET_FILE", str(path))
    path.chmod(0o644)
    with pytest.raises(ValueError, match="readable by others"):
        job_secret()
    path.chmod(stat.S_IRUSR | stat.S_IWUSR)
    assert job_secret() == b"x" * 32
    monkeypatch.delenv("BAGUA_FT_SECRET_FILE")
    with pytest.raises(ValueError, match="BAGUA_FT_SECRET_FILE is not set"):
        FaultToleranceSettings()
    monkeypatch.setenv("BAGUA_FT_SECRET_FILE", "  ")  # blank: as unset
    with pytest.raises(ValueError, match="BAGUA_FT_SECRET_FILE is not set"):
        job_secret()


def test_a_temporary_job_secret_is_set_for_its_block_only_and_an_existing_one_is_kept(tmp_path, monkeypatch):
    monkeypatch.delenv("BAGUA_FT_SECRET_FILE")
    with temporary_job_secret() as path:
        assert os.environ["BAGUA_FT_SECRET_FILE"] == path and len(job_secret()) == 64
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    assert "BAGUA_FT_SECRET_FILE" not in os.environ and not os.path.exists(os.path.dirname(path))
    own = tmp_path / "own-secret"
    own.write_text("y" * 32)
    own.chmod(0o600)
    monkeypatch.setenv("BAGUA_FT_SECRET_FILE", str(own))
    with temporary_job_secret() as path:
        assert path == str(own)
    assert os.environ["BAGUA_FT_SECRET_FILE"] == str(own) and own.exists()  # the user's: neither unset nor removed


# --- the decision register ---------------------------------------------------------------


def test_settings_are_read_from_the_environment_and_bad_values_are_named(monkeypatch):
    assert FaultToleranceSettings().compile_ahead and FaultToleranceSettings.from_environment().hash_every == 100
    for variable, value in {
        "BAGUA_FT_HASH_EVERY": "7",
        "BAGUA_FT_DEAD_AFTER": "3",
        "BAGUA_FT_COMPILE_AHEAD": "0",
    }.items():
        monkeypatch.setenv(variable, value)
    settings = FaultToleranceSettings.from_environment()
    assert (settings.hash_every, settings.dead_after, settings.compile_ahead) == (7, 3.0, False)
    monkeypatch.setenv("BAGUA_FT_COMPILE_AHEAD", "yes")
    with pytest.raises(ValueError, match="BAGUA_FT_COMPILE_AHEAD must be 0 or 1, got 'yes'"):
        FaultToleranceSettings.from_environment()
    monkeypatch.setenv("BAGUA_FT_COMPILE_AHEAD", "1")
    monkeypatch.setenv("BAGUA_FT_HASH_EVERY", "often")
    with pytest.raises(ValueError, match="BAGUA_FT_HASH_EVERY must be a number"):
        FaultToleranceSettings.from_environment()
    with pytest.raises(ValueError, match="compile_ahead must be a bool"):
        FaultToleranceSettings(compile_ahead=1)


def test_decision_register_transitions():
    opened = Decision(4)
    assert Decision.decode(opened.encode()) == opened
    assert opened.after_last_vote(5) == Decision(5) and opened.after_last_vote(6) is None
    assert opened.draining().after_last_vote(5) == Decision(5, "ended")
    wound = opened.draining(ahead=True)  # members voting ahead may be computing 6 when 5 commits: they end after 6
    assert wound.after_last_vote(5) == Decision(5, "drain") and wound.after_last_vote(5).after_last_vote(6) == Decision(
        6, "ended"
    )
    assert wound.closed() == Decision(4, "closed") and Decision(4, "drain").draining(ahead=True) == Decision(4, "drain")
    assert opened.closed() == Decision(4, "closed") and opened.closed().after_last_vote(5) is None
    assert Decision(5, "ended").closed() == Decision(5, "ended")  # an ended epoch stays ended
    with pytest.raises(ValueError, match="not a decision register"):
        Decision.decode(b"garbage")


def test_the_last_vote_commits_in_one_round_trip_unless_the_epoch_drains_or_closed():
    server = KVServer("127.0.0.1", secret=SECRET)
    client = KVClient("127.0.0.1", server.port, 5, secret=SECRET)
    round_trips = []
    request = client._request
    client._request = lambda kind, *args, **kwargs: round_trips.append(kind) or request(kind, *args, **kwargs)
    try:
        for before, after, trips in (
            (Decision(4), Decision(5), 1),
            (Decision(4, "drain"), Decision(5, "ended"), 2),  # the coordinator asked it to drain: it ends
            (Decision(4, "closed"), Decision(4, "closed"), 1),  # closed by a failure: 5 does not commit
            (Decision(5), Decision(5), 1),  # a register already past 4 is left as it is
        ):
            client.set("decision", before.encode())
            round_trips.clear()
            assert commit_transaction(client, "decision", 5) == after
            assert len(round_trips) == trips, f"{before} -> {after}: {len(round_trips)} requests to the store"
            assert Decision.decode(client.check("decision")) == after
    finally:
        client.close()
        server.close()


# --- epochs, commits, recovery -------------------------------------------------------------


def test_members_commit_together_and_survive_a_death(members):
    group = members(3)
    assert [m.epoch.rank for m in group] == [0, 1, 2]
    assert commit_all(group, 1) == [True, True, True]
    leaving = [m.epoch for m in group]  # each member's own (a front end's training thread keeps it)
    started = time.monotonic()
    die(group[2])
    recovered = together([lambda m=m, e=e: m.recover(e) for m, e in zip(group[:2], leaving)])
    seconds = time.monotonic() - started
    assert [r.epoch.size for r in recovered] == [2, 2] and [r.epoch.rank for r in recovered] == [0, 1]
    assert [r.committed for r in recovered] == [1, 1]
    assert seconds < 1.0, f"recovery took {seconds:.2f} s"
    assert commit_all(group[:2], 2) == [True, True]


def test_the_coordinators_death_moves_its_role_to_the_next_member(members):
    group = members(3)
    assert commit_all(group, 1) == [True, True, True]
    leaving = [m.epoch for m in group]
    die(group[0])
    recovered = together([lambda m=m, e=e: m.recover(e) for m, e in zip(group[1:], leaving[1:])])
    assert [r.epoch.coordinator.id for r in recovered] == [group[1].me.id] * 2
    # the coordinator reaches its own store in-process, the others over a socket
    assert [type(r.epoch.store) for r in recovered] == [InProcessClient, KVClient]
    assert commit_all(group[1:], 2) == [True, True]


def test_a_transaction_in_flight_when_a_member_dies_is_abandoned_by_all(members):
    group = members(3)
    leaving = [m.epoch for m in group]
    votes = together([lambda m=m, e=e: m.commit(e, 1) for m, e in zip(group[:2], leaving)] + [lambda: die(group[2])])
    assert votes[:2] == [False, False]  # the third vote never came: nobody applies transaction 1
    recovered = together([lambda m=m, e=e: m.recover(e) for m, e in zip(group[:2], leaving)])
    assert [r.committed for r in recovered] == [0, 0]


def test_a_vote_ahead_applies_at_once_and_the_survivors_behind_get_the_state_of_one_that_applied(members):
    for applied_by in (0, 1):  # the coordinator applied the step, then a member that is not the coordinator
        group = members(3)
        leaving = [m.epoch for m in group]
        started = time.monotonic()
        assert group[applied_by].vote_ahead(leaving[applied_by], 1)  # its collectives completed: it applies at once
        assert time.monotonic() - started < FAST.dead_after  # without waiting for the two votes that never come
        die(group[2])  # the other survivor's collectives for step 1 fail: it never votes
        recovered = together([lambda m=m, e=e: m.recover(e) for m, e in zip(group[:2], leaving)])
        assert [r.committed for r in recovered] == [1, 1]  # applied by a survivor: it counts, for both
        behind = group[1 - applied_by]
        assert [r.epoch.joined for r in recovered] == [(behind.me.id,)] * 2
        assert [r.epoch.state_holder for r in recovered] == [applied_by] * 2
        for m in group[:2]:
            m.close()


def test_a_vote_one_ahead_applies_once_the_step_before_committed_and_a_survivor_one_behind_keeps_its_own_state(
    members,
):
    # Decentralized averaging: a member applies step t once every member voted for step t - 1, so at a change the
    # survivors are at most one step apart, and the one behind trains that step itself: it is not given another's.
    group = members(4)
    leaving = [m.epoch for m in group]
    for m in group:
        m.catches_up = True  # each can take a step by itself (JAX: its unaveraged step; torch: its own gradients)
    assert together([lambda m=m, e=e: m.vote_one_ahead(e, 1) for m, e in zip(group, leaving)]) == [True] * 4
    assert together([lambda m=m, e=e: m.vote_one_ahead(e, 2) for m, e in zip(group[:2], leaving)]) == [True] * 2
    third = []  # member 0's step 3 waits for step 2's last votes: members 2 and 3 never give them
    thread = threading.Thread(target=lambda: third.append(group[0].vote_one_ahead(leaving[0], 3)))
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()
    die(group[3])  # member 2's exchange of step 2 failed with it
    thread.join(10)
    assert third == [False]  # the epoch closed before step 2 committed: member 0 stays at step 2
    recovered = together([lambda m=m, e=e: m.recover(e) for m, e in zip(group[:3], leaving)])
    assert [r.committed for r in recovered] == [2, 2, 2]  # applied by members 0 and 1
    assert [r.epoch.joined for r in recovered] == [()] * 3  # member 2, one behind, trains step 2 itself
    assert [r.epoch.state_holder for r in recovered] == [0] * 3


def test_a_coordinator_starved_past_the_others_patience_is_evicted_not_given_an_epoch_of_its_own(members):
    # The others wrote their join records at the coordinator's store (its server thread answers), waited for the epoch
    # as long as they do, then formed it at the next member; the coordinator's monitor, starved meanwhile, gathered
    # later. It counted the records left behind and published an epoch of the same number with all three: two epochs
    # 1, and the coordinator lost. A record counts only while its writer still waits at that store.
    settings = FaultToleranceSettings(heartbeat_period=0.05, dead_after=0.3, quorum_timeout=0.6)
    group = members(3, settings)
    assert commit_all(group, 1) == [True, True, True]
    leaving = [m.epoch for m in group]
    patience = settings.quorum_timeout + 2 * settings.dead_after  # how long a member waits at a candidate
    formed_elsewhere = threading.Event()
    gather = group[0]._formation._gather

    def starved_gather(*args):
        formed_elsewhere.wait(10 * patience)
        time.sleep(0.1)  # the two adopt the epoch they formed
        gather(*args)

    group[0]._formation._gather = starved_gather
    close_epoch(group[0]._local, leaving[0], {"reason": "a step timed out", "suspects": []})  # nobody lost
    recovered = together([lambda m=m, e=e: m.recover(e, timeout=10 * patience) for m, e in zip(group[1:], leaving[1:])])
    formed_elsewhere.set()
    assert [(r.epoch.number, r.epoch.size, r.epoch.coordinator.id) for r in recovered] == [(1, 2, group[1].me.id)] * 2
    with pytest.raises(Evicted, match="without this member"):
        group[0].recover(leaving[0], timeout=10 * patience)
    assert commit_all(group[1:], 2) == [True, True]


def test_the_same_members_failing_the_same_transaction_again_and_again_stop_naming_the_timeout(
    members, launcher_directory
):
    # A collective that times out with nobody lost (a member slower than the timeout, alive) closes the epoch and the
    # same members retry; one slower at every attempt made the job loop forever without training. A commit between
    # two such failures starts the count again. The members say so in the launcher's directory, whose slots then
    # start no replacement (each would wait for a job that is gone).
    group = members(2)
    epochs = [m.epoch for m in group]
    why = "bagua MPI allreduce on communicator 'world' (rank 0 of 2): did not complete within 4 s"

    def fail_and_recover(epochs):
        group[0].fail(epochs[0], why)
        return [r.epoch for r in together([lambda m=m, e=e: m.recover(e) for m, e in zip(group, epochs)])]

    for transaction in (1, 2):
        for _ in range(RETRIES_WITHOUT_PROGRESS - 1):
            epochs = fail_and_recover(epochs)
            assert [(e.size, e.committed) for e in epochs] == [(2, transaction - 1)] * 2
        assert commit_all(group, transaction) == [True, True]
    for _ in range(RETRIES_WITHOUT_PROGRESS - 1):
        epochs = fail_and_recover(epochs)
    assert not job_stopped()
    group[0].fail(epochs[0], why)
    for member, epoch in zip(group, epochs):
        with pytest.raises(NoProgress, match=r"transaction 3 failed 3 times in a row.*within 4 s.*BAGUA_COMM_TIMEOUT"):
            member.recover(epoch)
    assert job_stopped()


def test_a_vote_ahead_costs_one_round_trip_and_the_last_one_two(members):
    group = members(2)
    requests = []
    for m in group:
        request = m.epoch.store._request
        m.epoch.store._request = lambda kind, *a, request=request, m=m, **k: (
            requests.append(m) or request(kind, *a, **k)
        )
    for transaction in (1, 2):
        requests.clear()
        assert group[0].vote_ahead(group[0].epoch, transaction)  # counted
        assert requests == [group[0]]
        assert group[1].vote_ahead(group[1].epoch, transaction)  # counted, then the register advanced
        assert requests == [group[0], group[1], group[1]]
    assert Decision.decode(group[0].epoch.store.check(f"{group[0].epoch.prefix()}decision")) == Decision(2)


def test_a_vote_ahead_after_this_members_record_went_out_is_refused(members):
    group = members(3)
    leaving = [m.epoch for m in group]
    die(group[2])
    recovered = together([lambda m=m, e=e: m.recover(e) for m, e in zip(group[:2], leaving)])
    assert [r.committed for r in recovered] == [0, 0]
    # a collective that completed after the record said "applied 0" must not be applied: the others went on at 0
    assert group[0].vote_ahead(leaving[0], 1) is False
    assert together([lambda m=m, r=r: m.vote_ahead(r.epoch, 1) for m, r in zip(group[:2], recovered)]) == [True] * 2


def test_a_joiner_is_admitted_after_the_next_commit_and_nothing_is_aborted(members):
    group = members(2)
    epochs = [m.epoch for m in group]  # each member's training thread keeps its own, as a front end does
    port = epochs[0].coordinator.port
    assert job_size(FAST, "127.0.0.1", port) == 2  # what a joiner compiles its step for (one more) before it asks
    joiner = []
    thread = threading.Thread(target=lambda: joiner.append(Membership.join(FAST, "127.0.0.1", port, timeout=20)))
    thread.start()
    deadline = time.monotonic() + 10
    transaction = 0
    while epochs[0].number == 0 and time.monotonic() < deadline:  # the members keep committing meanwhile
        transaction += 1
        assert together([lambda m=m, e=e: m.commit(e, transaction) for m, e in zip(group, epochs)]) == [True, True]
        if epochs[0].ended.is_set():  # ended after this commit: the next epoch admits the joiner
            epochs = [r.epoch for r in together([lambda m=m, e=e: m.recover(e) for m, e in zip(group, epochs)])]
    thread.join(20)
    try:
        new = joiner[0].epoch
        # every member applied exactly the transactions up to the new epoch's: none past the end of the old one
        assert new.size == 3 and new.rank == 2 and new.is_joiner() and new.committed == transaction
        assert [e.members for e in epochs] == [new.members] * 2
        assert job_size(FAST, "127.0.0.1", port) == 3 and job_size(FAST, "127.0.0.1", free_port()) is None
        everyone = [*group, joiner[0]]
        assert (
            together([lambda m=m, e=e: m.commit(e, transaction + 1) for m, e in zip(everyone, [*epochs, new])])
            == [True] * 3
        )
    finally:
        for j in joiner:
            j.close()


def test_a_joiner_waits_out_a_job_slow_to_admit_it_and_gives_up_only_when_no_member_is_left(members):
    group = members(2)
    epochs = [m.epoch for m in group]
    port = epochs[0].coordinator.port
    joiner = []
    thread = threading.Thread(target=lambda: joiner.append(Membership.join(FAST, "127.0.0.1", port, timeout=20)))
    thread.start()
    time.sleep(FAST.quorum_timeout + 0.5)  # no commit for longer than the quorum timeout: the coordinator answers
    assert thread.is_alive() and not joiner
    transaction = 0
    while epochs[0].number == 0:
        transaction += 1
        assert together([lambda m=m, e=e: m.commit(e, transaction) for m, e in zip(group, epochs)]) == [True, True]
        if epochs[0].ended.is_set():
            epochs = [r.epoch for r in together([lambda m=m, e=e: m.recover(e) for m, e in zip(group, epochs)])]
    thread.join(20)
    assert joiner[0].epoch.is_joiner()
    for member in [*joiner, *group]:
        die(member)  # every member gone at once
    started = time.monotonic()
    with pytest.raises(NoJobToJoin) as gone:
        Membership.join(FAST, "127.0.0.1", port, timeout=20)
    assert gone.value.code == NO_JOB_STATUS == 75 and "no member of the job answered for 3 s" in gone.value.message
    assert FAST.quorum_timeout <= time.monotonic() - started < FAST.quorum_timeout + 3


def test_a_joiner_left_without_anyone_holding_the_state_stops_rather_than_training_from_scratch(members):
    group = members(2)
    epochs = [m.epoch for m in group]
    joiner = []
    port = epochs[0].coordinator.port
    thread = threading.Thread(target=lambda: joiner.append(Membership.join(FAST, "127.0.0.1", port, timeout=20)))
    thread.start()
    transaction, deadline = 0, time.monotonic() + 10
    while epochs[0].number == 0 and time.monotonic() < deadline:
        transaction += 1
        assert together([lambda m=m, e=e: m.commit(e, transaction) for m, e in zip(group, epochs)]) == [True, True]
        if epochs[0].ended.is_set():
            epochs = [r.epoch for r in together([lambda m=m, e=e: m.recover(e) for m, e in zip(group, epochs)])]
    thread.join(20)
    try:
        admitted = joiner[0].epoch
        assert admitted.is_joiner() and admitted.committed == transaction > 0
        for m in group:  # both members go before the joiner was given the state
            die(m)
        with pytest.raises(NoQuorum, match="holds the job's state"):
            joiner[0].recover(admitted)
    finally:
        for j in joiner:
            j.close()


def test_members_voting_ahead_admit_a_joiner_one_step_later_so_that_none_applies_past_the_end(members):
    group = members(2)
    epochs = [m.epoch for m in group]
    register = f"{epochs[0].prefix()}decision"
    assert group[0].vote_ahead(epochs[0], 1)  # the first vote: this member goes on to step 2 at once
    joiner = []
    port = epochs[0].coordinator.port
    thread = threading.Thread(target=lambda: joiner.append(Membership.join(FAST, "127.0.0.1", port, timeout=20)))
    thread.start()
    deadline = time.monotonic() + 10
    while Decision.decode(epochs[0].store.check(register)).state == "open" and time.monotonic() < deadline:
        time.sleep(0.01)
    # The coordinator asks to end the epoch while step 1's last vote is out and member 0 computes step 2 already.
    assert Decision.decode(epochs[0].store.check(register)) == Decision(0, "wind")
    assert group[1].vote_ahead(epochs[1], 1) and not epochs[1].closed.is_set()  # step 1 does not end it: 2 runs
    assert together([lambda m=m, e=e: m.vote_ahead(e, 2) for m, e in zip(group, epochs)]) == [True, True]
    assert [e.ended.is_set() for e in epochs] == [True, True]  # step 2, voted by everyone, ends it
    recovered = together([lambda m=m, e=e: m.recover(e) for m, e in zip(group, epochs)])
    thread.join(20)
    try:
        assert [r.committed for r in recovered] == [2, 2] and joiner[0].epoch.committed == 2
        assert [r.epoch.joined for r in recovered] == [(joiner[0].me.id,)] * 2  # no member behind: nothing to heal
        assert recovered[0].epoch.state_holder == 0
    finally:
        for j in joiner:
            j.close()


# --- a hung member (a stopped process) -------------------------------------------------------

MEMBER = str(TESTS / "fault_tolerance_member.py")


class MemberProcess:
    """A member started as a process, its JSON lines read by a thread so that a test can wait for one with a
    timeout (a test that waits forever is a hung CI)."""

    def __init__(self, rank: int, n: int, port: int):
        env = {**os.environ, "PYTHONPATH": str(TESTS.parent)}
        self.rank = rank
        self.process = subprocess.Popen(
            [sys.executable, MEMBER, str(rank), str(n), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        self.output: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with self.process.stdout:  # closed at the member's end
            for line in self.process.stdout:
                self.output.append(line)
                self._lines.put(line)

    def next_event(self, timeout: float = 60.0) -> dict:
        """The member's next JSON line, within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"member {self.rank} printed no event within {timeout:g} s; its output: {''.join(self.output)}"
                ) from None
            if line.startswith("{"):
                return json.loads(line)

    def signal(self, sig: int) -> None:
        self.process.send_signal(sig)

    def end(self) -> None:
        self.process.send_signal(signal.SIGCONT)
        self.process.kill()
        self.process.wait()


def test_stopped_members_are_left_behind_after_dead_after_and_evicted_when_back():
    port = free_port()
    members = [MemberProcess(r, 4, port) for r in range(4)]
    try:
        assert [m.next_event()["epoch"] for m in members] == [0, 0, 0, 0]  # each once started
        for victim, survivors, size in ((2, (0, 1, 3), 3), (0, (1, 3), 2)):  # a member, then the coordinator
            members[victim].signal(signal.SIGSTOP)
            stopped = time.monotonic()
            events = [members[i].next_event() for i in survivors]
            seconds = time.monotonic() - stopped
            assert [e["size"] for e in events] == [size] * len(survivors), events
            assert len({e["committed"] for e in events}) == 1
            # detection takes dead_after (0.6 s) of missed heartbeats, then the survivors go on at once
            assert seconds < 0.6 + 2.0, f"{seconds:.2f} s"
        for victim in (2, 0):
            members[victim].signal(signal.SIGCONT)  # back, but the job went on without them
        assert [members[v].next_event() for v in (2, 0)] == [{"evicted": True}] * 2
    finally:
        for m in members:
            m.end()


def test_members_that_leave_together_are_not_taken_for_failures(members):
    group = members(3)
    assert commit_all(group, 1) == [True, True, True]
    epochs = [m.epoch for m in group]
    group[2].close()  # leaves on purpose, first
    time.sleep(3 * FAST.heartbeat_period)
    assert not any(e.closed.is_set() for e in epochs[:2])  # the others' epoch goes on
    started = time.monotonic()
    together([group[0].close, group[1].close])  # the coordinator waits for the last one to leave
    assert time.monotonic() - started < FAST.dead_after


def test_a_member_whose_store_drops_connections_while_its_process_ends_is_taken_for_ended():
    # A SIGKILLed member's connections close before its store's listener: a probe in between completes the
    # connection and is dropped without a greeting ("silent"). Taken for alive, the member's departure waited for
    # its heartbeats (3 s in a test job) instead of being noticed at once.
    listener = socket.create_server(("127.0.0.1", 0))
    member = Member("dying", "127.0.0.1", listener.getsockname()[1])
    listener.settimeout(0.02)

    def drop_connections_then_close() -> None:
        deadline = time.monotonic() + 0.2
        while time.monotonic() < deadline:
            try:
                listener.accept()[0].close()
            except TimeoutError:
                pass
        listener.close()

    ending = threading.Thread(target=drop_connections_then_close)
    ending.start()
    try:
        assert probe(member, SECRET)[0] == "silent"  # what one probe says meanwhile
        assert process_ended(member, SECRET)
    finally:
        ending.join()
    server = KVServer("127.0.0.1", secret=SECRET)
    try:
        assert not process_ended(Member("alive", "127.0.0.1", server.port), SECRET)
    finally:
        server.close()
    with socket.create_server(("127.0.0.1", 0)) as stopped:  # connections complete, nobody answers: a stopped one
        assert not process_ended(Member("stopped", "127.0.0.1", stopped.getsockname()[1]), SECRET)


def test_a_members_training_place_leaves_out_the_ranks_sitting_out():
    members = tuple(Member(f"m{r}", "127.0.0.1", 1000 + r) for r in range(5))
    places = [Epoch(1, members, rank, 0).training_place({1, 3}) for rank in range(5)]
    assert places == [(0, 3), (0, 3), (1, 3), (0, 3), (2, 3)]  # ranks 0, 2, 4 train; 1 and 3 sit out at place 0
    assert [Epoch(1, members, rank, 0).training_place() for rank in range(5)] == [(r, 5) for r in range(5)]

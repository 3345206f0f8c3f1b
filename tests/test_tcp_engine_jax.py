"""The JAX NativeCommunicator over the TCP engine: every collective against NumPy, and what a membership change
needs of it (a dead peer failing the others at once, a revoke, shrinking to the survivors, admitting a newcomer, a build
abandoned when the members change again, one timed out taken for a change too, and ranks that call different
collectives told so)."""

import numpy as np
import pytest
from every_primitive import check_every_primitive
from multiprocess import run_ranks

from bagua_common.fault_tolerance.kv_store import KVServer

SECRET = b"the tcp engine test's job secret"


@pytest.fixture
def store_port():
    server = KVServer("127.0.0.1", secret=SECRET)
    yield server.port
    server.close()


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_primitive_matches_numpy(store_port, ranks):
    results = run_ranks("tcp_engine_workers_jax:every_primitive", ranks, store_port, SECRET, 7)
    check_every_primitive([r.value for r in results], 7)


@pytest.mark.parametrize(
    ("hosts", "early"),
    [(["127.0.0.1", "127.0.0.2"], False), (["127.0.0.1", "127.0.0.1"], True)],
    ids=["two-hosts", "one-host"],
)
def test_send_recv_to_another_host_sends_nothing_before_the_peer_is_ready(store_port, hosts, early):
    # Sent eagerly, rank 0's data would fill rank 1's socket while rank 1 is still elsewhere (at a step, or receiving
    # another peer's exchange), and on slow links the ranks drift into sharing them. Two addresses of the loopback
    # stand for two hosts; on one host (nothing shared but memory) the data goes at once.
    count, late_seconds = 1 << 20, 1.5
    ranks = run_ranks("tcp_engine_workers_jax:late_peer", 2, store_port, SECRET, count, late_seconds, hosts)
    for rank, result in enumerate(r.value for r in ranks):
        np.testing.assert_array_equal(result["received"], np.full(count, 2.0 - rank, np.float32))
    assert (ranks[1].value["sent_while_late"] > 16384) == early, ranks[1].value


def test_a_dead_peer_fails_the_survivors_at_once_and_they_shrink_to_themselves(store_port):
    results = run_ranks("tcp_engine_workers_jax:survive_a_death", 3, store_port, SECRET, 1, check=False)
    survivors = [results[0].value, results[2].value]
    assert results[1].returncode == 3
    for new_rank, survivor in enumerate(survivors):
        assert survivor is not None, results
        assert survivor["first"] == 6.0  # 1 + 2 + 3
        assert "closed its connection" in survivor["error"], survivor  # rank 1's, or a survivor's that saw it first
        assert survivor["seconds"] < 5, survivor  # not the 30-s timeout
        assert survivor["rank"] == new_rank
        assert survivor["after"] == 4.0  # 1 + 3


def test_ranks_that_call_different_collectives_are_told_so(store_port):
    errors = [r.value for r in run_ranks("tcp_engine_workers_jax:mismatched_allreduces", 2, store_port, SECRET)]
    assert any("did not call the same collectives in the same order" in error for error in errors), errors
    assert all("did not call the same" in error or "closed its connection" in error for error in errors), errors


def test_a_revoke_ends_a_wait_at_once_naming_why(store_port):
    waiter = run_ranks("tcp_engine_workers_jax:revoked_while_waiting", 2, store_port, SECRET)[0].value
    assert "revoked: member 1 was taken for dead" in waiter["error"]
    assert waiter["seconds"] < 3, waiter


def test_a_newcomer_is_admitted_as_the_last_rank(store_port):
    results = sorted(
        (r.value for r in run_ranks("tcp_engine_workers_jax:grow_by_one", 3, store_port, SECRET)),
        key=lambda r: r["rank"],
    )
    assert [r["rank"] for r in results] == [0, 1, 2] and {r["size"] for r in results} == {3}
    for r in results[:2]:
        np.testing.assert_array_equal(r["before"], np.full(3, 3.0))
    for r in results:
        np.testing.assert_array_equal(r["after"], np.full(3, 6.0))


def test_a_build_waiting_for_a_rank_is_abandoned_at_once_and_the_others_build_again(store_port):
    results = run_ranks("tcp_engine_workers_jax:abandoned_rebuild", 3, store_port, SECRET)
    for waiting in (results[0].value, results[2].value):  # rank 0 accepting rank 1, rank 2 connecting to it
        assert "tcp_build of 'world'" in waiting["error"] and "was abandoned" in waiting["error"], waiting
        assert waiting["seconds"] < 3, waiting  # not the 30-s timeout
        assert waiting["size"] == 2
        np.testing.assert_array_equal(waiting["after"], np.full(3, 4.0))  # 1 + 3


def test_a_build_timed_out_waiting_for_a_rank_is_a_failure_the_next_epoch_retries():
    # A member alive but still in its step (slower than the build's timeout) when the others rebuild after a change:
    # the epoch fails and the survivors take the next one, as when a collective times out, instead of ending with
    # the error (a member slow every time ends the job with NoProgress instead, as slow collectives do).
    from bagua_common.comm import tcp_rendezvous
    from bagua_common.comm.key_value_store import BuildIncomplete
    from bagua_jax.epoch_communicator import communication_failure

    server = KVServer("127.0.0.1", secret=SECRET)
    try:
        with pytest.raises(BuildIncomplete) as timed_out:
            tcp_rendezvous.assemble(None, server.in_process_client(), "e1/", 0, 2, "127.0.0.1:1", "world", 0.2)
    finally:
        server.close()
    assert "'e1/address/1'" in str(timed_out.value) and "timeout" in str(timed_out.value)
    assert communication_failure(timed_out.value)
    assert not communication_failure(TimeoutError("a timeout of the user's own code, before the build's timeout"))

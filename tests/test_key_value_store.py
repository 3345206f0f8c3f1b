"""The rendezvous' waits on the job's store (bagua_common.comm.key_value_store, and the MPI newcomer's in
mpi_rendezvous), on a real store server."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bagua_common.comm import mpi_rendezvous
from bagua_common.comm.key_value_store import BuildIncomplete, meet
from bagua_common.fault_tolerance.kv_store import KVServer

SECRET = b"the key-value store test's job secret"


@pytest.fixture
def server():
    server = KVServer("127.0.0.1", secret=SECRET)
    yield server
    server.close()


def test_ranks_that_meet_return_once_the_last_one_arrived(server):
    arrived: dict[int, float] = {}

    def rank(r: int) -> float:
        time.sleep(0.3 * r)  # rank 2 comes last
        arrived[r] = time.monotonic()
        meet(server.in_process_client(), "e1/shrink/", r, 3, timeout=10)
        return time.monotonic()

    with ThreadPoolExecutor(3) as pool:
        returned = list(pool.map(rank, range(3)))
    assert min(returned) >= arrived[2]  # nobody left before the last arrival
    assert max(returned) - arrived[2] < 1.0


def test_a_meeting_a_rank_never_reaches_fails_after_the_timeout_naming_it(server):
    started = time.monotonic()
    with pytest.raises(BuildIncomplete, match=r"'e1/shrink/arrived/1'.*timeout"):
        meet(server.in_process_client(), "e1/shrink/", 0, 2, timeout=0.5)
    assert 0.5 <= time.monotonic() - started < 3


def test_a_meeting_is_abandoned_at_once_when_its_members_change(server):
    abandoned = threading.Event()
    threading.Timer(0.2, abandoned.set).start()
    started = time.monotonic()
    with pytest.raises(BuildIncomplete, match="abandoned"):
        meet(server.in_process_client(), "e1/shrink/", 0, 2, timeout=30, abandoned=abandoned)
    assert time.monotonic() - started < 2  # not the 30-s timeout


@pytest.mark.parametrize("ends", ["timeout", "abandoned"])
def test_an_mpi_newcomer_whose_group_never_opens_its_port_gives_up_before_touching_mpi(server, ends):
    # The newcomer of a failed admission: its epoch closes (abandoned), or the group never comes (timeout). It raises
    # what the other builds raise, before any MPI call (no engine is given: one would raise AttributeError).
    abandoned = threading.Event()
    threading.Timer(0.2, abandoned.set).start()
    timeout, pattern = (0.5, r"'e1/port/2'.*timeout") if ends == "timeout" else (30, "abandoned")
    started = time.monotonic()
    with pytest.raises(BuildIncomplete, match=pattern):
        mpi_rendezvous.assemble(
            None,
            server.in_process_client(),
            "e1/",
            2,
            3,
            None,
            2,
            "world",
            timeout,
            None if ends == "timeout" else abandoned,
        )
    assert time.monotonic() - started < 2  # not the 30-s timeout

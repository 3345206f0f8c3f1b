"""The rendezvous' waits on the job's store (bagua_common.comm.key_value_store), on a real store server."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

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

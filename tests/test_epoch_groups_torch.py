"""The process groups of a fault-tolerant job's epoch outlive every reference to them.

A group may still hold an abandoned operation, or be in use by the thread that sends a joiner the state, when
its epoch is left; destroying a gloo group then throws from its threads, which aborts the process. So each group
is kept alive as it is made, not when the epoch is left (a thread's group made after that would escape).
"""

from __future__ import annotations

import gc
import os
import threading
import time

import pytest
import torch

from bagua_common.fault_tolerance import Epoch, MembershipChanged
from bagua_common.fault_tolerance.epoch import Member
from bagua_common.fault_tolerance.kv_store import KVServer
from bagua_torch.communicator import epoch_groups
from bagua_torch.communicator.protocol import CommunicationError


def _threads() -> set[str]:
    """The ids of the process's threads (other tests' threads may end meanwhile: compare sets, not counts)."""
    return set(os.listdir("/proc/self/task"))


def test_a_pair_group_with_an_operation_pending_is_never_destroyed():
    server = KVServer("127.0.0.1", secret=b"s" * 32)
    try:
        members = (Member("holder", "127.0.0.1", server.port), Member("joiner", "127.0.0.1", server.port))
        epochs = [Epoch(1, members, rank, 1, store=server.in_process_client()) for rank in range(2)]
        made: dict[int, object] = {}

        def make(rank: int) -> None:
            made[rank] = epoch_groups.pair_communicator(epochs[rank], 0, 1, "gloo", 30.0)

        before = _threads()
        makers = [threading.Thread(target=make, args=(rank,)) for rank in range(2)]
        for maker in makers:
            maker.start()
        for maker in makers:
            maker.join()
        # a joined thread may linger in the process's list for a moment (the makers', the connecting ones): the
        # groups' threads are those still there a moment later
        made_now = _threads()
        time.sleep(0.5)
        groups_threads = (made_now & _threads()) - before - {str(maker.native_id) for maker in makers}
        assert groups_threads  # gloo's own threads, one set per group
        pending = made[1].group.allreduce([torch.ones(4)])  # the holder never takes part: left pending
        del pending
        made.clear()
        gc.collect()
        assert groups_threads <= _threads()  # destroyed groups would have stopped their threads
    finally:
        server.close()


def test_a_group_whose_peer_died_after_the_rendezvous_gives_up_when_the_epoch_fails():
    # gloo's connect to a peer that published its address and died waits out the group's whole timeout: the epoch's
    # failure must end it (the survivors then recover instead of hanging in the group's construction)
    epoch = Epoch(1, (Member("survivor", "127.0.0.1", 1), Member("dead", "127.0.0.1", 2)), 0, 1)
    never = threading.Event()
    threading.Timer(0.3, epoch.mark_failed).start()
    started = time.monotonic()
    with pytest.raises(MembershipChanged, match="changed while it connected"):
        epoch_groups._connect(epoch, "trainers/1", never.wait)
    assert time.monotonic() - started < 2.0
    never.set()


def test_a_group_that_could_not_connect_is_a_communication_error_naming_it():
    epoch = Epoch(1, (Member("survivor", "127.0.0.1", 1), Member("dead", "127.0.0.1", 2)), 0, 1)

    def refused():
        raise RuntimeError("Connection refused")

    with pytest.raises(CommunicationError, match="'trainers/1' of epoch 1 could not connect: Connection refused"):
        epoch_groups._connect(epoch, "trainers/1", refused)

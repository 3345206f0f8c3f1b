"""The relay between the nodes' directories of a fault-tolerant job (bagua_launch.directory_relay).

Two directories (the KVServers each node's launcher hosts) and a torch TCPStore standing for the agents'
rendezvous store, in this process: what a member writes into one directory reaches the other, the newer
coordinator pointer wins over an older one, the end reaches a node nobody told, and a value written into the
rendezvous store without the tag of the job's secret is ignored.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta

import pytest

from bagua_common.fault_tolerance.kv_store import KVClient, KVServer
from bagua_common.fault_tolerance.node_directory import CURRENT, FINISHED
from bagua_common.job.message_tag import message_tag

torch_distributed = pytest.importorskip("torch.distributed")

from bagua_launch.directory_relay import PERIOD_S, DirectoryRelay  # noqa: E402 (needs torch)

SECRET = b"0123456789abcdef-relay"
RUN_ID = "relay-test"


def pointer(epoch: int) -> bytes:
    return json.dumps({"epoch": epoch, "host": "10.0.0.1", "port": 4000 + epoch}).encode()


def eventually(read, expected, seconds: float = 10.0):
    deadline = time.monotonic() + seconds
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def test_directories_agree_on_the_newest_pointer_and_the_end_and_ignore_forgeries():
    rendezvous = torch_distributed.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10))
    servers = [KVServer("127.0.0.1", secret=SECRET) for _ in range(2)]
    clients = [KVClient("127.0.0.1", s.port, 5.0, secret=SECRET) for s in servers]
    relays = [DirectoryRelay(("127.0.0.1", s.port), ("127.0.0.1", rendezvous.port), RUN_ID, SECRET) for s in servers]
    try:
        a, b = clients
        a.set(CURRENT, pointer(3))
        assert eventually(lambda: b.check(CURRENT), pointer(3)) == pointer(3)
        b.set(CURRENT, pointer(2))  # a node whose members knew only an older epoch
        assert eventually(lambda: b.check(CURRENT), pointer(3)) == pointer(3)
        assert a.check(CURRENT) == pointer(3)
        forged = pointer(99)
        tag = message_tag(b"not the job's secret", b"directory relay", CURRENT.encode(), forged)
        rendezvous.set(f"bagua/{RUN_ID}/directory/{CURRENT}", tag + forged)
        b.set(FINISHED, b"17")
        assert eventually(lambda: a.check(FINISHED), b"17") == b"17"
        time.sleep(3 * PERIOD_S)  # both relays have read the forged pointer meanwhile
        assert a.check(CURRENT) == pointer(3) and b.check(CURRENT) == pointer(3)
    finally:
        for relay in relays:
            relay.stop()
        for client, server in zip(clients, servers):
            client.close()
            server.close()

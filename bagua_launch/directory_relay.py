"""The nodes' directories of a fault-tolerant job kept in step through the rendezvous store.

Each node's launcher hosts a directory (:mod:`bagua_common.fault_tolerance.node_directory`) that only that node's
ranks reach, and only they write into it: where the job's coordinator is, and that the job finished. On a node
whose ranks all died, nobody is left to write either, so its replacement would look for the coordinator where it
no longer is, or wait to join a job that has ended (and the agents of the other nodes, waiting for this one at
their exit barrier, with it). The relay copies both between the directories through the rendezvous store, which
every node's launcher reaches: the coordinator pointer of the newest epoch, and the end.

The rendezvous store takes writes from anyone who reaches it, so what the relay puts there carries a tag of the
job's secret (:mod:`bagua_common.job.message_tag`), and a value without a valid one is ignored.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta

from bagua_common.fault_tolerance.kv_store import KVClient, StoreUnreachable
from bagua_common.fault_tolerance.node_directory import CURRENT, FINISHED
from bagua_common.job.message_tag import TAG_BYTES, message_tag, tag_matches

__all__ = ["DirectoryRelay"]

PERIOD_S = 0.5
"""How often the relay compares this node's directory with the rendezvous store."""

_PURPOSE = b"directory relay"


class DirectoryRelay:
    """A thread relaying this node's directory (``directory``: its address) to and from the rendezvous store at
    ``rendezvous`` (``host, port``) under the job's ``run_id``, until :meth:`stop`."""

    def __init__(self, directory: tuple[str, int], rendezvous: tuple[str, int], run_id: str, secret: bytes):
        self._directory, self._rendezvous, self._secret = directory, rendezvous, secret
        self._prefix = f"bagua/{run_id}/directory/"
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bagua-directory-relay", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop relaying (the job ended on this node). The thread ends after its exchange in flight; it is a daemon,
        so a rendezvous store that no longer answers does not hold the launcher."""
        self._stopped.set()
        self._thread.join(timeout=2 * PERIOD_S)

    def _run(self) -> None:
        from torch.distributed import TCPStore

        shared = local = None
        try:
            while not self._stopped.wait(PERIOD_S):
                try:
                    if shared is None:
                        host, port = self._rendezvous
                        shared = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=5))
                    if local is None:
                        local = KVClient(*self._directory, 5.0, secret=self._secret)
                    for key in (FINISHED, CURRENT):
                        self._exchange(key, local, shared)
                except StoreUnreachable:
                    local = None  # the launcher is closing its directory
                except RuntimeError:  # torch's store errors: the rendezvous's host is gone or restarting
                    shared = None
        finally:
            if local is not None:
                local.close()

    def _exchange(self, key: str, local: KVClient, shared) -> None:
        mine = local.check(key)
        theirs = self._verified(key, shared.get(self._prefix + key)) if shared.check([self._prefix + key]) else None
        newest = _newest(key, mine, theirs)
        if newest is None:
            return
        if newest != mine:
            local.set(key, newest)
        if newest != theirs:
            shared.set(self._prefix + key, message_tag(self._secret, _PURPOSE, key.encode(), newest) + newest)

    def _verified(self, key: str, stored: bytes) -> bytes | None:
        tag, value = stored[:TAG_BYTES], stored[TAG_BYTES:]
        return value if tag_matches(tag, self._secret, _PURPOSE, key.encode(), value) else None


def _newest(key: str, mine: bytes | None, theirs: bytes | None) -> bytes | None:
    """The value both sides should hold: the end once either has it; the pointer of the later epoch."""
    if mine is None or theirs is None:
        return mine if theirs is None else theirs
    if key == CURRENT:
        return max(mine, theirs, key=lambda pointer: json.loads(pointer)["epoch"])
    return mine

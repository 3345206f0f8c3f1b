"""TCP communicators built through the job's key-value store: a world, and every membership after it.

The TCP engine (``xla_ffi/tcp_communicator.h``) connects every pair of ranks directly, each process listening on
one socket on the address the job uses. The store, which only the job's processes can write, carries each rank's
address and a random token that introduces every connection of one build, so that a process outside the job cannot
take a rank's place. Every membership's communicator is built afresh this way, whatever the communicator each rank
held before, so a build that failed (a rank died before connecting) can be made again under another prefix; the
engine's shrink and split need no store (their tokens derive from the communicator's own). Each function works on
the engine module's integer handles; the front ends wrap them (``bagua_jax.NativeCommunicator``).
"""

from __future__ import annotations

import secrets
import threading
import time
from types import ModuleType

from bagua_common.comm.key_value_store import KeyValueStore, wait_for

__all__ = ["assemble"]


def assemble(
    tcp: ModuleType,
    store: KeyValueStore,
    prefix: str,
    rank: int,
    size: int,
    address: str,
    name: str,
    timeout: float,
    abandoned: threading.Event | None = None,
) -> int:
    """The handle of a communicator of ``size`` ranks, this process being ``rank`` and listening at ``address`` (the
    engine's ``listen``). Every rank calls it with the same ``prefix`` (a store prefix no earlier call used) and
    ``size``. Fails rather than wait past ``timeout`` seconds for a rank (for its address in the store, then for its
    connection), and at once when ``abandoned`` is set (the members it was for changed meanwhile): with
    :class:`~bagua_common.comm.key_value_store.BuildIncomplete` while it waits for the store, with the engine's error
    once it connects. The communicator's operations wait ``timeout`` seconds at most.
    """
    if not 0 <= rank < size:
        raise ValueError(f"assemble: need 0 <= rank < size, got {rank=}, {size=}")
    store.set(f"{prefix}address/{rank}", address)
    if rank == 0:
        store.set(f"{prefix}token", secrets.token_hex(16))
    deadline = time.monotonic() + timeout
    token = wait_for(store, f"{prefix}token", deadline, abandoned)
    if abandoned is not None:  # from now on: the others may connect with the token, parked here until it goes
        threading.Thread(target=_abandon_when, args=(tcp, token, abandoned), name="bagua-abandon", daemon=True).start()
    addresses = [wait_for(store, f"{prefix}address/{r}", deadline, abandoned) for r in range(size)]
    return tcp.build(token, rank, addresses, name, timeout)  # the communicator's operations wait as long


def _abandon_when(tcp: ModuleType, token: str, abandoned: threading.Event) -> None:
    abandoned.wait()
    tcp.abandon(token)

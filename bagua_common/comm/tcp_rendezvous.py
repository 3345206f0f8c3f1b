"""TCP communicators built through the job's key-value store: a world, and a group that admits newcomers.

The TCP engine (``xla_ffi/tcp_communicator.h``) connects every pair of ranks directly, each process listening on
one socket on the address the job uses. The store, which only the job's processes can write, carries each rank's
address and a random token that introduces every connection of one build, so that a process outside the job cannot
take a rank's place. Shrinking to the survivors and splitting need no store: the engine derives their tokens from
the communicator's own. Each function works on the engine module's integer handles; the front ends wrap them
(``bagua_jax.NativeCommunicator``).
"""

from __future__ import annotations

import secrets
from types import ModuleType

from bagua_common.comm.mpi_rendezvous import KeyValueStore

__all__ = ["assemble"]


def assemble(
    tcp: ModuleType,
    store: KeyValueStore,
    prefix: str,
    rank: int,
    size: int,
    address: str | None,
    group: int | None,
    start: int,
    name: str,
    timeout: float,
) -> int:
    """The handle of a communicator of ``size`` ranks: ranks ``0..start-1`` bring ``group`` (their communicator,
    in rank order), ranks ``start..size-1`` are newcomers that bring the ``address`` they listen at (the engine's
    ``listen``). Every rank calls it with the same ``prefix`` (a store prefix no earlier call used), ``size`` and
    ``start``; ``group`` is destroyed. ``start=0`` builds a world. Fails rather than wait past ``timeout`` seconds for
    a rank.
    """
    if not 0 <= start <= size or not 0 <= rank < size:
        raise ValueError(f"assemble: need 0 <= start <= size and 0 <= rank < size, got {start=}, {size=}, {rank=}")
    if (group is None) != (rank >= start) or (address is None) != (rank < start):
        raise ValueError(
            f"assemble: ranks below start={start} bring their communicator, the others an address ({rank=})"
        )
    if address is not None:
        store.set(f"{prefix}address/{rank}", address)
    if rank == 0:  # the group's addresses for the newcomers, and the build's token
        if group is not None:
            for member, address in enumerate(tcp.addresses(group)):
                store.set(f"{prefix}address/{member}", address)
        store.set(f"{prefix}token", secrets.token_hex(16))
    if group is not None:
        tcp.destroy(group)
    token, *addresses = (
        _wait(store, f"{prefix}{key}", timeout) for key in ["token", *map("address/{}".format, range(size))]
    )
    return tcp.build(token, rank, addresses, name, timeout)


def _wait(store: KeyValueStore, key: str, timeout: float) -> str:
    value = store.get(key, wait=timeout)
    if value is None:
        raise TimeoutError(f"assemble: nothing under {key!r} in the job's store within {timeout} s")
    return value.decode() if isinstance(value, bytes) else value

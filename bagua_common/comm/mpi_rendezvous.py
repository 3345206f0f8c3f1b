"""MPI communicators whose membership can change: built through a key-value store, shrunk to the survivors.

The installed MPICH cannot do this with ULFM: in its ch4 device ``MPIX_Comm_revoke``, ``MPIX_Comm_shrink`` and
``MPIX_Comm_agree`` abort the process (``MPIR_Assert(0)`` stubs in ``src/mpid/ch4/src/ch4_comm.c``), and hydra kills
the other ranks of a node when one of them is killed by a signal, whatever ``-disable-auto-cleanup`` says
(``src/pm/hydra/proxy/pmip.c``). So every rank of a job that must survive a death runs as its own
``mpiexec -n 1`` job, and the ranks find each other through the job's store:

* :func:`assemble`: ranks ``start..size-1`` join the ``start`` ranks already in a communicator one at a time
  (``MPI_Comm_accept`` on the group, ``MPI_Comm_connect`` on the newcomer, then a merge), the port's name passed
  through the store; with ``start=0`` this builds a world, with the survivors' communicator it admits joiners, and
  the group gives up together a newcomer that never connects;
* :func:`shrink`: the survivors alone build their communicator from the old one (``MPI_Comm_create_group``, which
  only the members take part in), whatever became of the others.

Ports need MPICH's ofi netmod over TCP: the UCX netmod's address does not fit in ``MPI_MAX_PORT_NAME``
(:data:`PORT_ENVIRONMENT`, set before MPI starts). And each rank needs an ``mpiexec`` of its own: MPI started
without one (a singleton) gives every such process the same identity, so two of them cannot connect
(``MPIDI_check_disjoint_lpids``: "both contain process 0"); :func:`prepare_rank` checks both before MPI starts. Each
function works on the engine module's integer handles; the front ends wrap them (``bagua_jax.NativeCommunicator``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from types import ModuleType

from bagua_common.comm.key_value_store import BuildIncomplete, KeyValueStore, wait_for

__all__ = [
    "ACCEPT_WAIT_SECONDS",
    "DEAD_PEER_ENVIRONMENT",
    "PORT_ENVIRONMENT",
    "PROCESS_MANAGER_VARIABLES",
    "assemble",
    "prepare_rank",
    "shrink",
]

PORT_ENVIRONMENT = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}
"""MPICH settings (read when MPI starts) under which ``MPI_Open_port`` works."""

DEAD_PEER_ENVIRONMENT = {"MPIR_CVAR_CH4_OFI_MAX_EAGAIN_RETRY": "20000"}
"""MPICH settings (read when MPI starts) under which a send to a peer that died gives up within a fraction of a
second instead of retrying the refused connection forever (its collective fails, and the survivors' shrink does not
wait for it). The engine connects every pair of ranks while it builds a communicator, under a larger bound
(``PatientSends`` in ``xla_ffi/mpi_runtime.h``), so that a live peer is never given up on."""


ACCEPT_WAIT_SECONDS = 2
"""How long the group's ``MPI_Comm_accept`` waits for a newcomer at a time (MPICH counts whole seconds) before the
group decides together whether to wait on: a pending accept cannot be abandoned, so a newcomer that died before it
connected is given up within this much of the moment its epoch closed. MPICH's exchange with a newcomer that did
connect must complete within it too."""

PROCESS_MANAGER_VARIABLES = ("PMI_FD", "PMI_PORT", "PMIX_RANK")
"""Variables ``mpiexec`` gives the processes it starts (MPICH's hydra: ``PMI_FD`` or ``PMI_PORT``; PMIx launchers:
``PMIX_RANK``): a process with none of them would start MPI as a singleton."""


def prepare_rank() -> None:
    """Before MPI starts in a rank of a world built through a store: refuse a process that no ``mpiexec`` started
    (a ``RuntimeError`` naming how to start it), and select MPICH's ofi netmod over TCP and its bound on a send to
    a dead peer, unless the environment chose otherwise."""
    if not any(os.environ.get(name) for name in PROCESS_MANAGER_VARIABLES):
        raise RuntimeError(
            "the MPI engine's fault-tolerant world needs every rank to run as its own `mpiexec -n 1` job, and this "
            "process was not started by mpiexec: MPI started without one gives every such process the same "
            "identity, so they cannot connect to each other. Start the ranks with `bagua-launch --fault-tolerant "
            "--mpi ...` (each rank and each replacement under its own `mpiexec -n 1`), or each with "
            "`mpiexec -n 1 python ...`"
        )
    for name, value in {**PORT_ENVIRONMENT, **DEAD_PEER_ENVIRONMENT}.items():
        os.environ.setdefault(name, value)


def assemble(
    mpi: ModuleType,
    store: KeyValueStore,
    prefix: str,
    rank: int,
    size: int,
    group: int | None,
    start: int,
    name: str,
    timeout: float,
    abandoned: threading.Event | None = None,
) -> int:
    """The handle of a communicator of ``size`` ranks: ranks ``0..start-1`` bring ``group`` (their communicator,
    in rank order; None on the newcomers), ranks ``start..size-1`` join it in that order. Every rank calls it with
    the same ``prefix`` (a store prefix no earlier call used), ``size`` and ``start``; ``group`` is destroyed.

    ``start=0`` builds a world (rank 0 starts from a communicator of itself alone). A newcomer waits up to
    ``timeout`` seconds for the group's port, and the group for the newcomer to connect; either raises
    :class:`~bagua_common.comm.key_value_store.BuildIncomplete` past it or as soon as ``abandoned`` is set (on any
    rank of the group: nothing is connected yet, ``group`` is destroyed); each later step fails rather than wait past
    ``timeout``.
    """
    if not 0 <= start <= size or not 0 <= rank < size:
        raise ValueError(f"assemble: need 0 <= start <= size and 0 <= rank < size, got {start=}, {size=}, {rank=}")
    if (group is None) != (rank >= start):
        raise ValueError(f"assemble: ranks below start={start} bring their communicator, the others none ({rank=})")
    if start == 0:
        start = 1
        if rank == 0:
            group = mpi.self(name, timeout)
    for newcomer in range(start, size):
        key = f"{prefix}port/{newcomer}"
        if rank < newcomer:
            port = ""
            if mpi.rank(group) == 0:
                port = mpi.open_port()
                store.set(key, port)
            try:
                grown = _accepted(mpi, group, port, name, time.monotonic() + timeout, abandoned)
            finally:
                mpi.destroy(group)
            # Only a port the newcomer connected to is closed: MPICH gives a closed port's tag to the next port, which
            # a connect still on its way to a port given up would reach.
            if port:
                mpi.close_port(port)
            group = grown
        elif rank == newcomer:
            port = wait_for(store, key, time.monotonic() + timeout, abandoned)
            group = mpi.connect(port, name, timeout)
    if mpi.size(group) != size or mpi.rank(group) != rank:
        raise RuntimeError(
            f"assemble: built rank {mpi.rank(group)} of {mpi.size(group)} instead of {rank} of {size}: the ranks "
            "disagreed on the order"
        )
    return group


def _accepted(
    mpi: ModuleType, group: int, port: str, name: str, deadline: float, abandoned: threading.Event | None
) -> int:
    """The handle of ``group`` grown by the process that connects to ``port``, accepted :data:`ACCEPT_WAIT_SECONDS`
    at a time until the group agrees to give it up: ``abandoned`` set on any of its ranks, or ``deadline`` passed."""
    while True:
        grown = mpi.accept(group, port, name, ACCEPT_WAIT_SECONDS)
        if grown is not None:
            return grown
        give_up = time.monotonic() > deadline or (abandoned is not None and abandoned.is_set())
        if mpi.any(group, give_up):
            raise BuildIncomplete(
                f"MPI accept into {name!r}: the newcomer did not connect within the timeout, or the members it was "
                "for changed first"
            )


def shrink(mpi: ModuleType, handle: int, members: Sequence[int], name: str) -> int:
    """The handle of a communicator of the ranks ``members`` of ``handle`` (member i becomes rank i).

    Only the members call it, each with the same list (the survivors of a membership change, in the order the
    job agreed); it fails instead of waiting past ``handle``'s timeout when a member died meanwhile.
    """
    return mpi.shrink(handle, [int(m) for m in members], name)

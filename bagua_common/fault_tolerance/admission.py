"""Admission of a process joining a running job: finding the job's coordinator and waiting to be let in.

A joiner asks the stores it knows (this node's launcher directory, ``MASTER_ADDR:MASTER_PORT``, the peers
given) where the coordinator is (``ft/current``), writes a request there (``ft/request/<n>``) and waits for
``ft/admit/<id>``, the epoch that admits it; the coordinator admits it at the epoch's next boundary
(:mod:`.formation`). When the coordinator changes meanwhile, it asks the new one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import closing

from bagua_common.fault_tolerance import node_directory
from bagua_common.fault_tolerance.epoch import Epoch, Member, read_epoch
from bagua_common.fault_tolerance.errors import NoJobToJoin
from bagua_common.fault_tolerance.kv_store import KVClient, StoreUnreachable
from bagua_common.fault_tolerance.settings import ENV_PEERS, FaultToleranceSettings

__all__ = ["await_admission", "job_size", "stores_to_ask"]


def stores_to_ask(master_addr: str, master_port: int, peers: Sequence[str] | None) -> list[tuple[str, int]]:
    """Where a joiner asks for the coordinator, in order: this node's directory, ``master_addr:master_port``, then
    ``peers`` (``host:port``; default ``BAGUA_FT_PEERS``, comma-separated)."""
    if peers is None:
        peers = [p for p in os.environ.get(ENV_PEERS, "").split(",") if p.strip()]
    directory = node_directory.address()
    addresses = [directory] if directory else []
    addresses.append((master_addr, int(master_port)))
    for peer in peers:
        host, _, port = peer.strip().rpartition(":")
        addresses.append((host, int(port)))
    return addresses


def await_admission(
    settings: FaultToleranceSettings, me: Member, addresses: Sequence[tuple[str, int]], timeout: float
) -> Epoch:
    """Request admission for ``me`` at the coordinator the ``addresses`` point to (once per coordinator) and return
    the epoch that admits it; TimeoutError after ``timeout`` seconds, JobFinished when a store says the job ended,
    NoJobToJoin when no coordinator answered for the settings' ``quorum_timeout`` (every member is gone)."""
    started = time.monotonic()
    answered = started  # when a coordinator last answered
    requested_at = None
    while True:
        now = time.monotonic()
        if now - started > timeout:
            raise TimeoutError(f"fault tolerance: not admitted to the job within {timeout:g} s")
        if now - answered > settings.quorum_timeout:
            where = ", ".join(f"{host}:{port}" for host, port in addresses)
            message = (
                f"no member of the job answered for {settings.quorum_timeout:g} s (asked {where}): every member is "
                "gone, so there is no running job to join; restart the whole job from its last checkpoint"
            )
            print(f"bagua fault tolerance: {message}", file=sys.stderr, flush=True)
            raise NoJobToJoin(message)
        coordinator = _find_coordinator(settings, addresses)
        if coordinator is None:
            time.sleep(settings.heartbeat_period)
            continue
        try:
            if coordinator.address != requested_at:
                index = coordinator.add("ft/requests", 1)
                coordinator.set(f"ft/request/{index}", json.dumps(me.as_json()))
                requested_at = coordinator.address
            raw = coordinator.get(f"ft/admit/{me.id}", wait=settings.dead_after)
            answered = time.monotonic()
            if raw is not None:
                return read_epoch(coordinator, raw, me.id)
        except StoreUnreachable:
            continue
        finally:
            coordinator.close()


def job_size(
    settings: FaultToleranceSettings, master_addr: str, master_port: int, peers: Sequence[str] | None = None
) -> int | None:
    """The number of members of the running job, as the first live member's store asked (:func:`stores_to_ask`)
    says; None when none answers. A joiner compiles its step for one more before it asks to join."""
    for current in _pointers(settings, stores_to_ask(master_addr, master_port, peers)):
        if "size" in current:
            return int(current["size"])
    return None


def _find_coordinator(settings: FaultToleranceSettings, addresses: Sequence[tuple[str, int]]) -> KVClient | None:
    """A client to the current coordinator's store, as a live member's ``ft/current`` says; None if none answers."""
    for current in _pointers(settings, addresses):
        try:
            return KVClient(current["host"], current["port"], settings.dead_after, secret=settings.secret)
        except (StoreUnreachable, KeyError, TypeError):
            continue
    return None


def _pointers(settings: FaultToleranceSettings, addresses: Sequence[tuple[str, int]]) -> Iterator[dict]:
    """Each live member's ``ft/current`` among ``addresses``, in order (its epoch, the epoch's size and its
    coordinator's address). Raises JobFinished when a store says the job ended."""
    for host, port in addresses:
        try:
            with closing(KVClient(host, port, settings.heartbeat_period + 1.0, secret=settings.secret)) as client:
                node_directory.raise_if_finished(client)
                raw = client.check(node_directory.CURRENT)  # closed also when the store goes away meanwhile
            current = None if raw is None else json.loads(raw)
        except (StoreUnreachable, ValueError):
            continue
        if isinstance(current, dict):
            yield current

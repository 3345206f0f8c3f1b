"""The launcher's directory on a node (``BAGUA_FT_DIRECTORY``): where the job is, and whether it finished.

``bagua-launch --fault-tolerant`` hosts a small store on each node for as long as the job runs. The members
write into it where the job's coordinator is (``ft/current``), when their last step committed that the job finished
(``ft/finished``), and when they stopped it on an error that a replacement would meet too (``ft/stopped``); a
replacement, that the job admitted it (``ft/admitted/<id>``). A replacement asks it first: where to join, or that
nothing is left to join; the launcher's slot asks it whether a rank that ended still needs a replacement.
"""

from __future__ import annotations

import os
import sys

from bagua_common.fault_tolerance.errors import JobFinished
from bagua_common.fault_tolerance.kv_store import KVClient, StoreClient, StoreUnreachable
from bagua_common.fault_tolerance.settings import ENV_DIRECTORY, FaultToleranceSettings

__all__ = [
    "ADMITTED",
    "CURRENT",
    "ENV_REPLACEMENT",
    "FINISHED",
    "STOPPED",
    "address",
    "admitted",
    "job_finished",
    "job_formed",
    "job_stopped",
    "raise_if_finished",
    "tell",
    "tell_admitted",
]

CURRENT = "ft/current"
"""Key of the pointer to the job's coordinator (a JSON object: ``epoch``, ``host``, ``port``)."""
FINISHED = "ft/finished"
"""Key set once the job's last step committed (its value: the number of transactions committed)."""
STOPPED = "ft/stopped"
"""Key set when the members stopped the job on an error its replacements would meet too (its value: the error's
name, ``NoProgress``)."""
ADMITTED = "ft/admitted/"
"""Prefix of the keys a replacement sets once the running job admitted it (the key ends with its
:data:`ENV_REPLACEMENT`)."""
ENV_REPLACEMENT = "BAGUA_FT_REPLACEMENT"
"""Set by the launcher's slot in each replacement it starts: the id under which the replacement says it was
admitted (:func:`tell_admitted`), so that the slot can tell a replacement that failed before joining."""


def address() -> tuple[str, int] | None:
    """This node's directory (``BAGUA_FT_DIRECTORY``), or None outside ``bagua-launch --fault-tolerant``."""
    directory = os.environ.get(ENV_DIRECTORY, "").strip()
    if not directory:
        return None
    host, _, port = directory.rpartition(":")
    return host, int(port)


def tell(settings: FaultToleranceSettings, key: str, value: str) -> None:
    """Write ``key`` into this node's directory, if there is one (nothing when the launcher is gone)."""
    where = address()
    if where is None:
        return
    try:
        client = KVClient(*where, settings.dead_after, secret=settings.secret)
        client.set(key, value)
        client.close()
    except StoreUnreachable:
        pass  # the launcher is gone: nobody will start replacements here


def tell_admitted(settings: FaultToleranceSettings) -> None:
    """Say in this node's directory that the running job admitted this process, when the launcher's slot started it
    as a replacement (nothing otherwise)."""
    replacement = os.environ.get(ENV_REPLACEMENT, "").strip()
    if replacement:
        tell(settings, ADMITTED + replacement, "1")


def admitted(replacement: str) -> bool:
    """Whether this node's directory says the replacement ``replacement`` was admitted into the running job."""
    return _directory_has(ADMITTED + replacement)


def job_formed() -> bool:
    """Whether this node's directory says the job formed its first epoch (a member wrote where its coordinator is):
    a rank lost before that is started again as the same rank, one lost after it joins the running job."""
    return _directory_has(CURRENT)


def job_finished() -> bool:
    """Whether this node's directory says the job finished (False without a directory, or when it is gone)."""
    return _directory_has(FINISHED)


def job_stopped() -> bool:
    """Whether this node's directory says the members stopped the job on an error (False without a directory)."""
    return _directory_has(STOPPED)


def _directory_has(key: str) -> bool:
    where = address()
    if where is None:
        return False
    settings = FaultToleranceSettings.from_environment()
    try:
        client = KVClient(*where, settings.dead_after, secret=settings.secret)
        try:
            return client.check(key) is not None
        finally:
            client.close()
    except StoreUnreachable:
        return False


def raise_if_finished(store: StoreClient) -> None:
    """Raise :class:`JobFinished` (saying so on stderr) when ``store`` (a member's, or a directory) says the job
    finished."""
    finished = store.check(FINISHED)
    if finished is not None:
        message = f"the job has finished ({finished.decode()} steps committed): nothing is left to join"
        print(f"bagua fault tolerance: {message}", file=sys.stderr, flush=True)
        raise JobFinished(message)

"""How a fault-tolerant job watches its members (heartbeat period, dead timeout, quorum wait, hash interval) and the
secret that keeps its members' stores to its own processes."""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

__all__ = [
    "ENV_DIRECTORY",
    "ENV_FAULT_TOLERANCE",
    "ENV_JOIN",
    "ENV_PEERS",
    "ENV_SECRET_FILE",
    "FaultToleranceSettings",
    "ensure_job_secret",
    "job_secret",
    "job_secret_file",
    "temporary_job_secret",
    "write_job_secret",
]

ENV_FAULT_TOLERANCE = "BAGUA_FAULT_TOLERANCE"
"""Set to 1 to make a front end's ``init_process_group`` start a fault-tolerant job."""

ENV_JOIN = "BAGUA_FT_JOIN"
"""Set to 1 in a process that joins a running job instead of starting one with the other ranks."""
ENV_DIRECTORY = "BAGUA_FT_DIRECTORY"
"""``host:port`` of a store the launcher hosts on each node: members write there where the job's coordinator is,
so a replacement started on that node finds the job even when rank 0 is gone."""
ENV_PEERS = "BAGUA_FT_PEERS"
"""Comma-separated ``host:port`` of members' stores a joiner may ask where the job is (beside MASTER_ADDR:PORT)."""

ENV_SECRET_FILE = "BAGUA_FT_SECRET_FILE"
"""Path of a file (mode 0600) holding the job's secret: every member's store serves only clients that prove they
hold it. ``bagua-launch --fault-tolerant`` generates one for a one-node job."""


def job_secret_file() -> str | None:
    """The path ``BAGUA_FT_SECRET_FILE`` names, or None where it is unset or blank."""
    return os.environ.get(ENV_SECRET_FILE, "").strip() or None


def job_secret() -> bytes:
    """The job's secret, read from the file named by ``BAGUA_FT_SECRET_FILE`` (a ValueError when it is not set,
    unreadable, shorter than 16 bytes, or readable by other users)."""
    path = job_secret_file()
    if path is None:
        raise ValueError(
            f"fault tolerance: {ENV_SECRET_FILE} is not set: every member needs the job's secret (a file of mode "
            "0600, the same on every node; bagua-launch --fault-tolerant makes one for a one-node job)"
        )
    try:
        mode = os.stat(path).st_mode
        with open(path, "rb") as file:
            secret = file.read().strip()
    except OSError as error:
        raise ValueError(f"fault tolerance: cannot read the job's secret from {ENV_SECRET_FILE}={path}: {error}")
    if mode & 0o077:
        raise ValueError(f"fault tolerance: the secret file {path} is readable by others (mode {mode & 0o777:o})")
    if len(secret) < 16:
        raise ValueError(f"fault tolerance: the secret in {path} is shorter than 16 bytes")
    return secret


def write_job_secret(directory: str) -> str:
    """Write a new job secret into a file of mode 0600 under ``directory`` (created private if missing) and return
    its path, for ``BAGUA_FT_SECRET_FILE`` (what ``bagua-launch --fault-tolerant`` does for a one-node job)."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    path = os.path.join(directory, "fault-tolerance-secret")
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(secrets.token_hex(32))
    return path


def ensure_job_secret(directory: str) -> str:
    """The path of the job's secret file: ``BAGUA_FT_SECRET_FILE``'s where it is set, otherwise a new secret written
    under ``directory`` (:func:`write_job_secret`) and set there, for this process and the processes it starts."""
    path = job_secret_file()
    if path is None:
        path = os.environ[ENV_SECRET_FILE] = write_job_secret(directory)
    return path


@contextlib.contextmanager
def temporary_job_secret() -> Iterator[str]:
    """The path of the job's secret file for the processes started in the ``with`` block: ``BAGUA_FT_SECRET_FILE``'s
    where it is set, otherwise a new secret in a private temporary directory, set for the block and removed, with the
    variable, when it ends (a test session's or a benchmark's jobs)."""
    path = job_secret_file()
    if path is not None:
        yield path
        return
    directory = tempfile.mkdtemp(prefix="bagua-job-secret-")
    try:
        path = os.environ[ENV_SECRET_FILE] = write_job_secret(directory)
        yield path
    finally:
        os.environ.pop(ENV_SECRET_FILE, None)
        shutil.rmtree(directory, ignore_errors=True)


_ENVIRONMENT = {
    "heartbeat_period": "BAGUA_FT_HEARTBEAT",
    "dead_after": "BAGUA_FT_DEAD_AFTER",
    "quorum_timeout": "BAGUA_FT_QUORUM_TIMEOUT",
    "hash_every": "BAGUA_FT_HASH_EVERY",
    "compile_ahead": "BAGUA_FT_COMPILE_AHEAD",
}


@dataclass(frozen=True)
class FaultToleranceSettings:
    """The timing of a fault-tolerant job (the same on every member).

    * ``heartbeat_period``: seconds between a member's heartbeats (0.5).
    * ``dead_after``: seconds without a heartbeat after which a member counts as gone (5, torchft's
      default); a member whose process ends is noticed at once, whatever this is.
    * ``quorum_timeout``: seconds a survivor without a majority of the last members waits for them
      before it stops with :class:`~bagua_common.fault_tolerance.NoQuorum`, and a joiner that no member
      answers before it exits with :class:`~bagua_common.fault_tolerance.NoJobToJoin` (60).
    * ``hash_every``: committed transactions between two checks that the replicas are
      bit-identical (100; they are also checked after every membership change); 0 checks only then.
    * ``compile_ahead``: (JAX) compile, from a thread after a step, a step whose layout follows the world size for
      one member fewer and one more, so that a change of members does not wait for its compilation (True). It
      competes with the training for the cores meanwhile: off (0) on a host whose cores the ranks already fill.
    * ``secret``: the job's secret (:func:`job_secret` by default): a member's store serves only the clients
      that prove they hold it.
    """

    heartbeat_period: float = 0.5
    dead_after: float = 5.0
    quorum_timeout: float = 60.0
    hash_every: int = 100
    compile_ahead: bool = True
    secret: bytes = field(default_factory=job_secret, repr=False)

    def __post_init__(self) -> None:
        for name in ("heartbeat_period", "dead_after", "quorum_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"fault tolerance: {name} must be a positive number of seconds, got {value!r}")
        if self.dead_after < 2 * self.heartbeat_period:
            raise ValueError(
                f"fault tolerance: dead_after ({self.dead_after:g} s) must be at least twice the heartbeat period "
                f"({self.heartbeat_period:g} s), or a member between two heartbeats counts as dead"
            )
        if isinstance(self.hash_every, bool) or not isinstance(self.hash_every, int) or self.hash_every < 0:
            raise ValueError(f"fault tolerance: hash_every must be an int >= 0, got {self.hash_every!r}")
        if not isinstance(self.compile_ahead, bool):
            raise ValueError(f"fault tolerance: compile_ahead must be a bool, got {self.compile_ahead!r}")

    @classmethod
    def from_environment(cls) -> FaultToleranceSettings:
        """The defaults, overridden by ``BAGUA_FT_HEARTBEAT``, ``BAGUA_FT_DEAD_AFTER``,
        ``BAGUA_FT_QUORUM_TIMEOUT`` (seconds), ``BAGUA_FT_HASH_EVERY`` (transactions) and
        ``BAGUA_FT_COMPILE_AHEAD`` (0 or 1) where set."""
        values: dict[str, float | int | bool] = {}
        kinds = {f.name: f.type for f in fields(cls)}
        for name, variable in _ENVIRONMENT.items():
            text = os.environ.get(variable, "").strip()
            if not text:
                continue
            if kinds[name] in (bool, "bool"):
                if text not in ("0", "1"):
                    raise ValueError(f"{variable} must be 0 or 1, got {text!r}")
                values[name] = text == "1"
                continue
            try:
                values[name] = int(text) if kinds[name] in (int, "int") else float(text)
            except ValueError:
                raise ValueError(f"{variable} must be a number, got {text!r}") from None
        return cls(**values)

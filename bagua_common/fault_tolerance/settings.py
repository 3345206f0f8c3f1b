"""How a fault-tolerant job watches its members: heartbeat period, dead timeout, quorum wait, hash interval."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields

__all__ = ["ENV_DIRECTORY", "ENV_FAULT_TOLERANCE", "ENV_JOIN", "ENV_PEERS", "FaultToleranceSettings"]

ENV_FAULT_TOLERANCE = "BAGUA_FAULT_TOLERANCE"
"""Set to 1 to make a front end's ``init_process_group`` start a fault-tolerant job."""

ENV_JOIN = "BAGUA_FT_JOIN"
"""Set to 1 in a process that joins a running job instead of starting one with the other ranks."""
ENV_DIRECTORY = "BAGUA_FT_DIRECTORY"
"""``host:port`` of a store the launcher hosts on each node: members write there where the job's coordinator is,
so a replacement started on that node finds the job even when rank 0 is gone."""
ENV_PEERS = "BAGUA_FT_PEERS"
"""Comma-separated ``host:port`` of members' stores a joiner may ask where the job is (beside MASTER_ADDR:PORT)."""

_ENVIRONMENT = {
    "heartbeat_period": "BAGUA_FT_HEARTBEAT",
    "dead_after": "BAGUA_FT_DEAD_AFTER",
    "quorum_timeout": "BAGUA_FT_QUORUM_TIMEOUT",
    "hash_every": "BAGUA_FT_HASH_EVERY",
}


@dataclass(frozen=True)
class FaultToleranceSettings:
    """The timing of a fault-tolerant job (the same on every member).

    * ``heartbeat_period``: seconds between a member's heartbeats (0.5).
    * ``dead_after``: seconds without a heartbeat after which a member counts as gone (5, torchft's
      default); a member whose process ends is noticed at once, whatever this is.
    * ``quorum_timeout``: seconds a survivor without a majority of the last members waits for them
      before it stops with :class:`~bagua_common.fault_tolerance.NoQuorum` (60).
    * ``hash_every``: committed transactions between two checks that the replicas are
      bit-identical (100; they are also checked after every membership change); 0 checks only then.
    """

    heartbeat_period: float = 0.5
    dead_after: float = 5.0
    quorum_timeout: float = 60.0
    hash_every: int = 100

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

    @classmethod
    def from_environment(cls) -> FaultToleranceSettings:
        """The defaults, overridden by ``BAGUA_FT_HEARTBEAT``, ``BAGUA_FT_DEAD_AFTER``,
        ``BAGUA_FT_QUORUM_TIMEOUT`` (seconds) and ``BAGUA_FT_HASH_EVERY`` (transactions) where set."""
        values: dict[str, float | int] = {}
        kinds = {f.name: f.type for f in fields(cls)}
        for name, variable in _ENVIRONMENT.items():
            text = os.environ.get(variable, "").strip()
            if not text:
                continue
            try:
                values[name] = int(text) if kinds[name] in (int, "int") else float(text)
            except ValueError:
                raise ValueError(f"{variable} must be a number, got {text!r}") from None
        return cls(**values)

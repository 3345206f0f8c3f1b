"""Training that survives a lost member without a restart: the part both front ends share.

* :mod:`.membership`: this process's membership: heartbeats, commit by agreement, recovery, joining;
* :mod:`.admission`: how a joining process finds the coordinator and waits to be admitted;
* :mod:`.epoch`: an epoch's members and its records; :mod:`.formation`: forming the next one;
* :mod:`.kv_store`: the store every member hosts (framework-free);
* :mod:`.decision`: the epoch's decision register;
* :mod:`.data_position`: the exact re-partition of the data among the members;
* :mod:`.replica_hash`: the check that replicas are bit-identical;
* :mod:`.background`: waits (for a thread's work, a store key) that give up once the epoch changes;
* :mod:`.settings`: heartbeat period, dead timeout, quorum wait, hash interval;
* :mod:`.errors`: what is raised when the members change or the replicas differ.

``bagua_torch.fault_tolerance`` builds the torch front end on it; ``docs/guides/fault_tolerance.md``
is the user's guide.
"""

from bagua_common.fault_tolerance.data_position import DataPosition, recorded_position
from bagua_common.fault_tolerance.decision import Decision
from bagua_common.fault_tolerance.epoch import Epoch, Member, Recovery
from bagua_common.fault_tolerance.errors import (
    Evicted,
    ExchangeInterrupted,
    JobFinished,
    MembershipChanged,
    NoJobToJoin,
    NoProgress,
    NoQuorum,
    ReplicaMismatch,
)
from bagua_common.fault_tolerance.kv_store import InProcessClient, KVClient, KVServer, StoreClient, StoreUnreachable
from bagua_common.fault_tolerance.membership import Membership
from bagua_common.fault_tolerance.replica_hash import ReplicaDigest, check_digests
from bagua_common.fault_tolerance.settings import (
    ENV_FAULT_TOLERANCE,
    ENV_JOIN,
    ENV_PEERS,
    ENV_SECRET_FILE,
    FaultToleranceSettings,
    job_secret,
)

__all__ = [
    "ENV_FAULT_TOLERANCE",
    "ENV_JOIN",
    "ENV_PEERS",
    "ENV_SECRET_FILE",
    "DataPosition",
    "Decision",
    "Epoch",
    "Evicted",
    "ExchangeInterrupted",
    "FaultToleranceSettings",
    "JobFinished",
    "InProcessClient",
    "KVClient",
    "KVServer",
    "Member",
    "Membership",
    "MembershipChanged",
    "NoJobToJoin",
    "NoProgress",
    "NoQuorum",
    "Recovery",
    "ReplicaDigest",
    "ReplicaMismatch",
    "StoreClient",
    "StoreUnreachable",
    "check_digests",
    "job_secret",
    "recorded_position",
]

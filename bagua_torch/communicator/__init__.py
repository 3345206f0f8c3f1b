"""Communicators for PyTorch: the protocol (:mod:`.protocol`) and its two implementations.

:class:`ProcessGroupCommunicator` runs over a ``torch.distributed`` process group,
:class:`NativeCommunicator` over Bagua's native engines through DLPack; both share the
argument checks of :mod:`.base`. :func:`dedicated_communicator` gives a background thread
a communicator of its own.
"""

from bagua_torch.communicator.dedicated import dedicated_communicator
from bagua_torch.communicator.native_communicator import NativeCommunicator
from bagua_torch.communicator.process_group_communicator import ProcessGroupCommunicator
from bagua_torch.communicator.protocol import (
    REDUCE_OPS,
    SUPPORTED_DTYPES,
    SUPPORTED_FLOATS,
    CommunicationError,
    Communicator,
    DoneWork,
    ReduceOp,
    Work,
)

__all__ = [
    "REDUCE_OPS",
    "SUPPORTED_DTYPES",
    "SUPPORTED_FLOATS",
    "CommunicationError",
    "Communicator",
    "DoneWork",
    "NativeCommunicator",
    "ProcessGroupCommunicator",
    "ReduceOp",
    "Work",
    "dedicated_communicator",
]

"""Bagua for PyTorch: the same native kernels, reached through DLPack.

``bagua_torch.ops`` holds the compression kernels and elementwise helpers for CPU
and CUDA tensors. Importing this package never imports jax.
"""

from bagua_torch import ops
from bagua_torch.communicator import (
    CommunicationError,
    Communicator,
    NativeCommunicator,
    ProcessGroupCommunicator,
    Work,
)
from bagua_torch.ops import build_info

__all__ = [
    "CommunicationError",
    "Communicator",
    "NativeCommunicator",
    "ProcessGroupCommunicator",
    "Work",
    "build_info",
    "ops",
]

"""Bagua for PyTorch: the same native kernels, reached through DLPack.

``bagua_torch.ops`` holds the compression kernels and elementwise helpers for CPU
and CUDA tensors. Importing this package never imports jax.

Training data-parallel::

    bagua_torch.init_process_group()            # RANK, WORLD_SIZE, ... from the launcher
    model = bagua_torch.with_bagua(model, [optimizer], "bytegrad")
    # or: model = bagua_torch.DistributedDataParallel(model, algorithm=ByteGradAlgorithm())

The algorithms are in :mod:`bagua_torch.algorithms`.
"""

from bagua_torch import algorithms, ops
from bagua_torch.bagua_module import BaguaModule, with_bagua
from bagua_torch.bucketing import DEFAULT_BUCKET_BYTES, Bucket
from bagua_torch.communicator import (
    CommunicationError,
    Communicator,
    NativeCommunicator,
    ProcessGroupCommunicator,
    ReduceOp,
    Work,
)
from bagua_torch.distributed_data_parallel import DistributedDataParallel
from bagua_torch.fused_optimizer import FusedOptimizer, fuse_optimizer
from bagua_torch.job import (
    BaguaProcessGroup,
    get_process_group,
    init_process_group,
    is_initialized,
)
from bagua_torch.ops import build_info

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "BaguaModule",
    "BaguaProcessGroup",
    "Bucket",
    "CommunicationError",
    "Communicator",
    "DistributedDataParallel",
    "FusedOptimizer",
    "NativeCommunicator",
    "ProcessGroupCommunicator",
    "ReduceOp",
    "Work",
    "algorithms",
    "build_info",
    "fuse_optimizer",
    "get_process_group",
    "init_process_group",
    "is_initialized",
    "ops",
    "with_bagua",
]

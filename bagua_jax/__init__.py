"""Bagua for JAX: communication-efficient data-parallel training.

``bagua_jax.ops`` holds the native compression kernels and elementwise helpers as
JAX operations (usable under ``jit``, ``vmap`` and ``shard_map``). Communicators
implement one protocol (:class:`Communicator`) two ways: :class:`LaxCommunicator`
(JAX's collectives on a mesh axis, inside ``shard_map``) and
:class:`NativeCommunicator` (the native MPI/NCCL engines, one device per process).
"""

from bagua_jax import algorithms, ops
from bagua_jax.build import build_info
from bagua_jax.communicator import Communicator, ReduceOp
from bagua_jax.lax_communicator import LaxCommunicator
from bagua_jax.native_communicator import NativeCommunicator
from bagua_jax.native_data_parallel import data_parallel_optimizer, rank_slice
from bagua_jax.train_state import TrainState
from bagua_jax.trainer import DataParallel

__all__ = [
    "Communicator",
    "DataParallel",
    "LaxCommunicator",
    "NativeCommunicator",
    "ReduceOp",
    "TrainState",
    "algorithms",
    "build_info",
    "data_parallel_optimizer",
    "ops",
    "rank_slice",
]

"""Bagua for JAX: communication-efficient data-parallel training.

``bagua_jax.ops`` holds the native compression kernels and elementwise helpers as
JAX operations (usable under ``jit``, ``vmap`` and ``shard_map``).
"""

from bagua_jax import ops
from bagua_jax.build import build_info
from bagua_jax.communicator import Communicator, ReduceOp
from bagua_jax.lax_communicator import LaxCommunicator

__all__ = ["Communicator", "LaxCommunicator", "ReduceOp", "build_info", "ops"]

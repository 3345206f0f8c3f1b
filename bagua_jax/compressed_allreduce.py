"""The compressed allreduces (the ByteGrad pipeline) on JAX arrays, with :mod:`bagua_jax.ops`'s kernels.

The sequence is :mod:`bagua_common.algorithms.compressed_allreduce`'s, shared with ``bagua_torch``, so both
front ends produce the same bits for the same bucket; it traces under ``jax.jit`` and inside
``shard_map`` (with :class:`~bagua_jax.LaxCommunicator`) like any other JAX code.
"""

from bagua_common.algorithms.compressed_allreduce import CompressedAllreduce
from bagua_jax import ops

PIPELINES = CompressedAllreduce(ops)
"""``minmax_allreduce`` and ``sign_allreduce``, flat or (with ``levels=``) in two levels,
on JAX arrays."""

"""The compressed allreduces (the ByteGrad pipeline) on torch tensors, with :mod:`bagua_torch.ops`'s kernels.

The sequence is :mod:`bagua_common.algorithms.compressed_allreduce`'s, shared with ``bagua_jax``, so both
front ends produce the same bits for the same bucket. These calls block (they use the
communicators' synchronous collectives); the algorithms run them on a worker thread
(:meth:`~bagua_torch.algorithms.base.AlgorithmImpl.run_async`). The residuals are returned and
also updated in place.
"""

from bagua_common.algorithms.compressed_allreduce import CompressedAllreduce
from bagua_torch import ops

PIPELINES = CompressedAllreduce(ops)
"""``minmax_allreduce`` and ``sign_allreduce``, flat or (with ``levels=``) in two levels,
on torch tensors."""

"""GradientAllReduce: full-precision allreduce of the gradients before the optimizer step.

Each bucket of gradients is allreduced (averaged or summed) over all ranks as soon as
it is ready in the backward pass, so every rank feeds the same gradients to the same
optimizer and the replicas stay bit-identical. Per rank it sends ``2 (n-1)/n`` times
the gradient bytes (a ring allreduce), the baseline the other algorithms are measured
against. The math is :func:`bagua_jax.algorithms.gradient_allreduce.gradient_allreduce`'s.

Hierarchical (SPEC: reduce inside the node, allreduce between nodes, broadcast inside
the node), as in the JAX version (one function,
:func:`bagua_common.algorithms.compressed_allreduce.allreduce_over`): an intra-node
reduce-scatter, an inter-node allreduce of this rank's slice and an intra-node allgather,
so only ``1/a`` of each bucket crosses nodes per rank (``a`` ranks per node). Without two
levels it is the flat allreduce.
"""

from __future__ import annotations

from bagua_common.algorithms.configs import GradientAllReduceConfig
from bagua_torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    Bucket,
    check_dtypes,
    implements,
)
from bagua_torch.communicator import SUPPORTED_FLOATS, Work


@implements(GradientAllReduceConfig)
class GradientAllReduceAlgorithm(Algorithm):
    """Average (or with ``average=False`` sum) the gradients over all ranks in full precision.

    Choose it as the exact, simple default; choose ``hierarchical=True`` when the links
    between nodes are much slower than inside them (it only has an effect when the job
    spans several nodes: ``LOCAL_WORLD_SIZE < WORLD_SIZE``); switch to ByteGrad or a
    decentralized algorithm when gradient communication dominates the step time.
    """

    fault_tolerant = True

    def reify(self, context: AlgorithmContext) -> GradientAllReduceImpl:
        return GradientAllReduceImpl(context, self.config)


class GradientAllReduceImpl(AlgorithmImpl):
    """GradientAllReduce on one wrapped model; stateless."""

    results_are_fresh = True  # the communicators return new tensors

    def __init__(self, context: AlgorithmContext, config: GradientAllReduceConfig):
        super().__init__(context)
        check_dtypes(context.buckets, SUPPORTED_FLOATS, config.name, "gradients are averaged in")
        self.config = config
        self.op = "avg" if config.average else "sum"
        self.levels = context.communicators.levels(config.hierarchical, config.name)

    def reduce_bucket(self, bucket: Bucket) -> Work:
        return self.allreduce_async(bucket.grad, self.levels, self.op)

    def weighed_out_scale(self, trainers: int) -> float:
        return self.mean_over(trainers) if self.op == "avg" else 1.0

"""ByteGrad: gradient allreduce with 8-bit min-max codes on the wire.

Each bucket (padded to a multiple of the world size ``n``) goes through the pipeline of
:func:`bagua_common.algorithms.compressed_allreduce.CompressedAllreduce.minmax_allreduce`, the same sequence as in
``bagua_jax``: compress into ``n`` chunks,
all-to-all, decode and average the ``n`` chunks of this rank's slot in float32, compress
that average as one chunk, allgather, decode. Every rank ends with the same bits, so the
replicas stay identical, at about a quarter of the bytes of an fp32 allreduce. The
pipeline of a bucket runs on the impl's worker thread as soon as the bucket is ready, so
it overlaps the rest of the backward pass.

Hierarchical (the default, as in Bagua; only effective when the job spans several nodes):
a full-precision reduce-scatter inside the node, the compressed exchange of this rank's
slice between nodes, an allgather inside the node
(:func:`bagua_common.algorithms.compressed_allreduce.hierarchical`); with ``average=False`` the
node's mean is scaled back to a sum after the exchange, as in the JAX version.

Error feedback (beyond the original Bagua) adds the previous step's compression error to
the gradients before the first compression; its float32 residuals (one per bucket: the
bucket's padded size, or ``1/intra.size`` of it when hierarchical) are the algorithm's
state, saved and restored with the wrapper's ``state_dict()``.
"""

from __future__ import annotations

from typing import Any

import torch

from bagua_common.algorithms.configs import ByteGradConfig
from bagua_torch import ops
from bagua_torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    Bucket,
    check_dtypes,
    check_tensor_list,
    implements,
)
from bagua_torch.communicator import Work
from bagua_torch.compressed_allreduce import PIPELINES


@implements(ByteGradConfig)
class ByteGradAlgorithm(Algorithm):
    """Average (or sum) the gradients over all ranks through 8-bit min-max compression.

    About 1/4 of an fp32 allreduce's bytes per rank per step (plus a 16-byte header per
    chunk); the per-element error is at most ``(hi-lo)/508`` of each chunk, twice, plus
    float32 rounding. ``error_feedback`` carries the first compression's error into the
    next step. Choose it when gradient allreduce is bandwidth-bound, in particular
    between nodes; parameters must be float32, float16 or bfloat16. In a fault-tolerant job the residuals restart
    at zero when the members change (they are laid out per rank), and a joiner takes part in its first step weighed
    out, as under gradient allreduce.
    """

    fault_tolerant = True

    def reify(self, context: AlgorithmContext) -> ByteGradImpl:
        return ByteGradImpl(context, self.config)


class ByteGradImpl(AlgorithmImpl):
    """ByteGrad on one wrapped model; with error feedback its state is ``{"residuals": [float32 tensors]}``."""

    results_are_fresh = True  # the compressed exchange returns a new tensor

    def __init__(self, context: AlgorithmContext, config: ByteGradConfig):
        super().__init__(context)
        name = config.name
        check_dtypes(context.buckets, ops.KERNEL_FLOATS, name, "the 8-bit codes compress")
        self.config = config
        self.levels = context.communicators.levels(config.hierarchical, name)
        share = self.levels[0].size if self.levels else 1
        for bucket in context.buckets:
            if bucket.size % self.world.size:
                raise ValueError(
                    f"{name}: bucket {bucket.index} has {bucket.size} elements, not a multiple of the "
                    f"world size {self.world.size}"
                )
        self.residual_sizes = [bucket.size // share for bucket in context.buckets]
        self.residuals: list[torch.Tensor] | None = (
            [torch.zeros(size, dtype=torch.float32, device=context.device) for size in self.residual_sizes]
            if config.error_feedback
            else None
        )

    def _allreduce(self, flat: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        # The residual is updated in place; the bucket's result is all the caller needs.
        return PIPELINES.minmax_allreduce(
            flat, self.world, levels=self.levels, average=self.config.average, residual=residual
        )[0]

    def reduce_bucket(self, bucket: Bucket) -> Work:
        residual = self.residuals[bucket.index] if self.residuals is not None else None
        flat = bucket.grad
        return self.run_async(lambda: self._allreduce(flat, residual))

    def weighed_out_scale(self, trainers: int) -> float:
        # A rank weighed out sends zeros, which the 8-bit codes carry exactly (a chunk of zeros has lo = hi = 0).
        return self.mean_over(trainers) if self.config.average else 1.0

    def state_dict(self) -> dict[str, Any]:
        if self.residuals is None:
            return {}
        return {"residuals": [r.detach().clone() for r in self.residuals]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.residuals is None:
            super().load_state_dict(state)
            return
        loaded = check_tensor_list(state, "residuals", self.residual_sizes, self.config.name)
        with torch.no_grad():
            for mine, theirs in zip(self.residuals, loaded):
                mine.copy_(theirs)

"""1-bit Adam: QAdam's scheme with the momentum averaged through 1-bit signs and error feedback.

Beyond the original Bagua; DeepSpeed's 1-bit Adam (Tang et al., 2021) is the reference.
The torch counterpart of :mod:`bagua_jax.algorithms.onebit_adam`, on the machinery of
:mod:`bagua_torch.algorithms.adam_engine`::

    opt = OneBitAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=100)
    model = bagua_torch.with_bagua(model, [opt], OneBitAdamAlgorithm(opt))

The warm-up is QAdam's: ``warmup_steps`` steps of ``torch.optim.Adam`` (its exact
arithmetic) on gradients averaged in full precision. After it the second moment is
frozen, each rank folds its local gradient into its momentum (``exp_avg.lerp_(g, 1-b1)``)
and, bucket by bucket in launch order, the momentum (padded to a multiple of the rank
count) is averaged with :func:`bagua_common.algorithms.compressed_allreduce.CompressedAllreduce.sign_allreduce`: the
worker adds its residual, compresses the bucket into one chunk per rank (each element
``+-mean|chunk|``) and keeps the compression error as its new residual; after the
all-to-all each rank averages the ``n`` decoded chunks of its slot, adds its server
residual, compresses that chunk again and keeps that error; an allgather hands everyone
every reduced chunk. The update is QAdam's, ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``
with torch Adam's operations and QAdam's floor under the frozen ``v``
(:mod:`bagua_common.algorithms.frozen_variance`; DeepSpeed omits the bias corrections; they are kept so
that 1-bit Adam and QAdam differ only in the momentum exchange).

The one departure from QAdam's step, as in the JAX version: sign compression cannot send a
zero, so a coordinate whose momentum is zero would receive ``+-scale`` and move. DeepSpeed asks
the user for a momentum mask; here the mask comes from the frozen second moment: for a
parameter whose ``exp_avg_sq`` is zero or negligible (no gradient in the whole warm-up, or only rounding: the loss
does not use it), the momentum is held at zero before and after the exchange, so it never moves
(and does not learn if its gradient first appears after the warm-up; QAdam's 8-bit codes send
exact zeros and need no mask). Every other parameter steps as before.

Residuals (float32, per bucket: the worker's has the bucket's padded size, or
``1/intra.size`` of it when hierarchical, the server's ``1/n`` of it) start at zero and
only the compressed phase writes them, so they are zero when compression starts; they
are the algorithm's state (the wrapper's ``state_dict()``), the Adam state is the
optimizer's (``optimizer.state_dict()``).
"""

from __future__ import annotations

from typing import Any

import torch

from bagua_common.algorithms.configs import OneBitAdamConfig
from bagua_torch.algorithms.adam_engine import (
    AdamWithAveragedMomentum,
    AdamWithAveragedMomentumAlgorithm,
    AdamWithAveragedMomentumImpl,
)
from bagua_torch.algorithms.base import AlgorithmContext, Bucket, check_tensor_list, implements
from bagua_torch.compressed_allreduce import PIPELINES

__all__ = ["OneBitAdamAlgorithm", "OneBitAdamImpl", "OneBitAdamOptimizer"]


class OneBitAdamOptimizer(AdamWithAveragedMomentum):
    """1-bit Adam's optimizer: ``torch.optim.Adam`` (bit for bit, ``foreach=False``) for ``warmup_steps`` steps,
    then Adam with the second moment frozen and the momentum averaged by :class:`OneBitAdamAlgorithm`.

    ``OneBitAdamOptimizer(params, lr=1e-3, warmup_steps=100, betas=(0.9, 0.999), eps=1e-8)``; give it to the
    wrapper together with ``OneBitAdamAlgorithm(optimizer)``.
    """

    _algorithm_name = "OneBitAdamAlgorithm"
    _config_class = OneBitAdamConfig


class OneBitAdamImpl(AdamWithAveragedMomentumImpl):
    """1-bit Adam on one wrapped model; its state is ``{"worker_residuals": [...], "server_residuals": [...]}``
    (float32, one per bucket)."""

    hold_unused = True

    def __init__(self, context: AlgorithmContext, algorithm: OneBitAdamAlgorithm):
        super().__init__(context, algorithm)
        share = self.levels[0].size if self.levels else 1
        n = self.world.size
        self.worker_sizes = [bucket.size // share for bucket in context.buckets]
        self.server_sizes = [bucket.size // n for bucket in context.buckets]
        device = context.device
        self.worker_residuals = [torch.zeros(s, dtype=torch.float32, device=device) for s in self.worker_sizes]
        self.server_residuals = [torch.zeros(s, dtype=torch.float32, device=device) for s in self.server_sizes]

    def average_momentum(self, bucket: Bucket, flat: torch.Tensor, scale: float) -> torch.Tensor:
        worker = self.worker_residuals[bucket.index]
        server = self.server_residuals[bucket.index]
        # Scaled before the server's compression, so that its residual is what the applied average left out.
        averaged, _, _ = PIPELINES.sign_allreduce(flat, self.world, worker, server, levels=self.levels, scale=scale)
        return averaged  # the residuals are updated in place

    def state_dict(self) -> dict[str, Any]:
        return {
            "worker_residuals": [r.detach().clone() for r in self.worker_residuals],
            "server_residuals": [r.detach().clone() for r in self.server_residuals],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        name = self.config.name
        workers = check_tensor_list(state, "worker_residuals", self.worker_sizes, name)
        servers = check_tensor_list(state, "server_residuals", self.server_sizes, name)
        with torch.no_grad():
            for mine, theirs in zip(self.worker_residuals + self.server_residuals, workers + servers):
                mine.copy_(theirs)


@implements(OneBitAdamConfig)
class OneBitAdamAlgorithm(AdamWithAveragedMomentumAlgorithm):
    """1-bit Adam: Adam with gradients averaged in full precision during the warm-up (1x an fp32 allreduce per
    step), then frozen ``v`` and the momentum averaged with 1-bit signs and error feedback on both the worker and
    the server side (~1/32 of an fp32 allreduce; with ``hierarchical`` and several nodes, only between nodes).
    Choose it over QAdam when bandwidth is scarcer still and the model tolerates a noisier momentum (the residuals
    carry each step's error into the next, so none is lost).
    """

    fault_tolerant = True

    optimizer_class = OneBitAdamOptimizer
    impl_class = OneBitAdamImpl

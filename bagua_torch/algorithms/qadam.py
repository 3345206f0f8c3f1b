"""QAdam: Adam whose momentum, not its gradients, is averaged with 8-bit codes after a warm-up.

Two objects work together, as in Bagua: the optimizer :class:`QAdamOptimizer` (holds
Adam's state and does the parameter update) and the algorithm :class:`QAdamAlgorithm`
(communicates), built on it: ``QAdamAlgorithm(optimizer)`` or, by name,
``get_algorithm("qadam", optimizer=optimizer)``. Wrap the model with both::

    opt = QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=100)
    model = bagua_torch.with_bagua(model, [opt], QAdamAlgorithm(opt))

The warm-up, the frozen second moment, its floor and the update are the Adam engine's
(:mod:`bagua_torch.algorithms.adam_engine`, shared with 1-bit Adam). QAdam's own part is the
exchange after the warm-up: each bucket of momentum goes through the ByteGrad pipeline
(:func:`bagua_common.algorithms.compressed_allreduce.CompressedAllreduce.minmax_allreduce`;
hierarchical: full precision inside the node, compressed between nodes). The Adam state is the
optimizer's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from bagua_common.algorithms.configs import QAdamConfig
from bagua_common.algorithms.frozen_variance import STEP_BOUND
from bagua_torch.algorithms.adam_engine import (
    AdamWithAveragedMomentum,
    AdamWithAveragedMomentumAlgorithm,
    AdamWithAveragedMomentumImpl,
)
from bagua_torch.algorithms.base import Bucket, implements
from bagua_torch.compressed_allreduce import PIPELINES

__all__ = ["QAdamAlgorithm", "QAdamImpl", "QAdamOptimizer"]


class QAdamOptimizer(AdamWithAveragedMomentum):
    """QAdam's optimizer: ``torch.optim.Adam`` (bit for bit, ``foreach=False``) for ``warmup_steps`` steps, then
    Adam with the second moment frozen and the momentum averaged across ranks by :class:`QAdamAlgorithm`.

    ``QAdamOptimizer(params, lr=1e-3, warmup_steps=100, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
    step_bound=1.0)`` (``step_bound``: see :mod:`~bagua_torch.algorithms.adam_engine`). It
    must be given to the wrapper together with ``QAdamAlgorithm(optimizer)``; after the warm-up, stepping it
    without the algorithm raises a RuntimeError (the momentum would not be averaged). ``weight_decay`` adds
    ``weight_decay * param`` to the gradient the moments take in (an L2 penalty, as Bagua's) in both phases;
    Bagua's applied it during the warm-up only. No amsgrad or sparse gradients.
    """

    _algorithm_name = "QAdamAlgorithm"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        warmup_steps: int = 100,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        step_bound: float | None = STEP_BOUND,
    ):
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not weight_decay >= 0.0:
            raise ValueError(f"QAdamOptimizer: weight_decay must be a float >= 0, got {weight_decay!r}")
        super().__init__(params, lr=lr, warmup_steps=warmup_steps, betas=betas, eps=eps, step_bound=step_bound)
        self.defaults["weight_decay"] = float(weight_decay)
        for group in self.param_groups:
            group.setdefault("weight_decay", float(weight_decay))

    def _gradient(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        grad = super()._gradient(p, group)
        return grad.add(p, alpha=group["weight_decay"]) if group["weight_decay"] else grad


class QAdamImpl(AdamWithAveragedMomentumImpl):
    """QAdam on one wrapped model: the momentum averaged with 8-bit min-max codes. Its state is the optimizer's."""

    def average_momentum(self, bucket: Bucket, flat: torch.Tensor, scale: float) -> torch.Tensor:
        averaged = PIPELINES.minmax_allreduce(flat, self.world, levels=self.levels)[0]
        return averaged if scale == 1.0 else averaged.mul_(scale)


@implements(QAdamConfig)
class QAdamAlgorithm(AdamWithAveragedMomentumAlgorithm):
    """QAdam (Bagua's ``QAdamAlgorithm(optimizer, hierarchical=True)``): Adam with gradients averaged in full
    precision during the warm-up (1x an fp32 allreduce per step), then with the second moment frozen and the
    momentum averaged through 8-bit min-max compression (~1/4 of an fp32 allreduce; with ``hierarchical`` and a job
    spanning several nodes, full precision inside the node and compressed only between nodes). Parameters must be
    float32, float16 or bfloat16. Choose it for Adam training whose gradient exchange is bandwidth-bound; keep the
    warm-up long enough for ``v`` to settle. In a fault-tolerant job the moments carry across a change of members,
    as the last step committed them.
    """

    fault_tolerant = True

    optimizer_class = QAdamOptimizer
    impl_class = QAdamImpl

"""Bagua's ``bagua.torch_api.algorithms.q_adam``: QAdam with Bagua's signatures, weight decay included.

``QAdamOptimizer(..., weight_decay=)`` adds ``weight_decay * param`` to the local gradient (an L2
penalty, as Bagua's). Bagua applied it only during the warm-up: after it, the momentum was
updated from the raw gradient and the decay silently stopped. Here it applies in both phases.

After the warm-up, a ``QAdamOptimizer`` stepped without ``QAdamAlgorithm`` (a model switched to
another algorithm, as in Bagua's ``test_model_switch``) folds the gradient it is given into its
momentum itself: the average under a gradient-averaging algorithm, the local gradient under a
weight-averaging one. Bagua's left the momentum as it was, so every later step reused a stale one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from bagua_common.algorithms.configs import QAdamConfig
from bagua_torch.algorithms import qadam as _qadam
from bagua_torch.torch_api.algorithms.base import implements

__all__ = ["QAdamAlgorithm", "QAdamOptimizer"]


class QAdamOptimizer(_qadam.QAdamOptimizer):
    """Bagua's ``QAdamOptimizer(params, lr=1e-3, warmup_steps=100, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)``."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        warmup_steps: int = 100,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) or not weight_decay >= 0.0:
            raise ValueError(f"QAdamOptimizer: weight_decay must be a float >= 0, got {weight_decay!r}")
        super().__init__(params, lr=lr, warmup_steps=warmup_steps, betas=betas, eps=eps)
        self._averaged = False
        self.defaults["weight_decay"] = float(weight_decay)
        for group in self.param_groups:
            group.setdefault("weight_decay", float(weight_decay))

    def _decayed(self, p: torch.Tensor, weight_decay: float) -> torch.Tensor:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        return grad.add(p, alpha=weight_decay) if weight_decay else grad

    @torch.no_grad()
    def local_momentum(self) -> None:
        """After the warm-up: fold each parameter's local gradient plus its weight decay into the momentum."""
        for group in self.param_groups:
            beta1, weight_decay = group["betas"][0], group["weight_decay"]
            for p in group["params"]:
                self.momentum(p).lerp_(self._decayed(p, weight_decay), 1 - beta1)

    def mark_momentum_averaged(self) -> None:
        """Called by QAdamAlgorithm once it has averaged this step's momentum."""
        self._averaged = True
        super().mark_momentum_averaged()

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """QAdam's step; during the warm-up Adam sees the (averaged) gradient plus the weight decay."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.in_warmup and not self._averaged:  # no QAdamAlgorithm this step: the momentum is local
            self.local_momentum()
            super().mark_momentum_averaged()
        self._averaged = False
        decayed = self.in_warmup and any(group["weight_decay"] for group in self.param_groups)
        saved = {}
        if decayed:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        saved[p] = p.grad
                        p.grad = self._decayed(p, group["weight_decay"])
        try:
            super().step()
        finally:
            for p, grad in saved.items():
                p.grad = grad
        return loss


@implements(QAdamConfig)
class QAdamAlgorithm(_qadam.QAdamAlgorithm):
    """Bagua's ``QAdamAlgorithm(q_adam_optimizer, hierarchical=True)``."""

    def __init__(self, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = True):
        super().__init__(optimizer=q_adam_optimizer, hierarchical=hierarchical)

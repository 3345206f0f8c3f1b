"""Bagua's ``bagua.torch_api.algorithms.q_adam``: QAdam with Bagua's signatures.

``QAdamOptimizer(..., weight_decay=)`` is the project's (:mod:`bagua_torch.algorithms.qadam`): the
decay applies in both phases, where Bagua's stopped silently after the warm-up.

After the warm-up, a ``QAdamOptimizer`` stepped without ``QAdamAlgorithm`` (a model switched to
another algorithm, as in Bagua's ``test_model_switch``) folds the gradient it is given into its
momentum itself: the average under a gradient-averaging algorithm, the local gradient under a
weight-averaging one. Bagua's left the momentum as it was, so every later step reused a stale one.
"""

from __future__ import annotations

from bagua_common.algorithms.configs import QAdamConfig
from bagua_torch.algorithms import qadam as _qadam
from bagua_torch.torch_api.algorithms.base import implements

__all__ = ["QAdamAlgorithm", "QAdamOptimizer"]


class QAdamOptimizer(_qadam.QAdamOptimizer):
    """Bagua's ``QAdamOptimizer(params, lr=1e-3, warmup_steps=100, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)``;
    stepped without ``QAdamAlgorithm`` after the warm-up (a model switched to another algorithm), it folds the
    gradient it is given into its momentum, where the project's raises."""

    local_momentum_fallback = True


@implements(QAdamConfig)
class QAdamAlgorithm(_qadam.QAdamAlgorithm):
    """Bagua's ``QAdamAlgorithm(q_adam_optimizer, hierarchical=True)``; ``hierarchical_reduce=`` (the spelling of
    Bagua's q-adam tutorial) is ``hierarchical``."""

    def __init__(
        self, q_adam_optimizer: QAdamOptimizer, hierarchical: bool = True, *, hierarchical_reduce: bool | None = None
    ):
        if hierarchical_reduce is not None:
            if hierarchical is not True and hierarchical != hierarchical_reduce:
                raise ValueError("QAdamAlgorithm: hierarchical and hierarchical_reduce disagree; give one of them")
            hierarchical = hierarchical_reduce
        super().__init__(optimizer=q_adam_optimizer, hierarchical=hierarchical)

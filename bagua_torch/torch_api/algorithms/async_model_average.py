"""Bagua's ``bagua.torch_api.algorithms.async_model_average``: Bagua's signature on the project's algorithm.

``model.bagua_algorithm.abort(model)`` and ``resume(model)`` work as in Bagua (see
:mod:`bagua_torch.torch_api.distributed`).
"""

from __future__ import annotations

from bagua_common.algorithms.configs import AsyncModelAverageConfig
from bagua_torch.algorithms import async_model_average as _async
from bagua_torch.torch_api.algorithms.base import implements

__all__ = ["AsyncModelAverageAlgorithm"]


@implements(AsyncModelAverageConfig)
class AsyncModelAverageAlgorithm(_async.AsyncModelAverageAlgorithm):
    """Bagua's ``AsyncModelAverageAlgorithm(peer_selection_mode="all", sync_interval_ms=500, warmup_steps=0)``.

    ``"all"`` (average with every rank) is the only peer selection, as it was in Bagua.
    """

    def __init__(self, peer_selection_mode: str = "all", sync_interval_ms: int = 500, warmup_steps: int = 0):
        if peer_selection_mode != "all":
            raise ValueError(
                f"AsyncModelAverageAlgorithm: peer_selection_mode must be 'all', got {peer_selection_mode!r}"
            )
        super().__init__(sync_interval_ms=sync_interval_ms, warmup_steps=warmup_steps)

"""Bagua's ``bagua.torch_api.algorithms``: its modules, classes and registry over the project's algorithms.

``from bagua_torch.torch_api.algorithms import gradient_allreduce`` and
``algorithms.decentralized.LowPrecisionDecentralizedAlgorithm(...)`` work as in Bagua;
``Algorithm.init("bytegrad", hierarchical=False)`` builds a registered one by name. A custom
algorithm subclasses :class:`Algorithm` and :class:`AlgorithmImpl` as Bagua's tutorial shows
(see :mod:`bagua_torch.torch_api.algorithms.base` for what it may change).
"""

from __future__ import annotations

from bagua_torch.torch_api.algorithms import (
    async_model_average,
    base,
    bytegrad,
    decentralized,
    gradient_allreduce,
    q_adam,
)
from bagua_torch.torch_api.algorithms.base import REGISTRY, Algorithm, AlgorithmImpl

GlobalAlgorithmRegistry: dict[str, type] = {name: REGISTRY.by_name(name) for name in REGISTRY.names()}
"""Bagua's algorithm names and classes, as the modules above register them (``@implements``)."""

__all__ = [
    "Algorithm",
    "AlgorithmImpl",
    "GlobalAlgorithmRegistry",
    "async_model_average",
    "base",
    "bytegrad",
    "decentralized",
    "gradient_allreduce",
    "q_adam",
]

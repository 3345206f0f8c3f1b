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
from bagua_torch.torch_api.algorithms.base import Algorithm, AlgorithmImpl

GlobalAlgorithmRegistry: dict[str, type] = {
    "gradient_allreduce": gradient_allreduce.GradientAllReduceAlgorithm,
    "bytegrad": bytegrad.ByteGradAlgorithm,
    "decentralized": decentralized.DecentralizedAlgorithm,
    "low_precision_decentralized": decentralized.LowPrecisionDecentralizedAlgorithm,
    "qadam": q_adam.QAdamAlgorithm,
    "async": async_model_average.AsyncModelAverageAlgorithm,
}
"""Bagua's algorithm names and classes."""

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

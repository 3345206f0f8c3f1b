"""Bagua's ``bagua.torch_api.algorithms.gradient_allreduce``: the project's class, Bagua's signature already."""

from bagua_common.algorithms.configs import GradientAllReduceConfig
from bagua_torch.algorithms import gradient_allreduce as _gradient_allreduce
from bagua_torch.torch_api.algorithms.base import implements

GradientAllReduceAlgorithm = implements(GradientAllReduceConfig)(_gradient_allreduce.GradientAllReduceAlgorithm)

__all__ = ["GradientAllReduceAlgorithm"]

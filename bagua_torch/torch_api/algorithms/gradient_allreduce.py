"""Bagua's ``bagua.torch_api.algorithms.gradient_allreduce``: the project's class, Bagua's signature already."""

from bagua_torch.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

__all__ = ["GradientAllReduceAlgorithm"]

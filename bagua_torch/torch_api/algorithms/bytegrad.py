"""Bagua's ``bagua.torch_api.algorithms.bytegrad``: the project's class, Bagua's signature already."""

from bagua_common.algorithms.configs import ByteGradConfig
from bagua_torch.algorithms import bytegrad as _bytegrad
from bagua_torch.torch_api.algorithms.base import implements

ByteGradAlgorithm = implements(ByteGradConfig)(_bytegrad.ByteGradAlgorithm)

__all__ = ["ByteGradAlgorithm"]

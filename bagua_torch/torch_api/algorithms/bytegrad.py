"""Bagua's ``bagua.torch_api.algorithms.bytegrad``: the project's class, Bagua's signature already."""

from bagua_torch.algorithms.bytegrad import ByteGradAlgorithm

__all__ = ["ByteGradAlgorithm"]

"""Bagua's ``contrib.sync_batchnorm``: torch's ``SyncBatchNorm`` (statistics across ranks, CUDA tensors).

``SyncBatchNorm.convert_sync_batchnorm(model)`` replaces every BatchNorm layer, as in Bagua.
"""

from torch.nn import SyncBatchNorm

__all__ = ["SyncBatchNorm"]

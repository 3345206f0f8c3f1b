"""Bagua's ``bagua.torch_api.data_parallel.DistributedDataParallel``: torch DDP's arguments plus Bagua's.

Returns the same wrapper as ``model.with_bagua`` (Bagua's attributes, the model's face; see
:mod:`bagua_torch.torch_api.distributed`), built on :class:`bagua_torch.DistributedDataParallel`.
Bagua fell back to torch's own DDP, with a warning, when ``device_ids``, ``output_device``,
``dim`` or ``broadcast_buffers`` differed from its defaults; here ``device_ids`` and
``output_device`` may name the model's device, and ``broadcast_buffers=False`` is honoured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from bagua_torch import distributed_data_parallel as _ddp
from bagua_torch.torch_api import distributed as _compat
from bagua_torch.torch_api.algorithms.base import as_project_algorithm

__all__ = ["DistributedDataParallel"]


class _DistributedDataParallel(_compat.BaguaAttributes, _ddp.DistributedDataParallel):
    """The wrapper class :func:`DistributedDataParallel` returns."""


def DistributedDataParallel(  # noqa: N802 (Bagua's name for a function)
    module: nn.Module,
    device_ids: Sequence[int | torch.device] | None = None,
    output_device: int | torch.device | None = None,
    dim: int = 0,
    broadcast_buffers: bool = True,
    process_group: Any = None,
    bucket_cap_mb: float = 25,
    find_unused_parameters: bool = False,
    check_reduction: bool = False,
    gradient_as_bucket_view: bool = True,
    optimizers: Sequence[torch.optim.Optimizer] = (),
    algorithm: Any = None,
    **options: Any,
) -> nn.Module:
    """Wrap ``module`` for data-parallel training (Bagua's signature; ``algorithm`` defaults to gradient allreduce,
    and may be a name with its ``options`` as for :func:`bagua_torch.with_bagua`).

    Collective. Wrapping a model that is already wrapped switches its algorithm (the previous
    wrapper is closed first). Parameters, buffers and the optimizers' state are broadcast from
    rank 0.
    """
    project_algorithm = as_project_algorithm("gradient_allreduce" if algorithm is None else algorithm, **options)

    def build(inner: nn.Module, optimizers: list[torch.optim.Optimizer], communicators: Any) -> nn.Module:
        return _DistributedDataParallel(
            inner,
            device_ids,
            output_device,
            dim,
            broadcast_buffers,
            communicators,
            bucket_cap_mb,
            find_unused_parameters,
            check_reduction,
            gradient_as_bucket_view,
            False,
            algorithm=project_algorithm,
            optimizers=optimizers,
        )

    return _compat.wrap(build, module, optimizers, process_group)

"""``torch.nn.parallel.DistributedDataParallel``'s spelling of the data-parallel wrapper.

:class:`DistributedDataParallel` takes DDP's arguments and builds a
:class:`~bagua_torch.bagua_module.BaguaModule` (see :mod:`bagua_torch.bagua_module`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from bagua_torch.algorithms.base import Algorithm
from bagua_torch.bagua_module import BaguaModule, Optimizers, SyncPoint
from bagua_torch.bucketing import DEFAULT_BUCKET_BYTES

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(BaguaModule):
    """``torch.nn.parallel.DistributedDataParallel``'s arguments, Bagua's algorithms underneath.

    ``DistributedDataParallel(model)`` averages gradients in full precision as torch's
    DDP does (GradientAllReduce); ``algorithm=`` picks another (by name or instance), a name with its
    options as further keywords: ``DistributedDataParallel(model, algorithm="bytegrad", error_feedback=True)``.
    Buffers are broadcast from rank 0 at every forward (``broadcast_buffers=True``, as in
    DDP). ``bucket_cap_mb`` sets the bucket size (default 10 MiB). Unused parameters are
    always handled, so ``find_unused_parameters`` is accepted for compatibility only, as
    are ``check_reduction``, ``gradient_as_bucket_view`` and ``static_graph``.
    ``device_ids`` / ``output_device`` may name the model's single device (one device
    per process). ``optimizers`` and ``sync_point="step"`` are Bagua extras: with them the
    wrapper waits for the gradients in the optimizer's step instead of at the end of
    the backward pass, and weight-communicating algorithms get their step hooks.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: Any = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        *,
        algorithm: str | Algorithm = "gradient_allreduce",
        optimizers: Optimizers = (),
        sync_point: SyncPoint = "backward",
        **algorithm_options: Any,
    ):
        if not isinstance(module, nn.Module):
            raise TypeError(f"the model must be a torch.nn.Module, got {type(module).__name__}")
        if bucket_cap_mb is None:
            bucket_bytes = DEFAULT_BUCKET_BYTES
        else:
            if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
                raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
            bucket_bytes = max(1, int(bucket_cap_mb * 1024 * 1024))
        if dim != 0:
            raise ValueError(f"dim={dim}: this wrapper runs one device per process and does not scatter inputs")
        devices = {p.device for p in module.parameters()}
        for what, ids in (
            ("device_ids", device_ids),
            ("output_device", None if output_device is None else [output_device]),
        ):
            if ids is None:
                continue
            if len(ids) != 1:
                raise ValueError(f"{what} must name exactly one device (one device per process), got {list(ids)}")
            wanted = torch.device("cuda", ids[0]) if isinstance(ids[0], int) else torch.device(ids[0])
            if devices and wanted not in devices:
                raise ValueError(f"{what}={list(ids)} but the model is on {sorted(map(str, devices))}")
        for key, value in (
            ("find_unused_parameters", find_unused_parameters),
            ("check_reduction", check_reduction),
            ("gradient_as_bucket_view", gradient_as_bucket_view),
            ("static_graph", static_graph),
        ):
            if not isinstance(value, bool):
                raise TypeError(f"{key} must be a bool, got {value!r}")
        super().__init__(
            module,
            optimizers,
            algorithm,
            process_group=process_group,
            bucket_bytes=bucket_bytes,
            sync_point=sync_point,
            broadcast_buffers=broadcast_buffers,
            **algorithm_options,
        )

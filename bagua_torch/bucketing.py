"""Buckets: a model's trainable parameters grouped into few flat buffers for communication.

The wrapper (:mod:`bagua_torch.bagua_module`) communicates *buckets*. Parameters are taken in
**reverse registration order** (the order in which the backward pass usually produces their
gradients, as in ``torch.nn.parallel.DistributedDataParallel``) and grouped by dtype and device
with the rule of :mod:`bagua_common.comm.bucket_plan`, shared with the JAX front end: at most
``bucket_bytes`` per bucket (a parameter larger than that gets a bucket of its own), each
zero-padded to a multiple of ``pad_to`` elements (the world size). Inside a bucket the
parameters keep that same (reverse) order. The layout depends only on the parameters' shapes,
dtypes and order and on ``bucket_bytes`` and ``pad_to``, so it is the same on every rank of a
job that wraps the same model.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bagua_common.comm import bucket_plan
from bagua_common.comm.bucket_plan import DEFAULT_BUCKET_BYTES, TensorSlot, padded_size

__all__ = ["DEFAULT_BUCKET_BYTES", "Bucket", "make_buckets"]


class Bucket:
    """One bucket of parameters and the flat gradient buffer the wrapper fills for it.

    Attributes (read-only by convention):

    * ``index``: the bucket's position in the fixed launch order (0 is launched first);
    * ``names`` / ``params``: the parameters in the bucket's flat order;
    * ``dtype`` / ``device``: shared by all of them;
    * ``numel``: the number of real elements; ``size``: the padded element count (a
      multiple of the world size); ``offsets[i]``: where ``params[i]`` starts;
    * ``grad``: a 1-D tensor of ``size`` elements (``dtype``, ``device``). When the wrapper
      calls :meth:`~bagua_torch.algorithms.base.AlgorithmImpl.reduce_bucket` it holds this
      rank's gradients of the bucket's parameters (zeros for a parameter that got no
      gradient in this backward pass) followed by zero padding. The algorithm may read
      it, and may write it in place, until the work it returned completes; the wrapper
      refills it in the next iteration only after that. Read it at each call: when the
      gradients are views of the buckets, the wrapper may make a reduced result the new
      ``grad`` (:attr:`~bagua_torch.algorithms.base.AlgorithmImpl.results_are_fresh`).
    """

    def __init__(
        self,
        index: int,
        named_params: Sequence[tuple[str, torch.nn.Parameter]],
        pad_to: int = 1,
    ):
        if not named_params:
            raise ValueError("a bucket needs at least one parameter")
        self.index = int(index)
        self.names: tuple[str, ...] = tuple(name for name, _ in named_params)
        self.params: tuple[torch.nn.Parameter, ...] = tuple(p for _, p in named_params)
        first = self.params[0]
        self.dtype: torch.dtype = first.dtype
        self.device: torch.device = first.device
        offsets, offset = [], 0
        for name, p in named_params:
            if p.dtype != self.dtype or p.device != self.device:
                raise ValueError(
                    f"bucket {index}: parameter {name} is {p.dtype} on {p.device}, the bucket holds "
                    f"{self.dtype} on {self.device}"
                )
            offsets.append(offset)
            offset += p.numel()
        self.offsets: tuple[int, ...] = tuple(offsets)
        self.numel = offset
        self.size = padded_size(offset, max(int(pad_to), 1))
        self.grad = torch.zeros(self.size, dtype=self.dtype, device=self.device)

    def __repr__(self) -> str:
        return (
            f"Bucket(index={self.index}, params={list(self.names)}, dtype={self.dtype}, numel={self.numel}, "
            f"size={self.size})"
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the padded flat buffer."""
        return self.size * self.grad.element_size()

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of a flat tensor of ``size`` (or ``numel``) elements shaped like each parameter, in bucket order."""
        if flat.dim() != 1 or flat.numel() < self.numel:
            raise ValueError(
                f"bucket {self.index}: need a 1-D tensor of at least {self.numel} elements, "
                f"got shape {list(flat.shape)}"
            )
        return [flat[o : o + p.numel()].view(p.shape) for o, p in zip(self.offsets, self.params)]

    def _fill(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
        for view, t in zip(self.views(flat), tensors):
            if t is None:
                view.zero_()
            else:
                view.copy_(t.detach())
        flat[self.numel :].zero_()
        return flat

    def flatten_grads(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The parameters' current ``.grad`` (zeros where None) as one padded flat tensor (``out`` if given)."""
        out = torch.empty(self.size, dtype=self.dtype, device=self.device) if out is None else out
        return self._fill(out, [p.grad for p in self.params])

    def flatten_params(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The parameters' values as one padded flat tensor (a copy; ``out`` if given)."""
        out = torch.empty(self.size, dtype=self.dtype, device=self.device) if out is None else out
        return self._fill(out, list(self.params))

    def unflatten_to_grads(self, flat: torch.Tensor) -> None:
        """Copy a flat tensor into the parameters' ``.grad`` (creating those that are None)."""
        with torch.no_grad():
            for p, view in zip(self.params, self.views(flat)):
                if p.grad is None:
                    p.grad = view.to(p.dtype).clone()
                else:
                    p.grad.copy_(view)

    def unflatten_to_params(self, flat: torch.Tensor) -> None:
        """Copy a flat tensor into the parameters' values (in place, outside autograd)."""
        with torch.no_grad():
            for p, view in zip(self.params, self.views(flat)):
                p.copy_(view)


def make_buckets(
    named_params: Sequence[tuple[str, torch.nn.Parameter]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    pad_to: int = 1,
) -> list[Bucket]:
    """Group ``named_params`` (in registration order) into buckets, as described in the module docstring."""
    ordered = list(reversed(list(named_params)))
    slots = [TensorSlot(p.numel(), p.element_size(), (p.dtype, p.device)) for _, p in ordered]
    return [
        Bucket(index, [ordered[i] for i in planned.members], pad_to)
        for index, planned in enumerate(bucket_plan.plan_buckets(slots, bucket_bytes, pad_to))
    ]

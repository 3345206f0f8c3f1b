"""How a fused optimizer lays parameters out: chunks of one flat buffer, each member a view of it.

A :class:`Chunk` holds the parameters of one (param group, dtype, device), or with a wrapped
model one run of a bucket's parameters in one group (:func:`lay_out`); the parameters'
values move into the chunk's flat parameter and their gradients into its flat gradient (the
bucket's buffer with a wrapped model), both as views. :mod:`bagua_torch.fused_optimizer` steps
the chunks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from bagua_torch.bucketing import Bucket

if TYPE_CHECKING:
    from bagua_torch.reducer import Reducer

__all__ = ["Chunk", "check_state_shapes", "lay_out", "member_value", "same_value", "slice_ptr"]


@dataclass
class Chunk:
    """The parameters of one (param group, dtype, device), laid out in one flat buffer.

    ``fused`` chunks keep their optimizer state in the inner optimizer, keyed by ``flat``;
    after a step in which some member had no gradient (or after loading a checkpoint whose
    members disagree, e.g. in their step counts) the chunk keeps per-parameter state in
    ``member_state`` until the members agree again.
    """

    group: int
    params: list[torch.nn.Parameter]
    offsets: list[int]
    flat: torch.nn.Parameter
    flat_grad: torch.Tensor
    grad_views: list[torch.Tensor]
    member_state: dict[torch.Tensor, dict[str, Any]] = field(default_factory=dict)
    fused: bool = True
    bucket: Bucket | None = None
    first: int = 0
    """With a wrapped model: the bucket whose gradient buffer holds the chunk's, from member ``first`` on."""

    def view(self, buffer: torch.Tensor, i: int) -> torch.Tensor:
        """Member ``i``'s slice of a flat buffer, shaped like the parameter."""
        p = self.params[i]
        return buffer.narrow(0, self.offsets[i], p.numel()).view(p.shape)


def lay_out(groups: Iterable[dict[str, Any]], reducer: Reducer | None = None) -> list[Chunk]:
    """One chunk per (group, dtype, device), or per run of a bucket in one group; members become views."""
    group_of: dict[torch.Tensor, int] = {}
    for g, group in enumerate(groups):
        for p in group["params"]:
            if p in group_of:
                raise ValueError("fuse_optimizer: a parameter appears in more than one param group")
            group_of[p] = g
            if p.requires_grad and (p.is_sparse or not p.is_contiguous()):
                raise ValueError(
                    f"fuse_optimizer: a parameter of shape {tuple(p.shape)} is sparse, "
                    "channels-last or otherwise not contiguous; it cannot be a view of a flat buffer"
                )
    chunks = [] if reducer is None else _lay_out_on_buckets(group_of, reducer)
    placed = {p for chunk in chunks for p in chunk.params}
    by_kind: dict[tuple[int, torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    for p, g in group_of.items():
        if p.requires_grad and p not in placed:
            by_kind.setdefault((g, p.dtype, p.device), []).append(p)
    for (g, _, _), params in by_kind.items():
        numel = sum(p.numel() for p in params)
        flat_grad = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        chunks.append(_make_chunk(g, params, flat_grad, list(_views(flat_grad, params))))
    return chunks


def _lay_out_on_buckets(group_of: dict[torch.Tensor, int], reducer: Reducer) -> list[Chunk]:
    """Chunks over the model's buckets: each run of a bucket's parameters in one group is one chunk."""
    chunks = []
    for bucket in reducer.buckets:
        views = reducer.grad_views(bucket)
        start = 0
        for i in range(1, len(bucket.params) + 1):
            if i < len(bucket.params) and group_of.get(bucket.params[i]) == group_of.get(bucket.params[start]):
                continue
            params = list(bucket.params[start:i])
            if params[0] in group_of:
                numel = sum(p.numel() for p in params)
                flat_grad = bucket.grad.narrow(0, bucket.offsets[start], numel)
                chunk = _make_chunk(group_of[params[0]], params, flat_grad, views[start:i])
                chunk.bucket, chunk.first = bucket, start
                chunks.append(chunk)
            start = i
    return chunks


def _make_chunk(
    group: int, params: list[torch.nn.Parameter], flat_grad: torch.Tensor, grad_views: list[torch.Tensor]
) -> Chunk:
    """A chunk over ``params`` whose gradient buffer is ``flat_grad``: values moved into a new flat parameter."""
    flat = torch.nn.Parameter(torch.empty(flat_grad.shape, dtype=flat_grad.dtype, device=flat_grad.device))
    offsets = [0]
    for p in params[:-1]:
        offsets.append(offsets[-1] + p.numel())
    chunk = Chunk(group, params, offsets, flat, flat_grad, grad_views)
    with torch.no_grad():
        for p, view, grad_view in zip(params, _views(flat.data, params), grad_views):
            view.copy_(p)
            grad = p.grad
            p.data = view
            if grad is not None:
                if grad is not grad_view:
                    grad_view.copy_(grad)
                p.grad = grad_view
    flat.grad = flat_grad
    return chunk


def _views(flat: torch.Tensor, params: list[torch.nn.Parameter]) -> Iterable[torch.Tensor]:
    """Consecutive slices of ``flat`` shaped like ``params``."""
    offset = 0
    for p in params:
        yield flat.narrow(0, offset, p.numel()).view(p.shape)
        offset += p.numel()


def slice_ptr(bucket: Bucket, first: int) -> int:
    """The address of member ``first``'s gradient inside ``bucket``'s flat gradient (to check a chunk shares it)."""
    return bucket.grad.data_ptr() + bucket.offsets[first] * bucket.grad.element_size()


def member_value(chunk: Chunk, i: int, value: Any) -> Any:
    """Member ``i``'s part of a flat state value: a view when it is flat-shaped, else a copy."""
    if torch.is_tensor(value) and value.shape == chunk.flat.shape:
        return chunk.view(value, i)
    return value.clone() if torch.is_tensor(value) else value


def check_state_shapes(p: torch.Tensor, state: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless every tensor of ``state`` but scalars is shaped like the parameter ``p``."""
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() > 0 and value.shape != p.shape:
            raise ValueError(
                f"fuse_optimizer: state {key!r} of a parameter of shape {tuple(p.shape)} has shape "
                f"{tuple(value.shape)}; only state shaped like its parameter (or scalars) can be fused"
            )


def same_value(a: Any, b: Any) -> bool:
    """Whether two state values are equal: tensors in shape, dtype and every element; others by ``==``."""
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return not torch.is_tensor(a) and not torch.is_tensor(b) and a == b

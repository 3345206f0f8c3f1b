"""What a wrapper sends from rank 0 when it wraps a model: tensors' bytes and optimizer state.

:func:`broadcast_tensors` overwrites a list of tensors with rank 0's values in one broadcast of
their bytes. :func:`broadcast_optimizer_state` does the same for an optimizer's ``state_dict()``
(moments, step counts, hyper-parameters), and :func:`broadcast_structure` any nested state (what a
fault-tolerant job sends a joiner): structures travel as JSON and tensors as raw bytes, so nothing
a peer sends is unpickled.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import torch

from bagua_torch.communicator import Communicator

__all__ = ["broadcast_optimizer_state", "broadcast_structure", "broadcast_tensors"]


def broadcast_tensors(comm: Communicator, tensors: Sequence[torch.Tensor], root: int = 0) -> None:
    """Overwrite ``tensors`` (any dtypes and shapes, on ``comm``'s device) with ``root``'s values (collective)."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return
    flats = [t.detach().contiguous().view(-1).view(torch.uint8) for t in tensors]
    received = comm.broadcast(torch.cat(flats), root)
    offset = 0
    with torch.no_grad():
        for t, flat in zip(tensors, flats):
            part = received[offset : offset + flat.numel()].clone()  # aligned for the dtype's view
            t.copy_(part.view(t.dtype).view(t.shape))
            offset += flat.numel()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, world: Communicator, device: torch.device) -> None:
    """Overwrite ``optimizer``'s state and hyper-parameters on every rank with rank 0's (collective).

    Its ``state_dict()`` travels by :func:`broadcast_structure`; where rank 0's state holds a value
    JSON cannot carry (an arbitrary object), every rank raises a TypeError.
    """
    try:
        state = broadcast_structure(optimizer.state_dict() if world.rank == 0 else None, world, device)
    except TypeError as error:
        raise TypeError(f"{type(optimizer).__name__}'s state on rank 0 cannot be broadcast: {error}") from None
    if world.rank != 0:  # on the CPU, as a loaded checkpoint: the optimizer places its state itself
        optimizer.load_state_dict(state)


def broadcast_structure(value: Any, world: Communicator, device: torch.device, root: int = 0) -> Any:
    """``root``'s ``value`` (dicts, lists, tuples, numbers, strings, None and tensors, nested) on every rank
    (collective; other ranks pass anything, e.g. None). Tensors arrive on the CPU.

    Three broadcasts: the size of the JSON structure, the structure, then every tensor's bytes in
    one buffer. Where ``root``'s value holds something JSON cannot carry, every rank raises a TypeError.
    """
    tensors: list[torch.Tensor] = []
    payload, error = b"", None
    if world.rank == root:
        try:
            payload = json.dumps(_encode(value, tensors)).encode()
        except TypeError as caught:
            error = caught
    size = int(world.broadcast(torch.tensor([-1 if error else len(payload)], dtype=torch.int64, device=device), root))
    if size < 0:
        raise TypeError(str(error) if error else f"rank {root}'s value cannot be broadcast (see rank {root})")
    buffer = torch.zeros(size, dtype=torch.uint8, device=device)
    if world.rank == root:
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    data = json.loads(bytes(world.broadcast(buffer, root).cpu().numpy()).decode())
    if world.rank != root:
        tensors = [torch.zeros(shape, dtype=dtype, device=device) for dtype, shape in _tensor_specs(data)]
    staged = [t.to(device) for t in tensors]
    broadcast_tensors(world, staged, root)
    return _decode(data, [t.cpu() for t in staged])


def _encode(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` as JSON-able data; tensors are replaced by their index in ``tensors`` plus dtype and shape."""
    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return {
            "tensor": len(tensors) - 1,
            "dtype": str(value.dtype).removeprefix("torch."),
            "shape": list(value.shape),
        }
    if isinstance(value, dict):
        return {"dict": [[_encode(k, tensors), _encode(v, tensors)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, tensors) for v in value]}
    if isinstance(value, list):
        return [_encode(v, tensors) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"cannot broadcast a state holding a {type(value).__name__} ({value!r})")


def _decode(data: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(data, list):
        return [_decode(v, tensors) for v in data]
    if isinstance(data, dict):
        if "tensor" in data:
            return tensors[data["tensor"]]
        if "tuple" in data:
            return tuple(_decode(v, tensors) for v in data["tuple"])
        return {_decode(k, tensors): _decode(v, tensors) for k, v in data["dict"]}
    return data


def _tensor_specs(data: Any) -> list[tuple[torch.dtype, list[int]]]:
    """Every tensor's (dtype, shape) in the encoded structure, in index order."""
    found = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if "tensor" in node:
                found.append((node["tensor"], getattr(torch, node["dtype"]), node["shape"]))
            else:
                for v in node.get("tuple", []) + [x for pair in node.get("dict", []) for x in pair]:
                    walk(v)

    walk(data)
    return [(dtype, shape) for _, dtype, shape in sorted(found, key=lambda spec: spec[0])]

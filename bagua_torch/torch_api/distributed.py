"""Bagua's ``model.with_bagua(optimizers, algorithm)``: the one monkey-patch of this project.

Importing :mod:`bagua_torch.torch_api` adds ``with_bagua`` to ``torch.nn.Module`` (nothing else
is patched, and importing :mod:`bagua_torch` alone patches nothing). It returns a
:class:`BaguaModule`, this project's data-parallel wrapper
(:class:`bagua_torch.BaguaModule`) dressed in Bagua's attributes, where Bagua returned the
patched model itself. To keep code written for Bagua working unchanged, the wrapper behaves as
the model would: attribute lookups it cannot answer go to the model (``model.fc1``),
``state_dict()`` / ``load_state_dict()`` are the model's own (no ``module.`` prefix, as in
Bagua), and ``with_bagua`` on it re-wraps the model.

Bagua's semantics, kept or fixed:

* On wrapping, the parameters, buffers *and every optimizer's state* (``state_dict()``:
  moments, step counts, hyper-parameters) are broadcast from rank 0, as Bagua did. Bagua
  pickled the optimizer's scalars and unpickled rank 0's bytes on every rank; here the
  structure travels as JSON and the tensors as raw bytes, so nothing a peer sends is unpickled.
* ``with_bagua`` on a model already wrapped (or ``DistributedDataParallel`` of it) switches
  algorithms: the previous wrapper is closed first (its hooks removed, an asynchronous
  algorithm's thread stopped), then the model is wrapped anew. Bagua left the old hooks in
  place, so both algorithms ran on the same gradients.
* ``model.bagua_algorithm`` is the algorithm's implementation; its ``abort(model)`` /
  ``resume(model)`` take the model as in Bagua, and ``resume`` before any ``abort`` (or twice)
  does nothing, as in Bagua.
* ``do_flatten`` is accepted and has no effect: buckets are always flat copies, and the
  parameters keep their own storage, so ``contrib.fuse_optimizer`` works with either value.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from bagua_torch import distributed as _wrapper
from bagua_torch.algorithms.base import Algorithm
from bagua_torch.communicator import Communicator
from bagua_torch.torch_api import env

_active: weakref.WeakKeyDictionary[nn.Module, BaguaModule] = weakref.WeakKeyDictionary()
"""The model -> its live wrapper, so that re-wrapping a model closes the wrapper before."""


class AlgorithmImplHandle:
    """``model.bagua_algorithm``: the algorithm's implementation with Bagua's ``abort(model)``/``resume(model)``.

    Every other attribute is the implementation's (:class:`bagua_torch.algorithms.AlgorithmImpl`).
    """

    def __init__(self, impl: Any):
        self.impl = impl
        self._aborted = False

    def abort(self, bagua_module: nn.Module | None = None) -> None:
        """Stop the background averaging on every rank (AsyncModelAverage); every rank must call it."""
        if not hasattr(self.impl, "abort"):
            raise AttributeError(f"{type(self.impl).__name__} has nothing to abort (only AsyncModelAverage has)")
        self.impl.abort()
        self._aborted = True

    def resume(self, bagua_module: nn.Module | None = None) -> None:
        """Restart the background averaging after :meth:`abort`; a no-op when it was not aborted."""
        if not hasattr(self.impl, "resume"):
            raise AttributeError(f"{type(self.impl).__name__} has nothing to resume (only AsyncModelAverage has)")
        if self._aborted:
            self.impl.resume()
            self._aborted = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.impl, name)


def _communicators(process_group: Any) -> Any:
    """What the project's wrapper takes for Bagua's ``process_group`` (a Bagua group, a torch group, or None)."""
    from bagua_torch.torch_api.communication import BaguaProcessGroup, _get_default_group, is_initialized

    if process_group is None:
        return _get_default_group().communicators if is_initialized() else None
    if isinstance(process_group, BaguaProcessGroup):
        if process_group.communicators is None:
            raise ValueError(f"this rank is not a member of {process_group!r}; only its members wrap the model")
        return process_group.communicators
    return process_group


class _BaguaAttributes:
    """Bagua's attributes and the model's face, for the two wrapper classes below."""

    @property
    def bagua_algorithm(self) -> AlgorithmImplHandle:
        """The algorithm's implementation (Bagua's ``bagua_algorithm``), with ``abort(model)``/``resume(model)``."""
        handle = self.__dict__.get("_bagua_algorithm_handle")
        if handle is None or handle.impl is not self.algorithm_impl:
            handle = AlgorithmImplHandle(self.algorithm_impl)
            self.__dict__["_bagua_algorithm_handle"] = handle
        return handle

    @property
    def bagua_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers given when wrapping."""
        return list(self.optimizers)

    @property
    def bagua_buckets(self) -> list[Any]:
        """The communication buckets, in launch order."""
        return list(self.buckets)

    @property
    def bagua_module_name(self) -> str:
        """A name for the wrapped model (its class and id, as Bagua named it)."""
        return f"{type(self.module).__name__}_{id(self.module)}"

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if name == "module" or "module" not in modules:
                raise
            return getattr(modules["module"], name)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The model's own ``state_dict()`` (Bagua returned the model itself; no ``module.`` prefix)."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the model (keys without the ``module.`` prefix, as saved by :meth:`state_dict`)."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def _adopt(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        for optimizer in optimizers:
            broadcast_optimizer_state(optimizer, self.communicators.world, self.device)
        _active[self.module] = self


class BaguaModule(_BaguaAttributes, _wrapper.BaguaModule):
    """What ``model.with_bagua(...)`` returns (see the module docstring)."""


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's model under ``model``, after closing any live wrapper of it (an algorithm switch)."""
    inner = model.module if isinstance(model, _wrapper.BaguaModule) else model
    previous = _active.pop(inner, None)
    if previous is not None:
        previous.close()
    if isinstance(model, _wrapper.BaguaModule) and model is not previous:
        model.close()
    return inner


def _optimizer_list(optimizers: Any) -> list[torch.optim.Optimizer]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    return list(optimizers or [])


def with_bagua(
    self: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    algorithm: Algorithm,
    process_group: Any = None,
    do_flatten: bool = True,
) -> BaguaModule:
    """Train this model data-parallel with ``algorithm`` (Bagua's ``with_bagua``; see the module docstring).

    ``optimizers`` are the model's optimizers; ``algorithm`` a Bagua algorithm (the classes in
    :mod:`bagua_torch.torch_api.algorithms`, or your own subclass of its ``Algorithm``);
    ``process_group`` a :class:`~bagua_torch.torch_api.communication.BaguaProcessGroup` (default:
    the job's world). Collective: every rank of the group calls it, in the same order. Returns the
    wrapper to train through (``model = model.with_bagua(...)``).
    """
    if not isinstance(do_flatten, bool):
        raise TypeError(f"with_bagua: do_flatten must be a bool, got {do_flatten!r}")
    from bagua_torch.torch_api.algorithms.base import as_project_algorithm

    inner = _unwrap(self)
    optimizers = _optimizer_list(optimizers)
    wrapped = BaguaModule(
        inner,
        optimizers,
        as_project_algorithm(algorithm),
        process_group=_communicators(process_group),
        bucket_bytes=env.get_default_bucket_size(),
    )
    wrapped._adopt(optimizers)
    return wrapped


# ----------------------------------------------------------------------------- optimizer state


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
    raise TypeError(f"cannot broadcast an optimizer state holding a {type(value).__name__} ({value!r})")


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


def _tensor_specs(data: Any) -> list[tuple[int, torch.dtype, list[int]]]:
    """Every tensor's (index, dtype, shape) in the encoded structure."""
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
    return sorted(found, key=lambda spec: spec[0])


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, world: Communicator, device: torch.device) -> None:
    """Overwrite ``optimizer``'s state and hyper-parameters on every rank with rank 0's (collective).

    Three broadcasts: the size of the JSON structure, the structure, then every state tensor's
    bytes in one buffer. Where rank 0's state holds a value JSON cannot carry (an arbitrary
    object), every rank raises a TypeError.
    """
    tensors: list[torch.Tensor] = []
    payload, error = b"", None
    if world.rank == 0:
        try:
            payload = json.dumps(_encode(optimizer.state_dict(), tensors)).encode()
        except TypeError as caught:
            error = caught
    size = int(world.broadcast(torch.tensor([-1 if error else len(payload)], dtype=torch.int64, device=device), 0))
    if size < 0:
        raise TypeError(f"{type(optimizer).__name__}'s state on rank 0 cannot be broadcast: {error or 'see rank 0'}")
    buffer = torch.zeros(size, dtype=torch.uint8, device=device)
    if world.rank == 0:
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    data = json.loads(bytes(world.broadcast(buffer, 0).cpu().numpy()).decode())
    specs = _tensor_specs(data)
    if world.rank != 0:
        tensors = [torch.zeros(shape, dtype=dtype) for _, dtype, shape in specs]
    flats = [t.contiguous().reshape(-1).view(torch.uint8).to(device) for t in tensors]
    if flats:
        received = world.broadcast(torch.cat(flats), 0).cpu()
        if world.rank != 0:
            offset = 0
            for i, (t, flat) in enumerate(zip(tensors, flats)):
                tensors[i] = received[offset : offset + flat.numel()].clone().view(t.dtype).reshape(t.shape)
                offset += flat.numel()
    if world.rank != 0:
        optimizer.load_state_dict(_decode(data, tensors))


def install() -> None:
    """Add :func:`with_bagua` to ``torch.nn.Module`` (done once, by importing :mod:`bagua_torch.torch_api`)."""
    nn.Module.with_bagua = with_bagua


__all__ = ["AlgorithmImplHandle", "BaguaModule", "broadcast_optimizer_state", "install", "with_bagua"]

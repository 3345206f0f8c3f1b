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
  moments, step counts, hyper-parameters) are broadcast from rank 0, as Bagua did, by the
  project's wrapper (:mod:`bagua_torch.broadcast`). Bagua pickled the optimizer's scalars and
  unpickled rank 0's bytes on every rank; here nothing a peer sends is unpickled.
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

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from bagua_common.moved import moved_names
from bagua_torch import bagua_module as _wrapper
from bagua_torch.algorithms.base import Algorithm
from bagua_torch.torch_api import env
from bagua_torch.torch_api.algorithms.base import as_project_algorithm

__getattr__ = moved_names(__name__)  # broadcast_optimizer_state, now in bagua_torch.broadcast

_live: weakref.WeakKeyDictionary[nn.Module, _wrapper.BaguaModule] = weakref.WeakKeyDictionary()
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


class ModelBucket:
    """One of ``model.bagua_buckets``: the project's bucket (:class:`bagua_torch.bucketing.Bucket`), and the copies the
    decentralized algorithms keep of it under Bagua's names, which Bagua's own tests read: ``_peer_weight`` (the
    weights of the last averaging, decentralized), ``_weight``, ``_left_peer_weight``, ``_right_peer_weight``
    (``w``, ``L`` and ``R``, low-precision decentralized). Flat, in the bucket's order, without padding."""

    _COPIES = {
        "_peer_weight": "peer_weights",
        "_weight": "weights",
        "_left_peer_weight": "left",
        "_right_peer_weight": "right",
    }

    def __init__(self, bucket: Any, impl: Any, index: int):
        self._bucket, self._impl, self._index = bucket, impl, index

    def __getattr__(self, name: str) -> Any:
        if name in self._COPIES:
            copies = getattr(self._impl, self._COPIES[name], None)
            if copies is None:
                raise AttributeError(
                    f"{type(self._impl).__name__} keeps no {name} (Bagua's decentralized algorithms do)"
                )
            return copies[self._index]
        return getattr(self._bucket, name)


class BaguaAttributes:
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
    def bagua_buckets(self) -> list[ModelBucket]:
        """The communication buckets, in launch order, with the algorithm's copies of them (:class:`ModelBucket`)."""
        return [ModelBucket(bucket, self.algorithm_impl, i) for i, bucket in enumerate(self.buckets)]

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


class BaguaModule(BaguaAttributes, _wrapper.BaguaModule):
    """What ``model.with_bagua(...)`` returns (see the module docstring)."""


def wrap(
    build: Callable[[nn.Module, list[torch.optim.Optimizer], Any], _wrapper.BaguaModule],
    model: nn.Module,
    optimizers: _wrapper.Optimizers | None,
    process_group: Any,
) -> Any:
    """Wrap ``model`` with ``build(module, optimizers, communicators)``, Bagua's way (collective).

    A live wrapper of the same model is closed first (an algorithm switch, as ``with_bagua`` and
    ``DistributedDataParallel`` on a wrapped model are in Bagua); ``optimizers`` may be one
    optimizer or a list; ``process_group`` a group of :mod:`bagua_torch.torch_api.communication`
    or None (the default group).
    """
    inner = model.module if isinstance(model, _wrapper.BaguaModule) else model
    previous = _live.pop(inner, None)
    if previous is not None:
        previous.close()
    if isinstance(model, _wrapper.BaguaModule) and model is not previous:
        model.close()
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    wrapped = build(inner, list(optimizers or []), process_group)
    _live[inner] = wrapped
    return wrapped


def with_bagua(
    self: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    algorithm: Algorithm,
    process_group: Any = None,
    do_flatten: bool = True,
    **options: Any,
) -> BaguaModule:
    """Train this model data-parallel with ``algorithm`` (Bagua's ``with_bagua``; see the module docstring).

    ``optimizers`` are the model's optimizers; ``algorithm`` a Bagua algorithm (the classes in
    :mod:`bagua_torch.torch_api.algorithms`, or your own subclass of its ``Algorithm``), or a name
    with its ``options`` as for :func:`bagua_torch.with_bagua` (``"diloco", sync_every=5``);
    ``process_group`` a :class:`~bagua_torch.torch_api.communication.BaguaProcessGroup` (default:
    the job's world). Collective: every rank of the group calls it, in the same order. Returns the
    wrapper to train through (``model = model.with_bagua(...)``).
    """
    if not isinstance(do_flatten, bool):
        raise TypeError(f"with_bagua: do_flatten must be a bool, got {do_flatten!r}")
    project_algorithm = as_project_algorithm(algorithm, **options)

    def build(module: nn.Module, optimizers: list[torch.optim.Optimizer], process_group: Any) -> BaguaModule:
        return BaguaModule(
            module,
            optimizers,
            project_algorithm,
            process_group=process_group,
            bucket_bytes=env.get_default_bucket_size(),
        )

    return wrap(build, self, optimizers, process_group)


def install() -> None:
    """Add :func:`with_bagua` to ``torch.nn.Module`` (done once, by importing :mod:`bagua_torch.torch_api`)."""
    nn.Module.with_bagua = with_bagua


__all__ = ["AlgorithmImplHandle", "BaguaAttributes", "BaguaModule", "ModelBucket", "install", "with_bagua", "wrap"]

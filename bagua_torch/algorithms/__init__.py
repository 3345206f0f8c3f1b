"""Bagua's data-parallel algorithms for PyTorch, by class and by name.

By class: ``bagua_torch.algorithms.ByteGradAlgorithm(hierarchical=False)``. By name:
``get_algorithm("bytegrad")`` (or pass the name wherever an algorithm is expected, e.g.
``with_bagua(model, [opt], "bytegrad")``), with keyword options:
``get_algorithm("bytegrad", error_feedback=True)``.

Built-in names and where their classes live (a module is imported on first use, so a
name whose module is not in this installation is reported as unavailable):

=============================== ====================================================== ======================================
name                            module                                                 class
=============================== ====================================================== ======================================
``gradient_allreduce``          ``bagua_torch.algorithms.gradient_allreduce``          ``GradientAllReduceAlgorithm``
``bytegrad``                    ``bagua_torch.algorithms.bytegrad``                    ``ByteGradAlgorithm``
``decentralized``               ``bagua_torch.algorithms.decentralized``               ``DecentralizedAlgorithm``
``low_precision_decentralized`` ``bagua_torch.algorithms.low_precision_decentralized`` ``LowPrecisionDecentralizedAlgorithm``
``async``                       ``bagua_torch.algorithms.async_model_average``         ``AsyncModelAverageAlgorithm``
``qadam``                       ``bagua_torch.algorithms.qadam``                       ``QAdamAlgorithm``
``onebit_adam``                 ``bagua_torch.algorithms.onebit_adam``                 ``OneBitAdamAlgorithm``
``powersgd``                    ``bagua_torch.algorithms.powersgd``                    ``PowerSGDAlgorithm``
``diloco``                      ``bagua_torch.algorithms.diloco``                      ``DiLoCoAlgorithm``
=============================== ====================================================== ======================================

The interface an algorithm implements is in :mod:`bagua_torch.algorithms.base`.
"""

from __future__ import annotations

import importlib
from typing import Any

from bagua_common.algorithms.configs import build_algorithm, unknown_algorithm
from bagua_torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    Bucket,
    Communicators,
    DoneWork,
)
from bagua_torch.algorithms.bytegrad import ByteGradAlgorithm
from bagua_torch.algorithms.gradient_allreduce import GradientAllReduceAlgorithm

BUILTIN_ALGORITHMS: dict[str, tuple[str, str]] = {
    "gradient_allreduce": ("bagua_torch.algorithms.gradient_allreduce", "GradientAllReduceAlgorithm"),
    "bytegrad": ("bagua_torch.algorithms.bytegrad", "ByteGradAlgorithm"),
    "decentralized": ("bagua_torch.algorithms.decentralized", "DecentralizedAlgorithm"),
    "low_precision_decentralized": (
        "bagua_torch.algorithms.low_precision_decentralized",
        "LowPrecisionDecentralizedAlgorithm",
    ),
    "async": ("bagua_torch.algorithms.async_model_average", "AsyncModelAverageAlgorithm"),
    "qadam": ("bagua_torch.algorithms.qadam", "QAdamAlgorithm"),
    "onebit_adam": ("bagua_torch.algorithms.onebit_adam", "OneBitAdamAlgorithm"),
    "powersgd": ("bagua_torch.algorithms.powersgd", "PowerSGDAlgorithm"),
    "diloco": ("bagua_torch.algorithms.diloco", "DiLoCoAlgorithm"),
}
"""Registry name -> (module, class name) of the built-in algorithms, imported lazily."""

_registered: dict[str, type[Algorithm]] = {}
_CLASS_MODULES = {cls: module for module, cls in BUILTIN_ALGORITHMS.values()}


def register_algorithm(name: str, cls: type[Algorithm]) -> None:
    """Make ``cls`` (an :class:`Algorithm` subclass) available under ``name`` (overrides a built-in name)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an algorithm name must be a non-empty string, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise TypeError(f"register_algorithm: {cls!r} is not a subclass of bagua_torch.algorithms.Algorithm")
    _registered[name] = cls


def _load(name: str) -> type[Algorithm] | None:
    if name in _registered:
        return _registered[name]
    module_name, class_name = BUILTIN_ALGORITHMS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        return None
    return getattr(module, class_name, None)


def available_algorithms() -> list[str]:
    """The names :func:`get_algorithm` accepts in this installation."""
    names = [name for name in BUILTIN_ALGORITHMS if name in _registered or _load(name) is not None]
    return names + [name for name in _registered if name not in BUILTIN_ALGORITHMS]


def algorithm_class(name: str) -> type[Algorithm]:
    """The class registered under ``name``; a ValueError lists the available names otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"an algorithm name must be a string, got {type(name).__name__}")
    if name not in _registered and name not in BUILTIN_ALGORITHMS:
        raise unknown_algorithm(name, available_algorithms())
    cls = _load(name)
    if cls is None:
        raise ValueError(
            f"algorithm {name!r} is not available in this installation; available: {', '.join(available_algorithms())}"
        )
    return cls


def get_algorithm(spec: str | Algorithm, **options: Any) -> Algorithm:
    """An :class:`Algorithm` from a name (with keyword ``options``) or an instance (returned as is)."""
    if isinstance(spec, Algorithm):
        if options:
            raise TypeError(f"options {sorted(options)} can only be given with an algorithm name, not an instance")
        return spec
    if isinstance(spec, type) and issubclass(spec, Algorithm):
        return spec(**options)
    if not isinstance(spec, str):
        raise TypeError(
            f"algorithm must be a name (one of {', '.join(available_algorithms())}) or a "
            f"bagua_torch.algorithms.Algorithm, got {type(spec).__name__}"
        )
    return build_algorithm(spec, algorithm_class(spec), options)


def __getattr__(name: str) -> Any:
    """Lazy access to the built-in classes not imported above (e.g. ``QAdamAlgorithm``)."""
    if name in _CLASS_MODULES:
        return getattr(importlib.import_module(_CLASS_MODULES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BUILTIN_ALGORITHMS",
    "Algorithm",
    "AlgorithmContext",
    "AlgorithmImpl",
    "Bucket",
    "ByteGradAlgorithm",
    "Communicators",
    "DoneWork",
    "GradientAllReduceAlgorithm",
    "algorithm_class",
    "available_algorithms",
    "get_algorithm",
    "register_algorithm",
]

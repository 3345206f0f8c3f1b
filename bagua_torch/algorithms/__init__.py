"""Bagua's data-parallel algorithms for PyTorch, by class and by name.

By class: ``bagua_torch.algorithms.ByteGradAlgorithm(hierarchical=False)``. By name:
``get_algorithm("bytegrad")`` (or pass the name wherever an algorithm is expected, e.g.
``with_bagua(model, [opt], "bytegrad")``), with keyword options:
``get_algorithm("bytegrad", error_feedback=True)``. The names are those of the shared
configurations (:mod:`bagua_common.algorithms.configs`); every class registers itself against
its configuration with ``@implements`` (:mod:`bagua_common.algorithms.registry`), and importing
this package imports every algorithm module. A custom algorithm may be registered under a name
of its own with :func:`register_algorithm`.

The interface an algorithm implements is in :mod:`bagua_torch.algorithms.base`.
"""

from __future__ import annotations

import warnings
from typing import Any

from bagua_common.algorithms.registry import algorithm_from, unknown_algorithm
from bagua_common.comm.topology import Communicators
from bagua_torch.algorithms.async_model_average import AsyncModelAverageAlgorithm
from bagua_torch.algorithms.base import (
    REGISTRY,
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    Bucket,
    DoneWork,
    implements,
)
from bagua_torch.algorithms.bytegrad import ByteGradAlgorithm
from bagua_torch.algorithms.decentralized import DecentralizedAlgorithm
from bagua_torch.algorithms.diloco import DiLoCoAlgorithm
from bagua_torch.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from bagua_torch.algorithms.low_precision_decentralized import LowPrecisionDecentralizedAlgorithm
from bagua_torch.algorithms.onebit_adam import OneBitAdamAlgorithm, OneBitAdamOptimizer
from bagua_torch.algorithms.powersgd import PowerSGDAlgorithm
from bagua_torch.algorithms.qadam import QAdamAlgorithm, QAdamOptimizer

_registered: dict[str, type[Algorithm]] = {}


def register_algorithm(name: str, cls: type[Algorithm]) -> None:
    """Make the custom algorithm ``cls`` (an :class:`Algorithm` subclass) available under ``name`` (it overrides a
    built-in name). Built-in algorithms register with ``@implements`` instead."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"an algorithm name must be a non-empty string, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise TypeError(f"register_algorithm: {cls!r} is not a subclass of bagua_torch.algorithms.Algorithm")
    _registered[name] = cls


def available_algorithms() -> list[str]:
    """The names :func:`get_algorithm` accepts: the built-in ones, then the custom ones."""
    names = REGISTRY.names()
    return names + [name for name in _registered if name not in names]


def algorithm_class(name: str) -> type[Algorithm]:
    """The class registered under ``name``; a ValueError lists the available names otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"an algorithm name must be a string, got {type(name).__name__}")
    if name in _registered:
        return _registered[name]
    if name not in REGISTRY.names():
        raise unknown_algorithm(name, available_algorithms())
    return REGISTRY.by_name(name)


def get_algorithm(spec: str | Algorithm, **options: Any) -> Algorithm:
    """An :class:`Algorithm` from a name (with keyword ``options``, the configuration's fields) or an instance
    (returned as is), as every entry point takes it (:func:`bagua_common.algorithms.registry.algorithm_from`)."""
    return algorithm_from(spec, options, base=Algorithm, by_name=algorithm_class)


def __getattr__(name: str) -> Any:
    """``BUILTIN_ALGORITHMS``, the name -> (module, class name) dict of the last release: deprecated for
    :func:`available_algorithms` and :func:`algorithm_class`, it goes in the next release."""
    if name == "BUILTIN_ALGORITHMS":
        warnings.warn(
            "bagua_torch.algorithms.BUILTIN_ALGORITHMS is deprecated: use available_algorithms() and "
            "algorithm_class(name); it goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return {key: (cls.__module__, cls.__name__) for key in REGISTRY.names() for cls in [REGISTRY.by_name(key)]}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "REGISTRY",
    "Algorithm",
    "AlgorithmContext",
    "AlgorithmImpl",
    "AsyncModelAverageAlgorithm",
    "Bucket",
    "ByteGradAlgorithm",
    "Communicators",
    "DecentralizedAlgorithm",
    "DiLoCoAlgorithm",
    "DoneWork",
    "GradientAllReduceAlgorithm",
    "LowPrecisionDecentralizedAlgorithm",
    "OneBitAdamAlgorithm",
    "OneBitAdamOptimizer",
    "PowerSGDAlgorithm",
    "QAdamAlgorithm",
    "QAdamOptimizer",
    "algorithm_class",
    "available_algorithms",
    "get_algorithm",
    "implements",
    "register_algorithm",
]

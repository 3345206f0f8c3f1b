"""The data-parallel algorithms, as optax-style transformations.

Each module holds a pure transform function and the class implementing
:class:`~bagua_jax.algorithms.base.Algorithm`, registered with ``@implements`` against its
shared configuration (:mod:`bagua_common.algorithms.registry`); pick one by class or by name
with :func:`make_algorithm`. Importing this package imports every algorithm module, so every
one is registered. A transform function takes its configuration as an object or as its fields,
``bytegrad(comms, ByteGradConfig(error_feedback=True))`` or ``bytegrad(comms, error_feedback=True)``,
and the bucket size as ``bucket_bytes``.
"""

from __future__ import annotations

import warnings
from typing import Any

from bagua_common.algorithms.registry import algorithm_facts, algorithm_from
from bagua_common.comm.topology import Communicators
from bagua_jax.algorithms.async_model_average import AsyncModelAverage, AsyncModelAverager, async_model_average
from bagua_jax.algorithms.base import REGISTRY, Algorithm, ConfiguredAlgorithm, implements
from bagua_jax.algorithms.bytegrad import ByteGrad, bytegrad
from bagua_jax.algorithms.decentralized import Decentralized, decentralized
from bagua_jax.algorithms.diloco import DiLoCo, diloco
from bagua_jax.algorithms.gradient_allreduce import GradientAllReduce, gradient_allreduce
from bagua_jax.algorithms.low_precision_decentralized import LowPrecisionDecentralized, low_precision_decentralized
from bagua_jax.algorithms.onebit_adam import OneBitAdam, onebit_adam
from bagua_jax.algorithms.powersgd import PowerSGD, powersgd
from bagua_jax.algorithms.qadam import QAdam, qadam


def algorithm_names() -> list[str]:
    """The names :func:`make_algorithm` accepts."""
    return REGISTRY.names()


def make_algorithm(
    spec: str | Algorithm, learning_rate: float | None = None, **options: Any
) -> Algorithm | ConfiguredAlgorithm:
    """The algorithm ``spec`` names (one of :func:`algorithm_names`), built with ``options``; an algorithm object
    is returned as it is (:func:`bagua_common.algorithms.registry.algorithm_from`, as every entry point takes it).

    ``options`` are the configuration's fields and ``bucket_bytes``; an unknown one raises a TypeError naming the
    algorithm and its options. ``learning_rate`` is used by the algorithms that are optimizers themselves (QAdam
    and OneBitAdam, which replace the user's optimizer) and ignored by the others (whose optimizer is the user's).
    """
    if isinstance(spec, str) and learning_rate is not None and is_optimizer(spec):
        options["learning_rate"] = learning_rate
    if isinstance(spec, str) and is_optimizer(spec) and "learning_rate" not in options:
        raise ValueError(
            f"{spec} is an optimizer itself and needs learning_rate (Adam with averaged momentum, it replaces the "
            f"optimizer): make_algorithm({spec!r}, learning_rate=1e-3), or learning_rate=... in DataParallel, "
            "data_parallel_optimizer or DataParallelOptimizer"
        )
    return algorithm_from(spec, options, base=Algorithm, by_name=REGISTRY.by_name)


def is_optimizer(name: str) -> bool:
    """Whether the algorithm registered as ``name`` is an optimizer itself (QAdam, OneBitAdam): it replaces the
    user's optimizer and takes its learning rate."""
    return algorithm_facts(name).is_optimizer


def __getattr__(name: str) -> Any:
    """``ALGORITHMS``, the name -> class dict of the last release: deprecated for :func:`algorithm_names` and
    ``REGISTRY.by_name``, it goes in the next release."""
    if name == "ALGORITHMS":
        warnings.warn(
            "bagua_jax.algorithms.ALGORITHMS is deprecated: use algorithm_names() and REGISTRY.by_name(name); "
            "it goes in the next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return {key: REGISTRY.by_name(key) for key in REGISTRY.names()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "REGISTRY",
    "Algorithm",
    "AsyncModelAverage",
    "AsyncModelAverager",
    "ByteGrad",
    "Communicators",
    "ConfiguredAlgorithm",
    "Decentralized",
    "DiLoCo",
    "GradientAllReduce",
    "LowPrecisionDecentralized",
    "OneBitAdam",
    "PowerSGD",
    "QAdam",
    "algorithm_names",
    "async_model_average",
    "bytegrad",
    "decentralized",
    "diloco",
    "gradient_allreduce",
    "implements",
    "is_optimizer",
    "low_precision_decentralized",
    "make_algorithm",
    "onebit_adam",
    "powersgd",
    "qadam",
]

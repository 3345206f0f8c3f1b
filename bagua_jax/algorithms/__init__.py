"""The seven data-parallel algorithms, as optax-style transformations.

Each module holds a pure transform function and a small configuration class
implementing :class:`~bagua_jax.algorithms.base.Algorithm`; pick one by class or by
name with :func:`make_algorithm`.
"""

from __future__ import annotations

from typing import Any

from bagua_common.algorithms.configs import build_algorithm, unknown_algorithm
from bagua_jax.algorithms.async_model_average import AsyncModelAverage, AsyncModelAverager, async_model_average
from bagua_jax.algorithms.base import Algorithm, Communicators
from bagua_jax.algorithms.bytegrad import ByteGrad, bytegrad
from bagua_jax.algorithms.decentralized import Decentralized, decentralized
from bagua_jax.algorithms.diloco import DiLoCo, diloco
from bagua_jax.algorithms.gradient_allreduce import GradientAllReduce, gradient_allreduce
from bagua_jax.algorithms.low_precision_decentralized import LowPrecisionDecentralized, low_precision_decentralized
from bagua_jax.algorithms.onebit_adam import OneBitAdam, onebit_adam
from bagua_jax.algorithms.powersgd import PowerSGD, powersgd
from bagua_jax.algorithms.qadam import QAdam, qadam

ALGORITHMS: dict[str, type] = {
    cls.name: cls
    for cls in (
        GradientAllReduce,
        ByteGrad,
        Decentralized,
        LowPrecisionDecentralized,
        AsyncModelAverage,
        QAdam,
        OneBitAdam,
        PowerSGD,
        DiLoCo,
    )
}
"""Registry name (that of the shared configuration in :mod:`bagua_common.algorithms.configs`) -> class."""

# Options a name alone does not say: the optimizer-replacing algorithms need their learning rate.
_NEEDS_LEARNING_RATE = ("qadam", "onebit_adam")


def make_algorithm(name: str, learning_rate: float | None = None, **options: Any) -> Algorithm:
    """Build the algorithm called ``name`` (a key of :data:`ALGORITHMS`) with ``options``.

    ``learning_rate`` is used by QAdam and OneBitAdam, which are optimizers themselves, and
    ignored by the others (whose optimizer is the user's).
    """
    if name not in ALGORITHMS:
        raise unknown_algorithm(name, ALGORITHMS)
    if name in _NEEDS_LEARNING_RATE:
        if learning_rate is None:
            raise ValueError(f"{name} is an optimizer itself and needs learning_rate")
        options["learning_rate"] = learning_rate
    return build_algorithm(name, ALGORITHMS[name], options)


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "AsyncModelAverage",
    "AsyncModelAverager",
    "ByteGrad",
    "Communicators",
    "Decentralized",
    "DiLoCo",
    "GradientAllReduce",
    "LowPrecisionDecentralized",
    "OneBitAdam",
    "PowerSGD",
    "QAdam",
    "async_model_average",
    "bytegrad",
    "decentralized",
    "diloco",
    "gradient_allreduce",
    "low_precision_decentralized",
    "make_algorithm",
    "onebit_adam",
    "powersgd",
    "qadam",
]

"""The state a trainer carries between steps, and its exchange with a flax ``TrainState``.

:class:`DataParallel` and the checkpoints take either a :class:`TrainState` or a flax
``TrainState`` (``params``, ``opt_state``, ``step``, optionally ``batch_stats``);
:func:`unwrap_state` reads either as a :class:`TrainState` and :func:`rewrap_state` gives a
result back in the form the user passed. A flax NNX model trains in place, held with its
``nnx.Optimizer`` in an :class:`NnxTrainState`.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import jax


class TrainState(NamedTuple):
    """Parameters, the algorithm's optimizer state, the step count and the model's own state.

    ``model_state`` holds a model's non-trainable collections (e.g. flax's ``batch_stats``),
    or None. In mesh mode the step count, and the parameters (and an averaged
    ``model_state``) when the algorithm keeps every replica identical, carry no device axis;
    otherwise, and for the optimizer state, each leaf has a leading axis with one row per rank.
    """

    params: Any
    opt_state: Any
    step: jax.Array
    model_state: Any = None


def is_flax_state(state: Any) -> bool:
    """A flax ``TrainState`` (or look-alike): ``params``, ``opt_state``, ``step`` and ``replace``."""
    return not isinstance(state, TrainState) and all(
        hasattr(state, name) for name in ("params", "opt_state", "step", "replace", "apply_gradients")
    )


def unwrap_state(state: Any) -> TrainState:
    """``state`` as a :class:`TrainState`: itself, or the fields of a flax ``TrainState``."""
    if isinstance(state, TrainState):
        return state
    if is_flax_state(state):
        return TrainState(state.params, state.opt_state, state.step, getattr(state, "batch_stats", None))
    raise TypeError(f"DataParallel.step: state must be what init() returned, got {type(state).__name__}")


def rewrap_state(user_state: Any, state: TrainState) -> Any:
    """``state`` in the form the user gave: itself when ``user_state`` is None, else ``user_state`` updated."""
    if user_state is None:
        return state
    fields = {"params": state.params, "opt_state": state.opt_state, "step": state.step}
    if hasattr(user_state, "batch_stats"):
        fields["batch_stats"] = state.model_state
    return user_state.replace(**fields)


class NnxTrainState(NamedTuple):
    """A flax NNX model and the ``nnx.Optimizer`` that trains it data-parallel; both change in place on each step."""

    model: Any
    optimizer: Any


def is_nnx_module(value: Any) -> bool:
    """Whether ``value`` is a flax NNX module (flax stays optional: none is one unless ``flax.nnx`` is imported)."""
    nnx = sys.modules.get("flax.nnx")
    return nnx is not None and isinstance(value, nnx.Module)

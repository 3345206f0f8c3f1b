"""What every data-parallel algorithm provides.

An algorithm is a small configuration object. Given the user's optax optimizer and
the communicators of the run, it builds one optax
``GradientTransformationExtraArgs``: the per-rank update that turns this rank's
local gradients (and its parameters, passed as ``params``) into parameter updates,
communicating as the algorithm prescribes. It runs inside the per-rank step
(``jax.shard_map`` with :class:`~bagua_jax.LaxCommunicator`, or a per-process
``jax.jit`` with :class:`~bagua_jax.NativeCommunicator`), and its state is a pytree
of arrays that can be checkpointed and restored.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import optax

from bagua_common.algorithms.configs import config_options
from bagua_common.algorithms.option_checks import check_bucket_bytes
from bagua_common.comm.topology import Communicators


class Algorithm(Protocol):
    """A data-parallel training algorithm (see the module docstring)."""

    def transformation(
        self, optimizer: optax.GradientTransformation | None, comms: Communicators
    ) -> optax.GradientTransformationExtraArgs:
        """The per-rank update: local gradients and ``params`` in, parameter updates out.
        ``optimizer`` is None for algorithms that are optimizers themselves (QAdam, OneBitAdam)."""


class ConfiguredAlgorithm:
    """What a JAX algorithm adds to its shared configuration (:mod:`bagua_common.algorithms.configs`): a
    ``bucket_bytes`` field, checked here, and :meth:`transformation`, its optax transform (``_transform``, called
    with the communicators and every field) chained before the optimizer, or after it when
    ``_after_optimizer`` (weight-averaging algorithms, which need ``params``).
    """

    _transform: ClassVar[Callable[..., optax.GradientTransformationExtraArgs]]
    _after_optimizer: ClassVar[bool] = False

    def __post_init__(self) -> None:
        super().__post_init__()  # the shared configuration's checks
        check_bucket_bytes(self.bucket_bytes, self.name)

    def transformation(
        self, optimizer: optax.GradientTransformation, comms: Communicators
    ) -> optax.GradientTransformationExtraArgs:
        """The per-rank update: this algorithm's transform chained with the user's ``optimizer``."""
        transform = type(self)._transform(comms, **config_options(self))
        return optax.chain(optimizer, transform) if self._after_optimizer else optax.chain(transform, optimizer)


def check_weights_given(params: Any, algorithm: str) -> None:
    """Raise a ValueError unless ``params`` (the weights an algorithm that averages weights needs) was given."""
    if params is None:
        raise ValueError(
            f"{algorithm} communicates weights: call update(updates, state, params) with the weights the updates "
            "will be applied to"
        )


def step_counter_init(make_state: Callable[..., Any]) -> Callable[[Any], Any]:
    """An optax ``init`` for a state that only counts steps: ``make_state(step=0)`` (int32), after checking that
    the parameters are floating point."""

    def init_fn(params: Any) -> Any:
        check_float_params(params)
        return make_state(step=jnp.zeros([], jnp.int32))

    return init_fn


def check_float_params(params: Any) -> None:
    """Raise a clear error if any parameter is not floating point."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating):
            raise TypeError(
                f"parameter {jax.tree_util.keystr(path)} has dtype {jnp.asarray(leaf).dtype}; "
                "data-parallel algorithms train floating-point parameters only"
            )


def check_communicators(comms: Any, algorithm: str) -> Communicators:
    """``comms`` as :class:`Communicators`: a single communicator becomes ``Communicators(world=comms)``.

    Anything else raises a TypeError that says what is expected.
    """
    if isinstance(comms, Communicators):
        return comms
    if all(callable(getattr(comms, name, None)) for name in ("allreduce", "allgather", "rank")):
        return Communicators(world=comms)
    raise TypeError(
        f"{algorithm}: comms must be a communicator (e.g. bagua_jax.NativeCommunicator.world()) or a "
        f"bagua_jax.algorithms.base.Communicators, got {type(comms).__name__}"
    )


def check_float_grads(grads: Any, algorithm: str) -> None:
    """Raise a TypeError naming the first non-floating gradient leaf (integer gradients cannot be averaged)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(grads):
        if not jnp.issubdtype(leaf.dtype, jnp.floating):
            raise TypeError(
                f"{algorithm}: gradient {jax.tree_util.keystr(path)} has dtype {leaf.dtype}; "
                "gradients must be floating point"
            )


def _varying_axes(x: Any) -> frozenset[str]:
    # Inside shard_map JAX types each value with the mesh axes it varies over: jax >= 0.10
    # exposes them as ``manual_axis_type.varying``, earlier releases as ``vma``; outside
    # shard_map the set is empty.
    aval = jax.typeof(x)
    kind = getattr(aval, "manual_axis_type", None)
    return frozenset(kind.varying if kind is not None else getattr(aval, "vma", ()))


def varying_over(tree: Any, axes: frozenset[str]) -> Any:
    """``tree`` with every leaf typed as varying over ``axes`` (a cast of the type, not the values).

    The branches of a ``lax.cond`` inside ``shard_map`` must return the same types; a branch
    that communicates returns values varying over the mesh axes, one that does not may not.
    """
    cast = getattr(jax.lax, "pcast", None)

    def widen(leaf: Any) -> Any:
        missing = tuple(sorted(axes - _varying_axes(leaf)))
        if not missing:
            return leaf
        return cast(leaf, missing, to="varying") if cast else jax.lax.pvary(leaf, missing)

    return jax.tree.map(widen, tree)


def varying_like(tree: Any, like: Any) -> Any:
    """``tree`` typed as varying over every mesh axis any leaf of ``like`` varies over."""
    axes = frozenset().union(*(_varying_axes(leaf) for leaf in jax.tree.leaves(like)))
    return varying_over(tree, axes)

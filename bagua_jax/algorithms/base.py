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
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import optax

from bagua_common.algorithms.option_checks import check_bucket_bytes
from bagua_common.algorithms.registry import AlgorithmRegistry, as_config
from bagua_common.comm.topology import Communicators
from bagua_jax.bucketing import DEFAULT_BUCKET_BYTES

REGISTRY = AlgorithmRegistry("bagua_jax")
"""This front end's algorithm classes, by configuration class and by name."""

implements = REGISTRY.implements
"""The class decorator that registers a JAX algorithm against its shared configuration (see
:mod:`bagua_common.algorithms.registry` for how a new algorithm registers)."""


@runtime_checkable
class Algorithm(Protocol):
    """A data-parallel training algorithm (see the module docstring): any object with :meth:`transformation`."""

    def transformation(
        self, optimizer: optax.GradientTransformation | None, comms: Communicators
    ) -> optax.GradientTransformationExtraArgs:
        """The per-rank update: local gradients and ``params`` in, parameter updates out.
        ``optimizer`` is None for algorithms that are optimizers themselves (QAdam, OneBitAdam)."""


@dataclass(frozen=True, init=False)
class ConfiguredAlgorithm:
    """A registered JAX algorithm: it holds its shared configuration ``config`` (an instance of ``config_class``,
    :mod:`bagua_common.algorithms.configs`, which checked its own fields) and the size of its buckets,
    ``bucket_bytes``. Build it from the configuration's fields, ``ByteGrad(hierarchical=False)``, or
    from a configuration, ``ByteGrad(ByteGradConfig(hierarchical=False))``; the fields read through,
    ``algorithm.hierarchical``.

    A subclass names its optax transform function, ``_transform(comms, config, bucket_bytes=...)``;
    :meth:`transformation` chains it before the user's optimizer, or after it when ``after_optimizer``
    (weight-averaging algorithms, which need ``params``).
    """

    name: ClassVar[str]
    config_class: ClassVar[type]
    after_optimizer: ClassVar[bool] = False
    fault_tolerant: ClassVar[bool] = False
    """Whether a fault-tolerant job (:class:`~bagua_jax.fault_tolerance.FaultTolerantTrainer`) trains it on through a
    change of members, its state carried by the rules of :mod:`bagua_jax.state_rules` (tested); the others are refused,
    naming the elastic restart. The torch front end's algorithms declare the same."""
    _transform: ClassVar[Callable[[Communicators, Any, int], optax.GradientTransformationExtraArgs]]

    config: Any
    bucket_bytes: int

    def __init__(self, *args: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES, **options: Any):
        if "config" in options:  # how dataclasses.replace passes the configuration
            args = (options.pop("config"), *args)
        config = as_config(self.config_class, *args, **options)
        # A frozen dataclass sets its own fields through object.__setattr__ in the __init__ it generates.
        object.__setattr__(self, "config", config)
        object.__setattr__(self, "bucket_bytes", check_bucket_bytes(bucket_bytes, self.name))

    def __getattr__(self, key: str) -> Any:
        if key in {field.name for field in fields(self.config_class)}:
            return getattr(self.config, key)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")

    def replace(self, **changes: Any) -> ConfiguredAlgorithm:
        """A copy with ``changes`` to the configuration's fields and ``bucket_bytes``; the variant it was made with
        (:meth:`_variant`) stays (the bucket autotuner replaces the algorithm it was given)."""
        bucket_bytes = changes.pop("bucket_bytes", self.bucket_bytes)
        copy = type(self)(replace(self.config, **changes), bucket_bytes=bucket_bytes)
        return copy._variant(**{k: v for k, v in vars(self).items() if k not in ("config", "bucket_bytes")})

    def _variant(self, **flags: Any) -> ConfiguredAlgorithm:
        """This algorithm with the class attributes ``flags`` set on it alone (a variant a fault-tolerant job uses)."""
        for key, value in flags.items():
            object.__setattr__(self, key, value)
        return self

    def transform(self, comms: Communicators) -> optax.GradientTransformationExtraArgs:
        """This algorithm's optax transform over ``comms``: ``_transform(comms, config, bucket_bytes=...)``."""
        return type(self)._transform(comms, self.config, bucket_bytes=self.bucket_bytes)

    def transformation(
        self, optimizer: optax.GradientTransformation, comms: Communicators
    ) -> optax.GradientTransformationExtraArgs:
        """The per-rank update: :meth:`transform` chained with the user's ``optimizer``."""
        transform = self.transform(comms)
        return optax.chain(optimizer, transform) if self.after_optimizer else optax.chain(transform, optimizer)


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

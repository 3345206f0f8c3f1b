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

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import optax

from bagua_common.topology import check_two_levels
from bagua_jax.communicator import Communicator


class Communicators(NamedTuple):
    """The communicators of a run: everyone, and for hierarchical algorithms the two levels.

    ``intra`` groups the ranks of one node (the fast axis), ``inter`` the ranks with the
    same local index across nodes (the slow axis). Both are None on a flat topology, and
    hierarchical algorithms then communicate over ``world`` alone.
    """

    world: Communicator
    intra: Communicator | None = None
    inter: Communicator | None = None

    @property
    def hierarchical(self) -> bool:
        return self.intra is not None and self.inter is not None


class Algorithm(Protocol):
    """A data-parallel training algorithm (see the module docstring)."""

    def transformation(
        self, optimizer: optax.GradientTransformation | None, comms: Communicators
    ) -> optax.GradientTransformationExtraArgs:
        """The per-rank update: local gradients and ``params`` in, parameter updates out.
        ``optimizer`` is None for algorithms that are optimizers themselves (QAdam, OneBitAdam)."""


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


def two_levels(comms: Communicators, hierarchical: bool, algorithm: str) -> tuple[Communicator, Communicator] | None:
    """``(intra, inter)`` when ``hierarchical`` is asked for and both levels are set, else None (flat over ``world``).

    Called while tracing, where every size is known; raises a ValueError if the two levels do not tile ``world``.
    """
    if not (hierarchical and comms.hierarchical):
        return None
    intra, inter = comms.intra, comms.inter
    check_two_levels(intra.size, inter.size, comms.world.size, algorithm)
    return intra, inter


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

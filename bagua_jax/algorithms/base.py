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
        self, optimizer: optax.GradientTransformation, comms: Communicators
    ) -> optax.GradientTransformationExtraArgs:
        """The per-rank update: local gradients and ``params`` in, parameter updates out."""


def check_float_params(params: Any) -> None:
    """Raise a clear error if any parameter is not floating point."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        if not jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.floating):
            raise TypeError(
                f"parameter {jax.tree_util.keystr(path)} has dtype {jnp.asarray(leaf).dtype}; "
                "data-parallel algorithms train floating-point parameters only"
            )

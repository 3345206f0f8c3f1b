"""The simple case in a handful of lines: a data-parallel train step.

:class:`DataParallel` turns a per-example-batch loss function, an optax optimizer
and an algorithm into a jitted train step. It runs either

* over a device mesh (one process with several devices, or several processes
  under ``jax.distributed``, joined with :func:`bagua_jax.distributed.initialize`): the step is a ``jax.shard_map`` over every mesh
  axis, each device is one rank, and the algorithms communicate with JAX's own
  collectives (:class:`~bagua_jax.LaxCommunicator`). A 1-D mesh is a flat
  topology; a 2-D mesh ``("inter", "intra")`` is nodes by devices per node, and
  hierarchical algorithms reduce over the fast ``intra`` axis first; or
* over a :class:`~bagua_jax.NativeCommunicator` (one device per process, MPI or
  NCCL underneath): the step is a plain ``jax.jit`` of one rank's work.

Every rank keeps its own parameters and algorithm state (decentralized algorithms
let them drift apart), so in mesh mode each leaf of the :class:`TrainState` has a
leading axis with one row per rank, sharded across the devices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bagua_jax.algorithms.base import Algorithm, Communicators, check_float_params
from bagua_jax.lax_communicator import LaxCommunicator
from bagua_jax.native_communicator import NativeCommunicator
from bagua_jax.signature import check_ranks_agree

LossFn = Callable[[Any, Any], jax.Array]


class TrainState(NamedTuple):
    """Parameters, the algorithm's optimizer state and the step count (per rank in mesh mode)."""

    params: Any
    opt_state: Any
    step: jax.Array


class DataParallel:
    """A data-parallel trainer: ``state = dp.init(params)``, then ``state, loss = dp.step(state, batch)``.

    ``loss_fn(params, batch)`` computes one rank's loss on its part of the batch.
    ``optimizer`` is an optax transformation (``None`` for algorithms that are
    optimizers themselves, QAdam and OneBitAdam). Give exactly one of ``mesh``
    (mesh mode; the batch's leading axis is split across all devices) or
    ``communicator`` (native mode; each process passes its own batch).
    """

    def __init__(
        self,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation | None,
        algorithm: Algorithm,
        *,
        mesh: Mesh | None = None,
        communicator: NativeCommunicator | None = None,
    ):
        if (mesh is None) == (communicator is None):
            raise ValueError("give exactly one of mesh= (JAX collectives) or communicator= (native engine)")
        self._loss_fn = loss_fn
        self._mesh = mesh
        self._algorithm = algorithm
        self._communicator = communicator
        if mesh is not None:
            if not 1 <= len(mesh.axis_names) <= 2:
                raise ValueError(f"the mesh needs 1 axis (flat) or 2 axes (inter, intra), got {mesh.axis_names}")
            axes = tuple(mesh.axis_names)
            comms = Communicators(
                world=LaxCommunicator(axes if len(axes) > 1 else axes[0], int(np.prod(mesh.devices.shape))),
                intra=LaxCommunicator(axes[1], mesh.shape[axes[1]]) if len(axes) == 2 else None,
                inter=LaxCommunicator(axes[0], mesh.shape[axes[0]]) if len(axes) == 2 else None,
            )
            self._ranks = P(axes)
        else:
            comms = Communicators(world=communicator)
        self.size = comms.world.size
        self._tx = algorithm.transformation(optimizer, comms)
        self._step = jax.jit(self._sharded(self._rank_step, 3) if mesh is not None else self._rank_step)
        self._init = jax.jit(self._sharded(self._tx.init, 1) if mesh is not None else self._tx.init)

    def _rank_step(self, params: Any, opt_state: Any, step: jax.Array, batch: Any):
        loss, grads = jax.value_and_grad(self._loss_fn)(params, batch)
        updates, opt_state = self._tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, step + 1, loss

    def _sharded(self, fn: Callable, stacked: int) -> Callable:
        """``fn`` on each rank: its first ``stacked`` arguments carry one row per rank
        (rows stacked across the mesh, like the results); the rest (the batch) are split
        along their leading axis."""

        def per_rank(*args):
            rows = jax.tree.map(lambda a: a[0], args[:stacked])
            out = fn(*rows, *args[stacked:])
            return jax.tree.map(lambda a: jnp.asarray(a)[None], out)

        return jax.shard_map(per_rank, mesh=self._mesh, in_specs=self._ranks, out_specs=self._ranks)

    def _per_rank(self, tree: Any) -> Any:
        """Stack a copy of each leaf per rank, sharded one row per device."""
        sharding = NamedSharding(self._mesh, self._ranks)

        def stack(leaf):
            leaf = np.asarray(leaf)
            rows = np.broadcast_to(leaf, (self.size, *leaf.shape))
            return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])

        return jax.tree.map(stack, tree)

    def init(self, params: Any) -> TrainState:
        """The initial state: every rank starts from ``params`` (pass the same on every process).

        First checks that every rank trains the same tree of shapes and dtypes with the same
        algorithm configuration, and raises a ``ValueError`` naming each difference if not.
        """
        check_float_params(params)
        check_ranks_agree(params, self._algorithm, self._communicator)
        if self._mesh is None:
            params = jax.tree.map(jnp.asarray, params)
            return TrainState(params, self._init(params), jnp.int32(0))
        params = self._per_rank(params)
        return TrainState(params, self._init(params), self._per_rank(np.int32(0)))

    def shard_batch(self, batch: Any) -> Any:
        """Place a global batch (mesh mode): its leading axis is split evenly across the ranks.

        Under ``jax.distributed`` every process passes its own part, which becomes its
        devices' rows.
        """
        sharding = NamedSharding(self._mesh, self._ranks)

        def place(leaf):
            if isinstance(leaf, jax.Array) and leaf.sharding == sharding:
                return leaf
            leaf = np.asarray(leaf)
            if jax.process_count() > 1:
                return jax.make_array_from_process_local_data(sharding, leaf)
            if leaf.shape[0] % self.size:
                raise ValueError(f"a batch of {leaf.shape[0]} does not split evenly across {self.size} ranks")
            return jax.device_put(leaf, sharding)

        return jax.tree.map(place, batch)

    def step(self, state: TrainState, batch: Any) -> tuple[TrainState, jax.Array]:
        """One training step on every rank; returns the new state and the ranks' mean loss."""
        if self._mesh is not None:
            batch = self.shard_batch(batch)
        params, opt_state, step, loss = self._step(state.params, state.opt_state, state.step, batch)
        return TrainState(params, opt_state, step), jnp.mean(loss)

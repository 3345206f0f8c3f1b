"""The simple case in a handful of lines: a data-parallel train step.

:class:`DataParallel` turns a per-example-batch loss function, an optax optimizer
and an algorithm into a jitted train step. It runs either

* over a device mesh (one process with several devices, or several processes
  under ``jax.distributed``, joined with :func:`bagua_jax.distributed.initialize`): the step is a
  ``jax.shard_map`` over every mesh axis, each device is one rank, and the algorithms communicate
  with JAX's own collectives (:class:`~bagua_jax.LaxCommunicator`). A 1-D mesh is a flat
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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bagua_common.comm.topology import Communicators
from bagua_common.tuning.autotune import autotune_mode
from bagua_jax.algorithms import make_algorithm
from bagua_jax.algorithms.base import Algorithm, check_float_params
from bagua_jax.autotune import BucketTuning, algorithm_setting, tune_bucket_bytes
from bagua_jax.lax_communicator import LaxCommunicator
from bagua_jax.native_communicator import NativeCommunicator
from bagua_jax.signature import check_batches_differ, check_ranks_agree
from bagua_jax.step_means import StepMeans
from bagua_jax.train_state import (
    NnxTrainState,
    TrainState,
    is_flax_state,
    is_nnx_module,
    rewrap_state,
    unwrap_state,
)

LossFn = Callable[..., Any]


class DataParallel:
    """A data-parallel trainer: ``state = dp.init(params)``, then ``state, loss = dp.step(state, batch)``.

    ``loss_fn(params, batch)`` computes one rank's loss on its part of the batch.
    ``optimizer`` is an optax transformation (``None`` for algorithms that are
    optimizers themselves, QAdam and OneBitAdam). ``algorithm`` is an
    :class:`~bagua_jax.algorithms.base.Algorithm` or a registry name (``"bytegrad"``, one of
    :func:`bagua_jax.algorithms.algorithm_names`), whose options follow as keywords
    (``DataParallel(loss_fn, optax.sgd(0.1), "diloco", sync_every=5, mesh=mesh)``; QAdam and OneBitAdam
    take ``learning_rate``; see :func:`~bagua_jax.algorithms.make_algorithm`). Give exactly one of ``mesh``
    (mesh mode; the batch's leading axis is split across all devices) or
    ``communicator`` (native mode; each process passes its own batch).

    What a flax or equinox train step needs is accepted as it is:

    * ``has_aux=True``: ``loss_fn`` returns ``(loss, aux)``, and :meth:`step` returns
      ``state, (loss, aux)`` with ``aux`` averaged over the ranks in mesh mode;
    * model state (``init(params, model_state=...)``, or a flax ``TrainState`` with a
      ``batch_stats`` field): ``loss_fn(params, batch, model_state=...)`` returns
      ``(loss, new_model_state)`` (``(loss, (new_model_state, aux))`` with ``has_aux``);
      the new state is averaged across ranks (``average_model_state=True``, e.g. BatchNorm
      statistics) or kept per rank;
    * randomness: ``step(state, batch, rng)`` passes ``loss_fn`` a key of its own on every
      rank (``rng`` folded with the rank index), e.g. for dropout;
    * a flax ``TrainState`` in :meth:`init` comes back from :meth:`init` and :meth:`step` as
      the same class, its ``params``, ``opt_state``, ``step`` (and ``batch_stats``) replaced;
    * a flax NNX module (native mode): ``init(model)`` returns an
      :class:`~bagua_jax.train_state.NnxTrainState` of the model and a
      :class:`~bagua_jax.nnx_data_parallel.DataParallelOptimizer` (an ``nnx.Optimizer`` over its
      ``nnx.Param`` variables), and ``step(state, batch, rngs)`` updates both in place, calling
      ``loss_fn(model, batch, rngs)`` (``loss_fn(model, batch)`` without ``rngs``) with an
      ``nnx.Rngs`` of the rank's own; the model's ``nnx.BatchStat`` variables (BatchNorm's
      statistics) are averaged across ranks after every step.

    The loss :meth:`step` returns (and ``aux``) is the mean over the ranks, except in native mode under
    the decentralized, asynchronous and DiLoCo algorithms, which return each rank's own (see :meth:`step`).
    In native mode the first step checks that the processes' batches differ and raises a ``ValueError`` when
    every process passes the same one (the whole global batch instead of its part).

    ``autotune`` (``off``, ``once`` or ``cached``; default ``BAGUA_AUTOTUNE``, off when unset)
    tunes the algorithm's bucket size (and, where they have an effect, ``hierarchical`` and the MPI
    ring threshold) in :meth:`init` with :func:`bagua_jax.autotune.tune_bucket_bytes` (the result is
    in :attr:`bucket_tuning`); compressed algorithms refuse it, since their bucket layout changes
    their numbers.
    """

    # Native mode checks on the first step that the processes' batches differ (see step()).
    _checks_batches = True

    def __init__(
        self,
        loss_fn: LossFn,
        optimizer: optax.GradientTransformation | None,
        algorithm: Algorithm | str,
        *,
        mesh: Mesh | None = None,
        communicator: NativeCommunicator | None = None,
        has_aux: bool = False,
        average_model_state: bool = True,
        autotune: str | None = None,
        **algorithm_options: Any,
    ):
        if (mesh is None) == (communicator is None):
            raise ValueError("give exactly one of mesh= (JAX collectives) or communicator= (native engine)")
        for name, flag in (("has_aux", has_aux), ("average_model_state", average_model_state)):
            if not isinstance(flag, bool):
                raise TypeError(f"DataParallel: {name} must be a bool, got {flag!r}")
        self._loss_fn = loss_fn
        self._has_aux = has_aux
        self._average_model_state = average_model_state
        self._mesh = mesh
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
        self._world = comms.world
        self._optimizer, self._comms = optimizer, comms
        self._autotune = autotune_mode(autotune)
        self.bucket_tuning: BucketTuning | None = None
        self._batches_checked = communicator is None or not self._checks_batches
        self._use(make_algorithm(algorithm, **algorithm_options))

    def _use(self, algorithm: Algorithm) -> None:
        """Build the per-rank update of ``algorithm``; steps compiled for another one are dropped."""
        self._algorithm = algorithm
        self._replicated = getattr(algorithm, "replicas_identical", False)
        self._tx = algorithm.transformation(self._optimizer, self._comms)
        self._steps: dict[tuple[bool, bool], Callable] = {}
        self._nnx_step: Callable | None = None
        self._init = jax.jit(self._sharded(self._tx.init, (True,)) if self._mesh is not None else self._tx.init)

    def recompile(self) -> None:
        """Drop the compiled steps (the next :meth:`step` is traced again): after the world size changed."""
        self._use(self._algorithm)

    @property
    def size(self) -> int:
        """The number of ranks (native mode: the communicator's now, which follow a fault-tolerant job's members)."""
        return self._world.size

    @property
    def algorithm(self) -> Algorithm:
        """The algorithm this trainer was built with."""
        return self._algorithm

    @property
    def mesh(self) -> Mesh | None:
        """The device mesh (mesh mode), or None (native mode)."""
        return self._mesh

    @property
    def communicator(self) -> NativeCommunicator | None:
        """The native communicator (native mode), or None (mesh mode)."""
        return self._communicator

    def _rank_step(self, params: Any, opt_state: Any, step: jax.Array, model_state: Any, batch: Any, rng: Any):
        extras = {}
        if model_state is not None:
            extras["model_state"] = model_state
        if rng is not None:
            extras["rng"] = jax.random.fold_in(rng, self._world.rank())
        returns_aux = self._has_aux or model_state is not None
        value, grads = jax.value_and_grad(self._loss_fn, has_aux=returns_aux)(params, batch, **extras)
        loss, aux = value if returns_aux else (value, None)
        if model_state is not None:
            model_state, aux = aux if self._has_aux else (aux, None)
        # One message for the model state and (native mode, replicas kept identical; the mesh's is taken in
        # step()) the loss and aux, carried with the gradients where the algorithm can.
        shared_state = model_state if self._average_model_state else None
        averages_loss = self._mesh is None and self._replicated
        step_means = StepMeans((shared_state, (loss, aux) if averages_loss else None))
        updates, opt_state = self._tx.update(grads, opt_state, params, step_means=step_means)
        shared_state, mean_loss = step_means.result(self._world)
        if self._average_model_state:
            model_state = shared_state
        if averages_loss:
            loss, aux = mean_loss
        return optax.apply_updates(params, updates), opt_state, step + 1, model_state, loss, aux

    def _sharded(self, fn: Callable, per_rank_args: tuple[bool, ...], per_rank_out: Any = None) -> Callable:
        """``fn`` on each rank under ``shard_map``.

        ``per_rank_args[i]`` tells whether argument ``i`` carries one row per rank (stacked
        across the mesh) or one copy for all (replicated); the arguments after those (the
        batch, the key) are split along their leading axis or replicated. ``per_rank_out``
        does the same for the results (a tuple of bools, or None for all per rank).
        """
        stacked = len(per_rank_args)
        out_rows = per_rank_out

        def per_rank(*args):
            rows = [jax.tree.map(lambda a: a[0], a) if s else a for a, s in zip(args[:stacked], per_rank_args)]
            out = fn(*rows, *args[stacked:])
            if out_rows is None:
                return jax.tree.map(lambda a: jnp.asarray(a)[None], out)
            return tuple(jax.tree.map(lambda a: jnp.asarray(a)[None], o) if s else o for o, s in zip(out, out_rows))

        def spec(per_rank_flag: bool) -> P:
            return self._ranks if per_rank_flag else P()

        in_specs = tuple(spec(s) for s in per_rank_args)
        out_specs = self._ranks if out_rows is None else tuple(spec(s) for s in out_rows)
        replicated_out = out_rows is not None and not all(out_rows)

        def sharded(*args):
            extra = tuple(self._ranks if i == 0 else P() for i in range(len(args) - stacked))
            # Replicated results (identical parameters) are each rank's own copy: the algorithm
            # keeps them bit-identical, which JAX's replication check cannot see through the
            # custom calls and all-to-alls.
            return jax.shard_map(
                per_rank,
                mesh=self._mesh,
                in_specs=in_specs + extra,
                out_specs=out_specs,
                check_vma=not replicated_out,
            )(*args)

        return sharded

    def _step_fn(self, has_model_state: bool, has_rng: bool) -> Callable:
        key = (has_model_state, has_rng)
        if key not in self._steps:
            if self._mesh is None:
                self._steps[key] = jax.jit(self._rank_step)
            else:
                shared_model_state = has_model_state and self._average_model_state and self._replicated
                layout = (not self._replicated, True, False, has_model_state and not shared_model_state)
                out = (*layout, True, True)
                self._steps[key] = jax.jit(self._sharded(self._rank_step, layout, out))
        return self._steps[key]

    def _per_rank(self, tree: Any) -> Any:
        """Stack a copy of each leaf per rank, sharded one row per device."""
        sharding = NamedSharding(self._mesh, self._ranks)

        def stack(leaf):
            leaf = np.asarray(leaf)
            rows = np.broadcast_to(leaf, (self.size, *leaf.shape))
            return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])

        return jax.tree.map(stack, tree)

    def _replicate(self, tree: Any) -> Any:
        """One copy of each leaf on every device."""
        sharding = NamedSharding(self._mesh, P())
        return jax.tree.map(
            lambda leaf: jax.make_array_from_callback(np.shape(leaf), sharding, lambda index: np.asarray(leaf)[index]),
            tree,
        )

    def init(self, params: Any, *, model_state: Any = None) -> Any:
        """The initial state: every rank starts from ``params`` (pass the same on every process).

        ``params`` may also be a flax ``TrainState``: the same class comes back, its ``opt_state`` replaced by the
        algorithm's state (its ``batch_stats``, if it has that field, is the model state). Otherwise a
        :class:`TrainState` is returned. First checks that every rank trains the same tree of shapes and dtypes
        with the same algorithm configuration, and raises a ``ValueError`` naming each difference if not."""
        if is_nnx_module(params):
            return self._init_nnx(params)
        user_state = params if is_flax_state(params) else None
        if user_state is not None:
            params, model_state = user_state.params, getattr(user_state, "batch_stats", None)
        check_float_params(params)
        check_ranks_agree(params, self._algorithm, self._communicator)
        if self._autotune != "off" and self.bucket_tuning is None:
            self.bucket_tuning = tune_bucket_bytes(
                params,
                self._algorithm,
                self._communication_step(params),
                mesh=self._mesh,
                communicator=self._communicator,
                mode=self._autotune,
            )
            self._use(self._algorithm.replace(**dict(algorithm_setting(self.bucket_tuning.setting))))
        if self._mesh is None:
            params = jax.tree.map(jnp.asarray, params)
            model_state = jax.tree.map(jnp.asarray, model_state)
            opt_state, step = self._init(params), jnp.int32(0)
        else:
            stacked = self._per_rank(params)
            opt_state, step = self._init(stacked), self._replicate(np.int32(0))
            params = self._replicate(params) if self._replicated else stacked
            if model_state is not None:
                shared = self._average_model_state and self._replicated
                model_state = self._replicate(model_state) if shared else self._per_rank(model_state)
        return rewrap_state(user_state, TrainState(params, opt_state, step, model_state))

    def _init_nnx(self, model: Any) -> NnxTrainState:
        """The NNX model and an ``nnx.Optimizer`` whose transformation is the algorithm's (native mode)."""
        from flax import nnx

        from bagua_jax.nnx_data_parallel import DataParallelOptimizer, nnx_rank_step

        if self._mesh is not None:
            raise ValueError(
                "DataParallel trains an NNX module in place, in native mode (communicator=, one process per "
                "device); on a mesh, give it the module's parameters as a pytree (nnx.split) and a pure loss_fn"
            )
        if self._autotune != "off" or not self._average_model_state:
            raise ValueError(
                "DataParallel: an NNX module trains without autotune, its BatchNorm statistics averaged "
                "(autotune and average_model_state=False take a pytree of parameters)"
            )
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        check_float_params(params)
        check_ranks_agree(params, self._algorithm, self._communicator)
        if self._nnx_step is None:
            self._nnx_step = nnx_rank_step(self._loss_fn, self._has_aux, self._communicator, self._replicated)
        optimizer = DataParallelOptimizer(model, self._optimizer, self._algorithm, communicator=self._communicator)
        return NnxTrainState(model, optimizer)

    def params_view(self, state: Any, view: str = "average") -> Any:
        """The parameters as one model's, without a rank axis, for evaluation whatever the algorithm.

        ``view="average"`` is the mean of the ranks' parameters, ``"rank0"`` rank 0's. Algorithms that keep
        the replicas identical return the parameters as they are; decentralized ones, whose parameters carry
        one row per rank on a mesh (and differ per process in native mode, where every process must call
        this together), are reduced to one copy on every rank.
        """
        if view not in ("average", "rank0"):
            raise ValueError(f"params_view: view must be 'average' or 'rank0', got {view!r}")
        params = unwrap_state(state).params
        if self._replicated:
            return params
        if self._mesh is not None:
            rows = jax.device_get(params)  # on the host: see the note on cross-device programs in step()
            return jax.tree.map(
                lambda a: (a.mean(0, dtype=np.float64) if view == "average" else a[0]).astype(a.dtype), rows
            )
        if view == "rank0":
            return jax.tree.map(lambda leaf: self._world.broadcast(leaf, 0), params)
        return jax.tree.map(lambda leaf: self._world.allreduce(leaf, "avg"), params)

    def _communication_step(self, params: Any) -> Callable[[Algorithm], Callable[[], Any]]:
        """For tuning: ``params``' step on this job under a candidate algorithm, its loss nearly free."""

        def step_for(algorithm: Algorithm) -> Callable[[], Any]:
            trainer = _TuningProbe(
                _half_square,
                optax.sgd(0.0),
                algorithm,
                mesh=self._mesh,
                communicator=self._communicator,
                autotune="off",
            )
            state = trainer.init(params)
            batch = np.zeros((trainer.size if self._mesh is not None else 1,), np.float32)
            return lambda: trainer.step(state, batch)

        return step_for

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

    def compile(self, state: Any, batch: Any, rng: Any = None) -> None:
        """Compile the step for ``state``'s, ``batch``'s and ``rng``'s shapes without running it: the first
        :meth:`step` on such arguments then runs at once (a fault-tolerant joiner compiles before it asks to join)."""
        if isinstance(state, NnxTrainState):
            raise TypeError("DataParallel.compile takes the state of a pytree of parameters, not an NNX model's")
        own = unwrap_state(state)
        batch = self.shard_batch(batch) if self._mesh is not None else batch
        step_fn = self._step_fn(own.model_state is not None, rng is not None)
        step_fn.lower(own.params, own.opt_state, own.step, own.model_state, batch, rng).compile()

    def step(self, state: Any, batch: Any, rng: Any = None) -> tuple[Any, Any]:
        """One training step on every rank; returns the new state and the ranks' mean loss.

        In native mode, an algorithm whose replicas differ between averagings (decentralized, asynchronous,
        DiLoCo) returns each rank's own loss and aux, as torch's step does: their mean would make every rank
        wait for every other at each step, the synchronization these algorithms exist to avoid.

        With ``has_aux=True`` the second result is ``(loss, aux)``. ``rng`` (the same key on every rank; for an NNX
        model, also an ``nnx.Rngs``) gives ``loss_fn`` a per-rank key; ``state`` is what :meth:`init` returned."""
        if not self._batches_checked:
            check_batches_differ(batch, self._communicator)
            self._batches_checked = True
        if isinstance(state, NnxTrainState):
            return state, self._nnx_step(state.model, state.optimizer, batch, rng)
        user_state = state if is_flax_state(state) else None
        own = unwrap_state(state)
        if self._mesh is not None:
            batch = self.shard_batch(batch)
        step_fn = self._step_fn(own.model_state is not None, rng is not None)
        params, opt_state, step, model_state, loss, aux = step_fn(
            own.params, own.opt_state, own.step, own.model_state, batch, rng
        )
        new_state = rewrap_state(user_state, TrainState(params, opt_state, step, model_state))
        if self._mesh is not None and jax.process_count() > 1:
            loss = jnp.mean(loss)
            aux = jax.tree.map(lambda a: jnp.mean(a, axis=0) if jnp.issubdtype(a.dtype, jnp.inexact) else a, aux)
        elif self._mesh is not None:
            # In one process the mean over ranks is taken on the host: a second program with a
            # cross-device reduction, dispatched while the step's collectives run, can deadlock
            # XLA's CPU collectives (4 devices on 2 cores: a rendezvous that never completes).
            loss = np.mean(jax.device_get(loss))
            aux = jax.tree.map(
                lambda a: np.mean(a, axis=0) if np.issubdtype(a.dtype, np.inexact) else a, jax.device_get(aux)
            )
        return new_state, ((loss, aux) if self._has_aux else loss)


class _TuningProbe(DataParallel):
    """The trainer autotuning times: its loss ignores its batch, so every rank passes the same zeros, no user
    data for the same-batch check to check (nor its allgather to time)."""

    _checks_batches = False


def _half_square(params: Any, batch: Any) -> jax.Array:
    del batch
    return 0.5 * sum(jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in jax.tree.leaves(params))

"""PowerSGD: low-rank gradient compression with error feedback.

Its settings: :class:`bagua_common.algorithms.configs.PowerSGDConfig`.

Each matrix-shaped gradient is replaced by a rank-``r`` approximation ``P Q^T`` that every rank
computes identically from two flat allreduces per step: one carries every matrix's ``P``
factor (and, uncompressed, the gradients too small to gain), the other every matrix's ``Q``.
Per rank that is ``(n + m) r`` elements per ``n x m`` matrix instead of ``n m``. The first
``start_iter`` steps average every gradient exactly; ``Q`` (warm start) and the residuals
(error feedback) live in the state, so a run resumes bit for bit.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from bagua_common.algorithms.configs import PowerSGDConfig, matrix_view
from bagua_common.algorithms.orthogonalization_batches import orthogonalization_batches
from bagua_common.algorithms.registry import as_config
from bagua_common.comm.topology import Communicators
from bagua_jax.algorithms.base import (
    ConfiguredAlgorithm,
    check_communicators,
    check_float_grads,
    check_float_params,
    implements,
    varying_like,
)
from bagua_jax.communicator import Communicator
from bagua_jax.step_means import StepMeans


class PowerSGDState(NamedTuple):
    """PowerSGD's state: the step, each compressed matrix's ``Q`` (``m x r``) and residual (``n x m``).

    ``residuals`` is empty without error feedback. Identical ``qs`` on every rank keep the
    replicas identical.
    """

    step: jax.Array
    qs: tuple[jax.Array, ...]
    residuals: tuple[jax.Array, ...]


class _Layout(NamedTuple):
    """Which leaves are compressed (index, ``(n, m)``, rank) and which are sent as they are."""

    compressed: tuple[tuple[int, tuple[int, int], int], ...]
    plain: tuple[int, ...]


def _layout(leaves: list[Any], config: PowerSGDConfig) -> _Layout:
    compressed, plain = [], []
    for i, leaf in enumerate(leaves):
        rank = config.compressed_rank(np.shape(leaf))
        if rank is None:
            plain.append(i)
        else:
            compressed.append((i, matrix_view(np.shape(leaf)), rank))
    return _Layout(tuple(compressed), tuple(plain))


def _initial_q(config: PowerSGDConfig, index: int, m: int, rank: int, step: Any = None) -> jax.Array:
    """The same random ``Q`` on every rank: seeded by the config, the matrix and (cold starts) the step."""
    key = jax.random.fold_in(jax.random.key(config.seed), index)
    if step is not None:
        key = jax.random.fold_in(key, step)
    return jax.random.normal(key, (m, rank), jnp.float32)


def orthogonalize(p: jax.Array) -> jax.Array:
    """Modified Gram-Schmidt on the columns of ``p``, batched over any leading dimensions.

    A zero column stays zero (a zero gradient). One vectorized operation per column pair serves
    every matrix of the batch at once.
    """
    columns = []
    for i in range(p.shape[-1]):
        column = p[..., i]
        for done in columns:
            column = column - jnp.sum(done * column, axis=-1, keepdims=True) * done
        norm = jnp.linalg.norm(column, axis=-1, keepdims=True)
        columns.append(jnp.where(norm > 0, column / jnp.where(norm > 0, norm, 1), 0))
    return jnp.stack(columns, axis=-1)


def orthogonalize_all(ps: list[jax.Array]) -> list[jax.Array]:
    """:func:`orthogonalize` every ``n x r`` matrix of ``ps``, a few zero-padded batches at a time.

    Zero rows change no inner product, so each result is its own matrix's orthogonalization;
    :func:`orthogonalization_batches` says which share a batch.
    """
    out: list[jax.Array] = [None] * len(ps)
    for indices in orthogonalization_batches([p.shape for p in ps]):
        rows = ps[indices[0]].shape[0]
        batch = orthogonalize(jnp.stack([jnp.pad(ps[i], ((0, rows - ps[i].shape[0]), (0, 0))) for i in indices]))
        for b, i in zip(batch, indices):
            out[i] = b[: ps[i].shape[0]]
    return out


def _flat(arrays: list[jax.Array]) -> jax.Array:
    return jnp.concatenate([a.reshape(-1) for a in arrays]) if arrays else jnp.zeros(0, jnp.float32)


def _split(flat: jax.Array, shapes: list[tuple[int, ...]]) -> list[jax.Array]:
    out, offset = [], 0
    for shape in shapes:
        size = int(np.prod(shape))
        out.append(flat[offset : offset + size].reshape(shape))
        offset += size
    return out


def powersgd(
    comms: Communicators | Communicator, *config: Any, **options: Any
) -> optax.GradientTransformationExtraArgs:
    """Average the gradients over ``comms.world`` through rank-``r`` approximations (PowerSGD).

    Returns the gradient transformation to chain before the user's optimizer; its state is a
    :class:`PowerSGDState`. See :class:`bagua_common.algorithms.configs.PowerSGDConfig` for the step and the settings.
    """
    config = as_config(PowerSGDConfig, *config, **options)
    comms = check_communicators(comms, config.name)
    world = comms.world

    def init_fn(params: Any) -> PowerSGDState:
        check_float_params(params)
        leaves = jax.tree.leaves(params)
        config.check_compressible([np.shape(leaf) for leaf in leaves])
        layout = _layout(leaves, config)
        qs = tuple(_initial_q(config, k, m, r) for k, (_, (_, m), r) in enumerate(layout.compressed))
        residuals = tuple(jnp.zeros(view, jnp.float32) for _, view, _ in layout.compressed)
        return PowerSGDState(jnp.int32(0), qs, residuals if config.error_feedback else ())

    # Both steps carry the trainer's step means (an empty vector without them) in their first allreduce.
    def exact(
        leaves: list[jax.Array], state: PowerSGDState, means: jax.Array
    ) -> tuple[list[jax.Array], PowerSGDState, jax.Array]:
        pieces = [g.astype(jnp.float32) for g in leaves] + [means]
        averaged = _split(world.allreduce(_flat(pieces), "avg"), [g.shape for g in pieces])
        return averaged[:-1], state, averaged[-1]

    def compressed(
        leaves: list[jax.Array], state: PowerSGDState, means: jax.Array
    ) -> tuple[list[jax.Array], PowerSGDState, jax.Array]:
        layout = _layout(leaves, config)
        matrices = [leaves[i].astype(jnp.float32).reshape(view) for i, view, _ in layout.compressed]
        if config.error_feedback:
            matrices = [m + e for m, e in zip(matrices, state.residuals)]
        ps = [m @ q for m, q in zip(matrices, state.qs)]
        plain = [leaves[i].astype(jnp.float32) for i in layout.plain]
        # One allreduce averages every P, the uncompressed gradients and the means. Orthogonalizing ignores P's scale;
        # an average, which the engine divides at run time, keeps the step's program free of the world size, so a
        # fault-tolerant job runs it as compiled after a change of members.
        pieces = ps + plain + [means]
        reduced = _split(world.allreduce(_flat(pieces), "avg"), [p.shape for p in pieces])
        ps = orthogonalize_all(reduced[: len(ps)])
        plain, means = reduced[len(ps) : -1], reduced[-1]
        qs = [m.T @ p for m, p in zip(matrices, ps)]
        qs = _split(world.allreduce(_flat(qs), "avg"), [q.shape for q in qs])
        approximations = [p @ q.T for p, q in zip(ps, qs)]
        out = list(leaves)
        for (i, _, _), approximation in zip(layout.compressed, approximations):
            out[i] = approximation.reshape(leaves[i].shape)
        for i, g in zip(layout.plain, plain):
            out[i] = g
        residuals = tuple(m - a for m, a in zip(matrices, approximations)) if config.error_feedback else ()
        if not config.warm_start:
            qs = [_initial_q(config, k, q.shape[0], q.shape[1], state.step + 1) for k, q in enumerate(qs)]
        return out, PowerSGDState(state.step, tuple(qs), residuals), means

    def update_fn(
        updates: Any, state: PowerSGDState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, PowerSGDState]:
        del params
        check_float_grads(updates, config.name)
        leaves, treedef = jax.tree.flatten(updates)
        step_means: StepMeans | None = extra_args.get("step_means")
        means = step_means.values if step_means is not None else jnp.zeros(0, jnp.float32)
        inputs = (leaves, state, means)
        # Every rank shares the step counter, so all take the same branch and make the same calls.
        averaged, state, means = jax.lax.cond(
            state.step < config.start_iter,
            lambda *args: varying_like(exact(*args), inputs),
            lambda *args: varying_like(compressed(*args), inputs),
            *inputs,
        )
        if step_means is not None:
            step_means.deliver(means)
        averaged = [a.astype(g.dtype) for a, g in zip(averaged, leaves)]
        return treedef.unflatten(averaged), state._replace(step=state.step + 1)

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


@implements(PowerSGDConfig)
class PowerSGD(ConfiguredAlgorithm):
    """The :class:`~bagua_jax.algorithms.base.Algorithm` form of :func:`powersgd`, followed by the user's optimizer.

    Every rank applies the same approximated gradient, so the replicas stay identical. Pick it
    for SGD-style training on a slow network when most of the gradient is in large matrices.
    Its factors travel in one flat allreduce each, so ``bucket_bytes`` has no effect.
    """

    fault_tolerant = True
    replicas_identical = True
    """Every rank applies the same update, so all replicas of the parameters stay bit-identical."""

    def transform(self, comms: Communicators | Communicator) -> optax.GradientTransformationExtraArgs:
        """:func:`powersgd` with this configuration."""
        return powersgd(comms, self.config)

"""Checkpoints of a :class:`~bagua_jax.DataParallel` train state, restorable into another world size.

``save(root, state, trainer)`` writes ``root/step_<s>/rank_<r>.npz`` for every rank (each
process writes the rows of the ranks it holds: parameters, the algorithm's optimizer state,
the step, the model state), waits for every process, and rank 0 commits the manifest (see
:mod:`bagua_common.job.checkpoint`: a half-written checkpoint is never loaded).
:func:`read_state` reads one as NumPy arrays in any process, with no trainer and whatever its
devices. ``restore(root, trainer, params)`` loads the newest committed checkpoint into a state for
``trainer``'s world size: the same world size gets every rank's own state back bit for
bit; another one follows the algorithm's rule (:mod:`bagua_common.job.reshard`): identical
state carries over, drifted parameters start from their mean, error-feedback residuals
restart at zero, and buckets padded for the old world size are rebuilt for the new one.

Both modes: a mesh (one process, or several under ``jax.distributed``; each process writes
the rows of its devices) and a native communicator (each process is one rank).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from bagua_common.job.checkpoint import (
    Manifest,
    check_restorable,
    checkpoint_dir,
    checkpoint_to_restore,
    commit,
    load_arrays,
    read_manifest,
    save_arrays,
    shard_path,
    verified_shard,
)
from bagua_common.job.rank_environment import environment_int
from bagua_common.job.reshard import ReshardRule, algorithm_rule, reshard_rows
from bagua_common.job.signature import algorithm_config
from bagua_jax.train_state import TrainState, rewrap_state, unwrap_state
from bagua_jax.trainer import DataParallel

_SUFFIX = ".npz"
KeyPath = tuple[Any, ...]
ADDED_LEAVES = {".trained": "DiLoCo's weight of a rank's pseudo-gradient (2026-12-01): 1, as every rank trained"}
"""Leaves of the optimizer state newer than checkpoints written before them, by the end of their key path: such a
checkpoint restores them with a fresh state's value (what the checkpoint's job had, unwritten)."""


def per_rank(leaf: jax.Array) -> bool:
    """Whether ``leaf`` carries one row per rank (sharded along its leading axis) rather than one shared copy."""
    spec = getattr(leaf.sharding, "spec", ())
    return len(spec) > 0 and spec[0] is not None


def _own_ranks(trainer: DataParallel) -> list[int]:
    """The ranks (rows of per-rank leaves) whose devices belong to this process."""
    if trainer.mesh is None:
        return [int(trainer.communicator.rank())]
    devices = list(trainer.mesh.devices.flat)
    return [r for r, d in enumerate(devices) if d.process_index == jax.process_index()]


def _wait_for_every_rank(trainer: DataParallel, what: str) -> None:
    if trainer.mesh is None:
        jax.block_until_ready(trainer.communicator.barrier(jnp.zeros(())))
    elif jax.process_count() > 1:
        multihost_utils.sync_global_devices(what)


def _rows(leaf: jax.Array, ranks: list[int]) -> dict[int, np.ndarray]:
    """This process's rows of ``leaf`` by rank (its whole value for each of ``ranks`` if it has no rank axis:
    shared by the ranks of a mesh, or the process's own in native mode)."""
    if not per_rank(leaf):
        value = np.asarray(leaf.addressable_shards[0].data)
        return {r: value for r in ranks}
    rows = {}
    for shard in leaf.addressable_shards:
        start = shard.index[0].start or 0
        for i, row in enumerate(np.asarray(shard.data)):
            rows[start + i] = row
    return rows


def _model(params: Any) -> list[tuple[str, tuple[int, ...], str]]:
    """``(path, shape, dtype)`` of one rank's parameters (without the rank axis)."""
    return [
        (jax.tree_util.keystr(path), tuple(leaf.shape[1:] if per_rank(leaf) else leaf.shape), str(leaf.dtype))
        for path, leaf in jax.tree_util.tree_leaves_with_path(params)
    ]


def _algorithm(trainer: DataParallel) -> tuple[str, dict[str, str]]:
    config = algorithm_config(trainer.algorithm)
    return config["algorithm"], config


def step_of(state: Any) -> int:
    """The step count of a train state (``trainer.init``/``step``'s result)."""
    return int(np.asarray(unwrap_state(state).step.addressable_shards[0].data).reshape(-1)[0])


def manifest_for(trainer: DataParallel, state: Any) -> Manifest:
    """The manifest of ``state``'s checkpoint: its step, ``trainer``'s world, algorithm and model."""
    own = unwrap_state(state)
    ranks = _own_ranks(trainer)
    algorithm, config = _algorithm(trainer)
    return Manifest(
        step=step_of(own),
        world_size=trainer.size,
        local_world_size=len(ranks) if trainer.mesh is not None else environment_int("LOCAL_WORLD_SIZE") or 1,
        algorithm=algorithm,
        config=config,
        model=_model(own.params),
    )


def save(root: str | os.PathLike, state: Any, trainer: DataParallel, metadata: Mapping[str, Any] | None = None) -> Path:
    """Write the checkpoint of ``state`` (what ``trainer.init``/``step`` returned) under ``root``; returns its folder.

    Every process calls it; it returns once the checkpoint is committed. ``metadata`` (JSON values, rank 0's) is
    recorded in its manifest (:attr:`~bagua_common.job.checkpoint.Manifest.metadata`).
    """
    own = unwrap_state(state)
    ranks = _own_ranks(trainer)
    step = step_of(own)
    directory = checkpoint_dir(root, step)
    shards: dict[int, dict[str, np.ndarray]] = {r: {} for r in ranks}
    for path, leaf in jax.tree_util.tree_leaves_with_path(own):
        for rank, row in _rows(leaf, ranks).items():
            shards[rank][jax.tree_util.keystr(path)] = row
    for rank, arrays in shards.items():
        save_arrays(shard_path(directory, rank, _SUFFIX), arrays)
    _wait_for_every_rank(trainer, f"bagua checkpoint {step} written")
    if 0 in ranks:
        commit(directory, manifest_for(trainer, own), metadata=metadata)
    _wait_for_every_rank(trainer, f"bagua checkpoint {step} committed")
    return directory


def restore(root: str | os.PathLike, trainer: DataParallel, params: Any, *, model_state: Any = None) -> Any:
    """The state for ``trainer`` of the newest committed checkpoint under ``root`` (or of the folder ``root``).

    ``params`` (and ``model_state``) are what ``trainer.init`` would take: they give the tree
    and its shapes; their values are replaced by the checkpoint's. Raises FileNotFoundError when
    there is no committed checkpoint and ValueError when it cannot be restored here (another
    model or algorithm, or a state whose shape depends on the world size under a rule that
    carries it; a :class:`~bagua_common.job.checkpoint.DamagedCheckpointError` naming the file for
    a shard that is missing, truncated, emptied or of another step). Every process calls it.
    """
    directory = checkpoint_to_restore(root)
    manifest = read_manifest(directory)
    saved = read_state(directory)

    def saved_rows(path: KeyPath, fresh: jax.Array) -> list[np.ndarray]:
        key = jax.tree_util.keystr(path)
        if key not in saved[0]:
            return rows_of_added_leaf(key, fresh, manifest.world_size, directory)
        return [shard[key] for shard in saved]

    return restore_rows(manifest, saved_rows, trainer, params, model_state=model_state)


def read_state(root: str | os.PathLike) -> list[dict[str, np.ndarray]]:
    """Each saved rank's arrays by key path (``".params['w']"``), as NumPy arrays, in a process with any devices.

    ``root`` is a checkpoint folder or the root holding them (its newest committed one). The
    files are checked against the manifest first (a
    :class:`~bagua_common.job.checkpoint.DamagedCheckpointError` names a bad one). The list holds
    one dict per rank of the saving job, in rank order; leaves shared by the ranks appear in each.
    """
    directory = checkpoint_to_restore(root)
    manifest = read_manifest(directory)
    return [
        load_arrays(verified_shard(directory, manifest, shard_path(directory, r, _SUFFIX).name))
        for r in range(manifest.world_size)
    ]


def rows_of_added_leaf(key: str, fresh: jax.Array, world_size: int, directory: Path) -> list[np.ndarray]:
    """The saved rows of ``key``, a leaf the checkpoint in ``directory`` lacks: ``fresh``'s (the leaf in a fresh
    state) on each of its ``world_size`` ranks where :data:`ADDED_LEAVES` names it, else a ValueError."""
    if not (key.startswith(".opt_state") and key.endswith(tuple(ADDED_LEAVES))):
        raise ValueError(f"the checkpoint {directory} has no {key}")
    row = np.asarray(fresh.addressable_shards[0].data)
    return [row[0] if per_rank(fresh) else row] * world_size


def restore_rows(
    manifest: Manifest,
    saved_rows: Callable[[KeyPath, jax.Array], list[np.ndarray]],
    trainer: DataParallel,
    params: Any,
    *,
    model_state: Any = None,
) -> Any:
    """A state for ``trainer`` from a checkpoint's ``manifest`` and its leaves, one row per saved rank.

    ``saved_rows(path, fresh)`` gives the saved rows of the leaf at key path ``path``
    (``fresh``: the leaf in a fresh state of ``trainer``; see :func:`per_rank`). The same world size gets each rank's
    own row back; another one follows the algorithm's reshard rule. ``params`` and
    ``model_state`` are what ``trainer.init`` would take.
    """
    algorithm, _ = _algorithm(trainer)
    template = trainer.init(params, model_state=model_state)
    user_state = None if isinstance(template, TrainState) else template  # a flax TrainState comes back as one
    check_restorable(manifest, algorithm=algorithm, model=_model(unwrap_state(template).params))
    same_world = manifest.world_size == trainer.size
    if not same_world:
        rule = algorithm_rule(manifest.algorithm)
        template = _restart_from_saved_params(trainer, template, saved_rows, rule, model_state)
    ranks = _own_ranks(trainer)

    def restored(path, fresh: jax.Array) -> jax.Array:
        key = jax.tree_util.keystr(path)
        rank_axis = per_rank(fresh)
        rows = saved_rows(path, fresh)
        if same_world:
            value = np.stack(rows) if rank_axis else rows[ranks[0] if trainer.mesh is None else 0]
        else:
            fresh_row = _rows(fresh, ranks)[ranks[0]]
            value = reshard_rows(leaf_rule(rule, key, rows[0].dtype), rows, trainer.size if rank_axis else 1, fresh_row)
            value = value if rank_axis else value[0]
        if value.shape != fresh.shape or value.dtype != fresh.dtype:
            raise ValueError(
                f"{key}: the checkpoint holds {value.dtype}{list(value.shape)}, here {fresh.dtype}{list(fresh.shape)}"
            )
        return jax.make_array_from_callback(fresh.shape, fresh.sharding, lambda index: value[index])

    own = unwrap_state(template)
    state = jax.tree_util.tree_map_with_path(restored, own)
    return rewrap_state(user_state, state)


def leaf_rule(rule: ReshardRule, key: str, dtype: np.dtype) -> str:
    """The rule of the leaf at ``key`` (its key path) of a :class:`TrainState` when the world size changes: parameters
    and model state are never reset."""
    if key.startswith((".params", ".model_state")):
        return rule.parameter_rule(dtype)
    return rule.rule_for(key, dtype)


def _restart_from_saved_params(
    trainer: DataParallel,
    template: Any,
    saved_rows: Callable[[KeyPath, jax.Array], list[np.ndarray]],
    rule: ReshardRule,
    model_state: Any,
) -> Any:
    """A fresh state for the new world size whose parameters follow the rule (rank 0's, or the ranks' mean).

    Leaves that restart (``RESET``) take their values from it: residuals at zero, and copies of the
    weights equal to the restarted parameters.
    """
    own = unwrap_state(template)

    def start(path, leaf):
        key = jax.tree_util.keystr(path)
        rows = saved_rows(path, leaf)
        return reshard_rows(leaf_rule(rule, key, rows[0].dtype), rows, 1)[0]

    params = jax.tree_util.tree_map_with_path(start, TrainState(own.params, None, None)).params
    return trainer.init(params, model_state=model_state)

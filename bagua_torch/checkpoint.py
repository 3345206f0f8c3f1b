"""Checkpoints of a :class:`~bagua_torch.BaguaModule` and its optimizers, restorable into another world size.

``save(root, model, optimizers, step=s)`` writes each rank's ``state_dict()`` (the model's,
with the algorithm's state in ``_extra_state``, and every optimizer's) to
``root/step_<s>/rank_<r>.pt``, waits for every rank and lets rank 0 commit the manifest
(see :mod:`bagua_common.job.checkpoint`: a half-written checkpoint is never loaded).
``restore(root, model, optimizers)`` loads the newest committed checkpoint and returns its
step. Into the same world size every rank gets its own state back exactly; into another one
the algorithm's rule applies (:mod:`bagua_common.job.reshard`): identical state (parameters of
synchronous algorithms, Adam moments) carries over from rank 0, decentralized and
asynchronous parameters (and their optimizer state) start from the mean over the saved
ranks, error-feedback residuals restart at zero and low-precision decentralized's weight
copies restart equal to the parameters, in buckets planned for the new world size.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bagua_common.job.checkpoint import (
    DamagedCheckpointError,
    Manifest,
    check_restorable,
    checkpoint_dir,
    checkpoint_to_restore,
    commit,
    read_manifest,
    shard_path,
    verified_shard,
    write_atomically,
)
from bagua_common.job.reshard import RESET, ReshardRule, algorithm_rule, reshard_rows
from bagua_common.job.signature import algorithm_config
from bagua_torch.bagua_module import BaguaModule, Optimizers

_SUFFIX = ".pt"
EXTRA_STATE = "_extra_state"


def optimizer_list(optimizers: Optimizers) -> list[torch.optim.Optimizer]:
    """One optimizer or several, as a list."""
    return [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)


def _algorithm(model: BaguaModule) -> tuple[str, dict[str, str]]:
    config = algorithm_config(model.algorithm, bucket_bytes=model.bucket_bytes, sync_point=model.sync_point)
    return config["algorithm"], config


def _model(model: BaguaModule) -> list[tuple[str, tuple[int, ...], str]]:
    return [(name, tuple(p.shape), str(p.dtype)) for name, p in model.module.named_parameters()]


def save(
    root: str | os.PathLike,
    model: BaguaModule,
    optimizers: Optimizers = (),
    *,
    step: int,
    metadata: Mapping[str, Any] | None = None,
) -> Path:
    """Write step ``step``'s checkpoint of ``model`` and ``optimizers`` under ``root``; returns its folder.

    Every rank calls it; it returns once the checkpoint is committed. ``metadata`` (JSON values, rank 0's) is
    recorded in its manifest (:attr:`~bagua_common.job.checkpoint.Manifest.metadata`).
    """
    state = rank_state(model, optimizers, step)
    return save_committed(
        root,
        model,
        step,
        lambda directory, rank: write_atomically(
            shard_path(directory, rank, _SUFFIX), lambda tmp: torch.save(state, tmp)
        ),
        metadata=metadata,
    )


def save_committed(
    root: str | os.PathLike,
    model: BaguaModule,
    step: int,
    write: Callable[[Path, int], None],
    metadata: Mapping[str, Any] | None = None,
    **commit_options: Any,
) -> Path:
    """Step ``step``'s checkpoint folder under ``root``: every rank writes its part (``write(folder, rank)``), then
    rank 0 commits the manifest (recording ``metadata``; with ``commit_options``, see
    :func:`~bagua_common.job.checkpoint.commit`) once all have; returns the folder."""
    world = model.communicators.world
    directory = checkpoint_dir(root, step)
    write(directory, world.rank)
    world.barrier()
    if world.rank == 0:
        commit(directory, manifest_for(model, step), metadata=metadata, **commit_options)
    world.barrier()
    return directory


def rank_state(model: BaguaModule, optimizers: Optimizers, step: int) -> dict[str, Any]:
    """This rank's checkpoint: the step, the model's ``state_dict()`` (algorithm state included), the optimizers'."""
    return {
        "step": step,
        "model": model.state_dict(),
        "optimizers": [o.state_dict() for o in optimizer_list(optimizers)],
    }


def manifest_for(model: BaguaModule, step: int) -> Manifest:
    """The manifest of step ``step``'s checkpoint of ``model``: its world, algorithm and parameters."""
    world = model.communicators.world
    algorithm, config = _algorithm(model)
    local = model.communicators.intra.size if model.communicators.intra is not None else world.size
    return Manifest(step, world.size, local, algorithm, config, _model(model))


def _load(directory: Path, manifest: Manifest, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s shard, checked against the manifest (a damaged one raises, naming the file)."""
    path = verified_shard(directory, manifest, shard_path(directory, rank, _SUFFIX).name)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError) as e:
        raise DamagedCheckpointError(f"{path} is not a readable shard: {type(e).__name__}: {e}") from e


def restore(root: str | os.PathLike, model: BaguaModule, optimizers: Optimizers = ()) -> int:
    """Load the newest committed checkpoint under ``root`` (or the checkpoint folder ``root``); returns its step.

    Call it on every rank, right after wrapping the model and building the optimizers. Raises
    FileNotFoundError when there is no committed checkpoint and ValueError when it cannot be
    restored here (another model or algorithm, a state whose shape depends on the world size
    under a rule that carries it; a :class:`~bagua_common.job.checkpoint.DamagedCheckpointError`
    naming the file for a shard that is missing, truncated, emptied or of another step).
    """
    directory = checkpoint_to_restore(root)
    manifest = read_manifest(directory)
    return restore_states(manifest, lambda rank: _load(directory, manifest, rank), model, optimizers)


def restore_states(
    manifest: Manifest,
    load_rank: Callable[[int], dict[str, Any]],
    model: BaguaModule,
    optimizers: Optimizers = (),
) -> int:
    """Restore a checkpoint given its ``manifest`` and ``load_rank(r)``, saved rank ``r``'s state; returns its step.

    A rank's state is ``{"step", "model": model.state_dict(), "optimizers": [state_dict(), ...]}``.
    The same world size loads this rank's own state; another one loads every saved rank's and
    follows the algorithm's reshard rule.
    """
    optimizers = optimizer_list(optimizers)
    world = model.communicators.world
    check_restorable(manifest, algorithm=_algorithm(model)[0], model=_model(model))
    if manifest.world_size == world.size:
        state = load_rank(world.rank)
        model.load_state_dict(state["model"])
        for optimizer, saved in zip(optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
        return manifest.step
    rule = algorithm_rule(manifest.algorithm)
    saved = [load_rank(r) for r in range(manifest.world_size)]
    models = [s["model"] for s in saved]
    params = {key: _parameter(rule, [m[key] for m in models]) for key in models[0] if key != EXTRA_STATE}
    model.load_state_dict({**params, EXTRA_STATE: model.get_extra_state()})
    # What restarts is taken from the algorithm built afresh on the restored parameters.
    fresh = model.algorithm.reify(model.algorithm_impl.context)
    try:
        fresh_state = fresh.state_dict()
    finally:
        fresh.close()
    algorithm_state = _combine(rule, "", [m[EXTRA_STATE]["algorithm_state"] for m in models], fresh_state)
    model.set_extra_state({**model.get_extra_state(), "algorithm_state": algorithm_state})
    for i, optimizer in enumerate(optimizers):
        optimizer.load_state_dict(_combine(rule, "optimizer", [s["optimizers"][i] for s in saved], None))
    return manifest.step


def _combine(rule: ReshardRule, key: str, values: list[Any], fresh: Any) -> Any:
    """One value for the new world size from the old ranks' ``values`` of the entry at ``key``, by ``rule``."""
    if rule.rule_for(key, np.dtype(np.float32)) == RESET:
        if fresh is None:
            raise ValueError(f"{key} restarts, but the freshly built state has no such entry")
        return fresh
    first = values[0]
    if isinstance(first, torch.Tensor):
        arrays = [_numpy(v) for v in values]
        leaf_rule = rule.rule_for(key, arrays[0].dtype)
        combined = torch.from_numpy(np.asarray(reshard_rows(leaf_rule, arrays, 1)[0]))
        return combined.to(first.dtype)
    if isinstance(first, dict):
        return {k: _combine(rule, f"{key}.{k}", [v[k] for v in values], _child(fresh, k)) for k in first}
    if isinstance(first, (list, tuple)):
        items = [_combine(rule, f"{key}[{i}]", [v[i] for v in values], _child(fresh, i)) for i in range(len(first))]
        return type(first)(items)
    return first


def _parameter(rule: ReshardRule, values: list[torch.Tensor]) -> torch.Tensor:
    """A model parameter or buffer for the new world size (rank 0's, or the ranks' mean)."""
    arrays = [_numpy(v) for v in values]
    return torch.from_numpy(np.asarray(reshard_rows(rule.parameter_rule(arrays[0].dtype), arrays, 1)[0])).to(
        values[0].dtype
    )


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def _child(fresh: Any, key: Any) -> Any:
    if isinstance(fresh, dict):
        return fresh.get(key)
    if isinstance(fresh, (list, tuple)) and isinstance(key, int) and key < len(fresh):
        return fresh[key]
    return None

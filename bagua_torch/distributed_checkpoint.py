"""Checkpoints of a :class:`~bagua_torch.BaguaModule` through ``torch.distributed.checkpoint`` (DCP).

``save(root, model, optimizers, step=s)`` writes ``root/step_<s>`` with ``dcp.save``: every
rank's state (:class:`RankState`, a DCP ``Stateful``: the model's ``state_dict()`` with the
algorithm's state in ``_extra_state``, the optimizers' and the step) under the key
``bagua.rank_<r>``, one key per rank because decentralized and asynchronous ranks hold
different values, which DCP would otherwise deduplicate as replicas. Once every rank has
written, rank 0 adds the project's ``manifest.json`` with each file's size and digest (see
:mod:`bagua_common.job.checkpoint`): a folder without it is never restored, and a damaged
file is refused naming it. DCP's own API reads the folder (``dcp.load`` of the keys
``bagua.rank_<r>``). ``restore`` puts it into a job of any world size by the rules of
:mod:`bagua_common.job.reshard`, like :func:`bagua_torch.checkpoint.restore`.

DCP needs ``torch.distributed`` initialized (``bagua_torch.init_process_group`` with gloo or
nccl does it); jobs on the native MPI engine alone keep :mod:`bagua_torch.checkpoint`'s files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.checkpoint.stateful import Stateful

from bagua_common.job.checkpoint import (
    DamagedCheckpointError,
    checkpoint_to_restore,
    read_manifest,
    verify_files,
)
from bagua_torch.bagua_module import BaguaModule, Optimizers
from bagua_torch.checkpoint import EXTRA_STATE, optimizer_list, rank_state, restore_states, save_committed

ITEM = "bagua"


def rank_key(rank: int) -> str:
    """The key of rank ``rank``'s state under :data:`ITEM`."""
    return f"rank_{rank}"


class RankState(Stateful):
    """This rank's model, optimizers and step as a DCP ``Stateful``, under the key ``rank_<r>``.

    ``load_state_dict`` takes back what ``state_dict`` gave (same world size).
    """

    def __init__(self, model: BaguaModule, optimizers: Optimizers, step: int):
        self.model = model
        self.optimizers = optimizer_list(optimizers)
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        """``{"rank_<r>": {"step", "model", "optimizers"}}``."""
        return {rank_key(self.model.communicators.world.rank): rank_state(self.model, self.optimizers, self.step)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's entry of ``state_dict``."""
        own = state_dict[rank_key(self.model.communicators.world.rank)]
        self.model.load_state_dict(own["model"])
        for optimizer, saved in zip(self.optimizers, own["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
        self.step = int(own["step"])


def _require_torch_distributed() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            "torch.distributed.checkpoint needs torch.distributed initialized (bagua_torch.init_process_group with "
            "gloo or nccl); on the native engine alone use bagua_torch.checkpoint"
        )


def save(
    root: str | os.PathLike,
    model: BaguaModule,
    optimizers: Optimizers = (),
    *,
    step: int,
) -> Path:
    """Write step ``step``'s checkpoint of ``model`` and ``optimizers`` with ``dcp.save``; returns its folder.

    Every rank calls it; it returns once the checkpoint is committed.
    """
    _require_torch_distributed()
    return save_committed(
        root,
        model,
        step,
        lambda directory, _: dcp.save({ITEM: RankState(model, optimizers, step)}, checkpoint_id=directory),
        shard_pattern="__{rank}_*.distcp",
    )


def load_rank(directory: str | os.PathLike, rank: int) -> dict[str, Any]:
    """Saved rank ``rank``'s state from a checkpoint folder (every rank calls it: DCP plans the read together).

    DCP's public ``dcp.load`` fills a state dict given in advance; a fresh optimizer's has no
    entries yet, so the keys are read as saved, with DCP's loader of named keys.
    """
    key = f"{ITEM}.{rank_key(rank)}"
    try:
        loaded = _load_state_dict_from_keys(keys={key}, checkpoint_id=directory)
    except (CheckpointException, OSError, RuntimeError) as e:
        raise DamagedCheckpointError(f"{directory} is not a readable DCP checkpoint: {type(e).__name__}: {e}") from e
    if rank_key(rank) not in loaded.get(ITEM, {}):
        raise DamagedCheckpointError(f"{directory} holds no state of rank {rank} (no {key})")
    state = loaded[ITEM][rank_key(rank)]
    # DCP names entries by dotted strings: the integer keys of optimizer states (parameter
    # indices) come back as strings. It also drops empty containers: a stateless optimizer's
    # (plain SGD's) "state" and a stateless algorithm's (gradient allreduce's) state come back missing.
    state["optimizers"] = [{"state": {}} | _integer_keys(o) for o in state["optimizers"]]
    extra = state["model"].setdefault(EXTRA_STATE, {})
    extra["algorithm_state"] = _integer_keys(extra.get("algorithm_state", {}))
    return state


def _integer_keys(value: Any) -> Any:
    """``value`` with every all-digit string key of its dicts turned back into an int."""
    if isinstance(value, dict):
        return {int(k) if isinstance(k, str) and k.isdigit() else k: _integer_keys(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_integer_keys(v) for v in value)
    return value


def restore(root: str | os.PathLike, model: BaguaModule, optimizers: Optimizers = ()) -> int:
    """Load the newest committed DCP checkpoint under ``root`` (or the checkpoint folder ``root``); returns its step.

    Call it on every rank, right after wrapping the model and building the optimizers. Every
    file is first checked against the manifest; raises FileNotFoundError when there is no
    committed checkpoint, :class:`~bagua_common.job.checkpoint.DamagedCheckpointError` naming
    a missing, truncated, emptied or foreign file, and ValueError when it cannot be restored
    here (another model or algorithm).
    """
    directory = checkpoint_to_restore(root)
    manifest = read_manifest(directory)
    verify_files(directory, manifest)
    return restore_states(manifest, lambda rank: load_rank(directory, rank), model, optimizers)

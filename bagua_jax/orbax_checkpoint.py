"""Checkpoints of a :class:`~bagua_jax.DataParallel` train state through orbax's ``CheckpointManager``.

Each step is an orbax checkpoint with two items: ``state``, the train state as it lives on the
mesh (per-rank rows of decentralized parameters, residuals and the like keep their rank axis),
and ``bagua``, the project's manifest as JSON (world size, algorithm, configuration, model).
orbax's own tools read it (``StandardCheckpointer().restore(path / "state")``; leaves of zero
size, which orbax cannot store, are saved as None and hold nothing); orbax writes
it asynchronously and commits it atomically (a step that was being written when the job died
is never listed), which is the project's rule. :meth:`OrbaxCheckpoints.restore` puts it into a
trainer of any world size by the rules of :mod:`bagua_common.job.reshard`, like
:func:`bagua_jax.checkpoint.restore`.

Mesh mode only: native-mode processes are not one ``jax.distributed`` job, which orbax needs
to coordinate a multi-process save; they keep :mod:`bagua_jax.checkpoint`'s files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from bagua_common.job.checkpoint import DamagedCheckpointError, Manifest
from bagua_jax.checkpoint import KeyPath, manifest_for, per_rank, restore_rows, step_of
from bagua_jax.train_state import unwrap_state
from bagua_jax.trainer import DataParallel

STATE = "state"
MANIFEST_ITEM = "bagua"


class OrbaxCheckpoints:
    """The checkpoints of ``trainer``'s state under ``directory``, saved asynchronously by an orbax ``CheckpointManager``.

    ``max_to_keep`` older steps are deleted by orbax once newer ones are committed (None keeps all).
    """

    def __init__(self, directory: str | os.PathLike, trainer: DataParallel, *, max_to_keep: int | None = None):
        if trainer.mesh is None:
            raise ValueError(
                "orbax checkpoints need a DataParallel on a mesh; in native mode use bagua_jax.checkpoint.save/restore"
            )
        self.trainer = trainer
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, enable_async_checkpointing=True),
            item_handlers={STATE: ocp.StandardCheckpointHandler(), MANIFEST_ITEM: ocp.JsonCheckpointHandler()},
        )

    def save(self, state: Any) -> int:
        """Start writing ``state`` (``trainer.init``/``step``'s result) as its step's checkpoint; returns the step.

        Returns once the state is copied off the devices; orbax writes the files in the
        background (:meth:`wait_until_finished` waits for them). Every process calls it.
        """
        step = step_of(state)
        manifest = json.loads(manifest_for(self.trainer, state).to_json())
        self.manager.save(
            step,
            args=ocp.args.Composite(
                **{
                    STATE: ocp.args.StandardSave(_without_empty_leaves(unwrap_state(state))),
                    MANIFEST_ITEM: ocp.args.JsonSave(manifest),
                }
            ),
        )
        return step

    def wait_until_finished(self) -> None:
        """Block until every started save is written and committed."""
        self.manager.wait_until_finished()

    def latest_step(self) -> int | None:
        """The newest committed step (None if there is none)."""
        return self.manager.latest_step()

    def restore(self, params: Any, *, model_state: Any = None, step: int | None = None) -> Any:
        """The state of step ``step`` (the newest committed one by default) for the trainer, whatever its world size.

        ``params`` (and ``model_state``) are what ``trainer.init`` would take: they give the tree
        and its shapes. Raises FileNotFoundError when there is no committed step, ValueError
        when it cannot be restored here (another model or algorithm), and a
        :class:`~bagua_common.job.checkpoint.DamagedCheckpointError` naming the step's folder
        when orbax cannot read it. Every process calls it.
        """
        self.wait_until_finished()
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no committed orbax checkpoint under {self.directory}")
        folder = self.directory / str(step)
        try:
            manifest = Manifest.from_json(
                json.dumps(
                    self.manager.restore(step, args=ocp.args.Composite(**{MANIFEST_ITEM: ocp.args.JsonRestore()}))[
                        MANIFEST_ITEM
                    ]
                )
            )
            metadata = self.manager.item_metadata(step)[STATE]
            target = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), metadata.tree)
            saved = self.manager.restore(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target)}))[
                STATE
            ]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DamagedCheckpointError(f"{folder} is not a readable orbax checkpoint: {type(e).__name__}: {e}") from e
        leaves = {_names(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(saved)}

        def saved_rows(path: KeyPath, fresh: jax.Array) -> list[np.ndarray]:
            rank_axis = per_rank(fresh)
            if fresh.size == 0:  # saved as None (see save)
                return [np.zeros(fresh.shape[1:] if rank_axis else fresh.shape, fresh.dtype)] * manifest.world_size
            if _names(path) not in leaves:
                raise ValueError(f"the checkpoint {folder} has no {jax.tree_util.keystr(path)}")
            value = leaves[_names(path)]
            return list(value) if rank_axis else [value] * manifest.world_size

        return restore_rows(manifest, saved_rows, self.trainer, params, model_state=model_state)

    def close(self) -> None:
        """Wait for the pending saves and release orbax's resources."""
        self.manager.close()


def _names(path: KeyPath) -> tuple[str, ...]:
    """A key path as names: orbax stores named tuples (``TrainState``, optax states) as dicts of their fields."""
    return tuple(str(getattr(entry, "name", getattr(entry, "key", getattr(entry, "idx", entry)))) for entry in path)


def _without_empty_leaves(state: Any) -> Any:
    """``state`` with its zero-size leaves (unused slots, e.g. DiLoCo's ``pending`` without delay) as None.

    orbax refuses to save arrays of zero size; they hold nothing, and a restore takes them from
    a fresh state.
    """
    return jax.tree.map(lambda leaf: None if leaf.size == 0 else leaf, state)

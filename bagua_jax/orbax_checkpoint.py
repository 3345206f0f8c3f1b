"""Checkpoints of a :class:`~bagua_jax.DataParallel` train state through orbax's ``CheckpointManager``.

Each step is an orbax checkpoint with one item, ``state``: the train state as it lives on the
mesh (per-rank rows of decentralized parameters, residuals and the like keep their rank axis).
Once orbax has committed it, process 0 adds the project's ``manifest.json`` (world size,
algorithm, configuration, model, and each file's size and SHA-256, which orbax does not keep:
without them a file copied from another step or altered loads silently). :func:`read_state` reads
a step as NumPy arrays in any process, whatever its devices (orbax's own
``StandardCheckpointer().restore(path / "state")`` rebuilds the arrays on the saving topology and
refuses a process with another device count); leaves of zero size, which orbax cannot store, are
saved as None and hold nothing. orbax writes it asynchronously and commits
it atomically, and a step is restored only once sealed by its manifest, written last: the
project's rule. :meth:`OrbaxCheckpoints.restore` puts it into a
trainer of any world size by the rules of :mod:`bagua_common.job.reshard`, like
:func:`bagua_jax.checkpoint.restore`.

Mesh mode only: native-mode processes are not one ``jax.distributed`` job, which orbax needs
to coordinate a multi-process save; they keep :mod:`bagua_jax.checkpoint`'s files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from bagua_common.job.checkpoint import MANIFEST, DamagedCheckpointError, Manifest, commit, read_manifest, verify_files
from bagua_jax.checkpoint import KeyPath, manifest_for, per_rank, restore_rows, rows_of_added_leaf
from bagua_jax.train_state import unwrap_state
from bagua_jax.trainer import DataParallel

STATE = "state"


class OrbaxCheckpoints:
    """``trainer``'s state checkpointed under ``directory``, asynchronously by an orbax ``CheckpointManager``.

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
            item_handlers={STATE: ocp.StandardCheckpointHandler()},
        )
        self._unsealed: Manifest | None = None

    def save(self, state: Any) -> int:
        """Start writing ``state`` (``trainer.init``/``step``'s result) as its step's checkpoint; returns the step.

        Returns once the state is copied off the devices (and the previous save is sealed); orbax
        writes the files in the background (:meth:`wait_until_finished` waits for them). Every
        process calls it.
        """
        self.wait_until_finished()
        manifest = manifest_for(self.trainer, state)
        self.manager.save(
            manifest.step,
            args=ocp.args.Composite(**{STATE: ocp.args.StandardSave(_without_empty_leaves(unwrap_state(state)))}),
        )
        self._unsealed = manifest
        return manifest.step

    def wait_until_finished(self) -> None:
        """Block until every started save is written, then seal it: process 0 writes the project's manifest.

        The manifest (the step's ``manifest.json``, with every file's size and digest) is written
        last: a step without one was being written when the job died and is never restored. No
        process returns before the step is sealed: the others wait for process 0 at a barrier
        (orbax's own wait ends at its commit, before the manifest), so a step any process just
        saved is one every process can restore.
        """
        self.manager.wait_until_finished()
        if self._unsealed is not None:
            if jax.process_index() == 0:
                commit(self.directory / str(self._unsealed.step), self._unsealed, shard_pattern=STATE)
            if jax.process_count() > 1:
                multihost_utils.sync_global_devices(f"bagua_jax.orbax_checkpoint sealed step {self._unsealed.step}")
            self._unsealed = None

    def latest_step(self) -> int | None:
        """The newest sealed step (None if there is none)."""
        self.wait_until_finished()
        sealed = [s for s in self.manager.all_steps() if (self.directory / str(s) / MANIFEST).exists()]
        return max(sealed, default=None)

    def restore(self, params: Any, *, model_state: Any = None, step: int | None = None) -> Any:
        """The state of step ``step`` (the newest sealed one by default) for the trainer, whatever its world size.

        ``params`` (and ``model_state``) are what ``trainer.init`` would take: they give the tree
        and its shapes. Raises FileNotFoundError when there is no sealed step (or ``step``'s
        manifest is missing), ValueError when it cannot be restored here (another model or
        algorithm), and a :class:`~bagua_common.job.checkpoint.DamagedCheckpointError` naming a
        file that is missing, emptied, truncated or other than the one written (another step's).
        Every process calls it.
        """
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no committed orbax checkpoint under {self.directory}")
        folder = self.directory / str(step)
        manifest = read_manifest(folder)
        verify_files(folder, manifest)
        try:
            metadata = self.manager.item_metadata(step)[STATE]
            target = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), metadata.tree)
            saved = self.manager.restore(step, args=ocp.args.Composite(**{STATE: ocp.args.StandardRestore(target)}))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise DamagedCheckpointError(f"{folder} is not a readable orbax checkpoint: {type(e).__name__}: {e}") from e
        leaves = {_names(path): leaf for path, leaf in jax.tree_util.tree_leaves_with_path(saved[STATE])}

        def saved_rows(path: KeyPath, fresh: jax.Array) -> list[np.ndarray]:
            rank_axis = per_rank(fresh)
            if fresh.size == 0:  # saved as None (see save)
                return [np.zeros(fresh.shape[1:] if rank_axis else fresh.shape, fresh.dtype)] * manifest.world_size
            if _names(path) not in leaves:
                return rows_of_added_leaf(jax.tree_util.keystr(path), fresh, manifest.world_size, folder)
            value = leaves[_names(path)]
            return list(value) if rank_axis else [value] * manifest.world_size

        return restore_rows(manifest, saved_rows, self.trainer, params, model_state=model_state)

    def close(self) -> None:
        """Wait for the pending save, seal it and release orbax's resources."""
        self.wait_until_finished()
        self.manager.close()


def read_state(path: str | os.PathLike, step: int | None = None) -> Any:
    """The train state saved by :class:`OrbaxCheckpoints`, as NumPy arrays, in a process with any devices.

    ``path`` is the checkpoints' directory (its newest sealed step, or ``step``) or one step's
    folder. The state is the tree orbax stored: a dict per named tuple (``params``, ``opt_state``,
    ``step``, ``model_state``), leaves of per-rank state with the saved ranks along their first axis,
    zero-size leaves as None. The step's manifest and every file's size and digest are checked
    first (a :class:`~bagua_common.job.checkpoint.DamagedCheckpointError` names a bad file). orbax
    restores to NumPy targets built from the step's metadata, so the saving job's device count and
    mesh do not matter: a 4-device checkpoint reads on a laptop's one CPU.
    """
    folder = Path(path).absolute()  # orbax finds no metadata under a relative path
    if not (folder / STATE).is_dir():
        sealed = [int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / MANIFEST).exists()]
        if step is None and not sealed:
            raise FileNotFoundError(f"no sealed orbax checkpoint under {folder}")
        folder = folder / str(max(sealed) if step is None else step)
    verify_files(folder, read_manifest(folder))
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            metadata = checkpointer.metadata(folder / STATE).item_metadata.tree
            target = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), metadata)
            return checkpointer.restore(folder / STATE, target)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DamagedCheckpointError(f"{folder} is not a readable orbax checkpoint: {type(e).__name__}: {e}") from e


def _names(path: KeyPath) -> tuple[str, ...]:
    """A key path as names: orbax stores named tuples (``TrainState``, optax states) as dicts of their fields."""
    return tuple(str(getattr(entry, "name", getattr(entry, "key", getattr(entry, "idx", entry)))) for entry in path)


def _without_empty_leaves(state: Any) -> Any:
    """``state`` with its zero-size leaves (unused slots, e.g. DiLoCo's ``pending`` without delay) as None.

    orbax refuses to save arrays of zero size; they hold nothing, and a restore takes them from
    a fresh state.
    """
    return jax.tree.map(lambda leaf: None if leaf.size == 0 else leaf, state)

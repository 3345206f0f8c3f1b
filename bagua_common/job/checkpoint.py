"""Checkpoints that a restarted elastic job can trust: every rank's shard, then a manifest.

A checkpoint of step ``s`` under ``root`` is the folder ``root/step_<s>`` holding one shard
per rank (``rank_<r>.npz`` or ``.pt``, each written to a temporary name and renamed) and,
last, ``manifest.json``, written by rank 0 once every rank has written its shard (the front
end waits for all of them first) and renamed into place. The manifest names the step, the
world size, the algorithm and its configuration and the model's tensors; a folder without
one is a checkpoint that was being written when the job died, and :func:`latest` never
returns it.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class Manifest:
    """What a committed checkpoint holds: ``model`` is the ``(path, shape, dtype)`` of each model tensor."""

    step: int
    world_size: int
    local_world_size: int
    algorithm: str
    config: dict[str, str]
    model: list[tuple[str, tuple[int, ...], str]]
    format: int = FORMAT

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"checkpoint manifest format {data.get('format')!r}, expected {FORMAT}")
        data["model"] = [(p, tuple(shape), dtype) for p, shape, dtype in data["model"]]
        return cls(**data)


def checkpoint_dir(root: str | os.PathLike, step: int) -> Path:
    """The folder of step ``step``'s checkpoint under ``root``."""
    return Path(root) / f"step_{step:09d}"


def shard_path(directory: str | os.PathLike, rank: int, suffix: str) -> Path:
    """Rank ``rank``'s shard in a checkpoint folder (``suffix`` ``.npz`` for JAX, ``.pt`` for torch)."""
    return Path(directory) / f"rank_{rank}{suffix}"


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(temporary_path)``, flush it to disk, then rename it to ``path``: a reader sees all or nothing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_arrays(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    """Write named NumPy arrays as one shard (``.npz``), atomically."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **{key: np.asarray(value) for key, value in arrays.items()})

    write_atomically(path, write)


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    """Read a shard written by :func:`save_arrays` (no pickles)."""
    with np.load(path, allow_pickle=False) as data:
        return {key: data[key] for key in data.files}


def commit(directory: str | os.PathLike, manifest: Manifest) -> None:
    """Write the manifest (rank 0, after every rank's shard is written): the checkpoint becomes loadable."""
    directory = Path(directory)
    missing = [r for r in range(manifest.world_size) if not any(directory.glob(f"rank_{r}.*"))]
    if missing:
        raise RuntimeError(f"cannot commit {directory}: the shards of ranks {missing} are missing")
    write_atomically(directory / MANIFEST, lambda tmp: tmp.write_text(manifest.to_json()))


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """The manifest of a committed checkpoint (FileNotFoundError for a folder never committed)."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{directory} is not a committed checkpoint (no {MANIFEST}: it was never finished)")
    return Manifest.from_json(path.read_text())


def latest(root: str | os.PathLike) -> Path | None:
    """The newest committed checkpoint under ``root`` (None if there is none); unfinished ones are skipped."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name))]
    for _, path in sorted(steps, reverse=True):
        if (path / MANIFEST).exists():
            return path
    return None


def check_restorable(manifest: Manifest, *, algorithm: str, model: Iterable[tuple[str, tuple[int, ...], str]]) -> None:
    """Raise a ValueError naming why a checkpoint cannot be restored into this job (another algorithm or model)."""
    if manifest.algorithm != algorithm:
        raise ValueError(f"the checkpoint was written by algorithm {manifest.algorithm}, this job runs {algorithm}")
    model = [(str(p), tuple(int(d) for d in shape), str(dtype)) for p, shape, dtype in model]
    if model != list(manifest.model):
        saved = {p: (s, d) for p, s, d in manifest.model}
        here = {p: (s, d) for p, s, d in model}
        differences = [
            f"{p}: saved {saved.get(p, 'absent')}, here {here.get(p, 'absent')}"
            for p in sorted(saved.keys() | here.keys())
            if saved.get(p) != here.get(p)
        ]
        raise ValueError("the checkpoint holds another model: " + "; ".join(differences[:10]))

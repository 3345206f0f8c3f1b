"""Checkpoints that a restarted elastic job can trust: every rank's shard, then a manifest.

A checkpoint of step ``s`` under ``root`` is the folder ``root/step_<s>`` holding one shard
per rank (``rank_<r>.npz`` or ``.pt``, each written to a temporary name and renamed) and,
last, ``manifest.json``, written by rank 0 once every rank has written its shard (the front
end waits for all of them first) and renamed into place. The manifest names the step, the
world size, the algorithm and its configuration, the model's tensors and the size and
SHA-256 digest of every shard; a folder without one is a checkpoint that was being written
when the job died, and :func:`latest` never returns it. A shard that is missing, empty,
truncated or not the one committed (damaged, or copied from another step) is refused by
:func:`verified_shard` with a :class:`DamagedCheckpointError` naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zipfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

MANIFEST = "manifest.json"
FORMAT = 2
_STEP_DIR = re.compile(r"^step_(\d+)$")


class DamagedCheckpointError(ValueError):
    """A committed checkpoint's file is missing, empty, truncated or not the one its manifest names."""


@dataclass(frozen=True)
class ShardRecord:
    """A committed file's size in bytes and SHA-256 digest (hex)."""

    size: int
    sha256: str


@dataclass(frozen=True)
class Manifest:
    """What a committed checkpoint holds.

    ``model`` is the ``(path, shape, dtype)`` of each model tensor; ``shards`` maps each file of
    the checkpoint (its path relative to the folder) to its :class:`ShardRecord`, filled in by
    :func:`commit`; ``metadata`` is what the trainer recorded beside its state, as JSON (a fault-tolerant job's
    data position).
    """

    step: int
    world_size: int
    local_world_size: int
    algorithm: str
    config: dict[str, str]
    model: list[tuple[str, tuple[int, ...], str]]
    shards: dict[str, ShardRecord] = field(default_factory=dict)
    format: int = FORMAT
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        if data.get("format") != FORMAT:
            raise ValueError(f"checkpoint manifest format {data.get('format')!r}, expected {FORMAT}")
        data["model"] = [(p, tuple(shape), dtype) for p, shape, dtype in data["model"]]
        data["shards"] = {name: ShardRecord(**record) for name, record in data["shards"].items()}
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
    """Read a shard written by :func:`save_arrays` (no pickles).

    A corrupt one raises :class:`DamagedCheckpointError`.
    """
    try:
        with np.load(path, allow_pickle=False) as data:
            return {key: data[key] for key in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise DamagedCheckpointError(f"{path} is not a readable shard: {type(e).__name__}: {e}") from e


def _record(path: Path) -> ShardRecord:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return ShardRecord(path.stat().st_size, digest.hexdigest())


def commit(
    directory: str | os.PathLike,
    manifest: Manifest,
    shard_pattern: str = "rank_{rank}.*",
    metadata: Mapping[str, Any] | None = None,
) -> None:
    """Write the manifest (rank 0, after every rank's files are written): the checkpoint becomes loadable.

    Every rank must have a file matching ``shard_pattern`` (a glob with ``{rank}``); the manifest
    records the size and digest of every file in the folder (the project's ``rank_<r>.*`` shards,
    or the files torch.distributed.checkpoint wrote there), and ``metadata`` (JSON values) when given.
    """
    directory = Path(directory)
    missing = [r for r in range(manifest.world_size) if not any(directory.glob(shard_pattern.format(rank=r)))]
    if missing:
        raise RuntimeError(
            f"cannot commit {directory}: the shards of ranks {missing} are missing (every rank writes its shard into "
            "this folder: over several nodes it must be on a filesystem they all share)"
        )
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST and ".tmp" not in p.name)
    shards = {p.relative_to(directory).as_posix(): _record(p) for p in files}
    if metadata is not None:
        manifest = replace(manifest, metadata=dict(metadata))
    write_atomically(directory / MANIFEST, lambda tmp: tmp.write_text(replace(manifest, shards=shards).to_json()))


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """The manifest of a committed checkpoint (FileNotFoundError naming it for a folder never committed)."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: {directory} is not a committed checkpoint (never finished)")
    try:
        return Manifest.from_json(path.read_text())
    except (ValueError, KeyError, TypeError) as e:
        raise DamagedCheckpointError(f"{path} is not a readable checkpoint manifest: {e}") from e


def checkpoint_to_restore(root: str | os.PathLike) -> Path:
    """The checkpoint folder ``root`` names: ``root`` itself if it is one (committed or not), else the newest under it.

    Raises FileNotFoundError naming the missing manifest or the empty ``root``.
    """
    root = Path(root)
    if (root / MANIFEST).exists() or _STEP_DIR.match(root.name):
        read_manifest(root)
        return root
    directory = latest(root)
    if directory is None:
        raise FileNotFoundError(f"no committed checkpoint under {root}")
    return directory


def verified_shard(directory: str | os.PathLike, manifest: Manifest, name: str) -> Path:
    """The path of the file ``name`` of a committed checkpoint, once checked against the manifest's record.

    Raises :class:`DamagedCheckpointError` naming the file and what is wrong: missing, empty,
    truncated or grown, or with other content than the one committed (damaged, or a shard of
    another step copied in).
    """
    path = Path(directory) / name
    record = manifest.shards.get(name)
    if record is None:
        raise DamagedCheckpointError(f"{path}: the manifest of step {manifest.step} names no such file")
    if not path.is_file():
        raise DamagedCheckpointError(f"{path} is missing (the manifest of step {manifest.step} names it)")
    size = path.stat().st_size
    if size == 0:
        raise DamagedCheckpointError(f"{path} is empty, the manifest records {record.size} bytes")
    if size != record.size:
        what = "truncated" if size < record.size else "longer than written"
        raise DamagedCheckpointError(
            f"{path} is {what} or another checkpoint's file: {size} bytes, the manifest records {record.size}"
        )
    if _record(path).sha256 != record.sha256:
        raise DamagedCheckpointError(
            f"{path} does not hold what step {manifest.step} committed (its SHA-256 differs from the manifest's): "
            "damaged, or a shard of another checkpoint"
        )
    return path


def verify_files(directory: str | os.PathLike, manifest: Manifest) -> None:
    """Check every file the manifest records (see :func:`verified_shard`)."""
    for name in manifest.shards:
        verified_shard(directory, manifest, name)


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

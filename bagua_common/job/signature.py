"""The job signature: what every rank must agree on before training, compared across ranks.

A signature lists the model's tensors (path, shape, dtype) and the configuration (the
algorithm's class and fields, plus front-end settings such as the bucket size). Ranks first
exchange a fixed-size digest; only when the digests differ do they exchange the full
descriptions, so that one error can name what differs (which tensor, which field) and on
which ranks. Each front end builds its tensor list and gathers bytes over its communicator.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

Leaf = tuple[str, Sequence[int], str]  # (path, shape, dtype)
AllGather = Callable[[np.ndarray], np.ndarray]  # uint8 [n] on each rank -> uint8 [ranks, n]

_DIGEST_BYTES = 32
_LENGTH_BYTES = 8
_MAX_DIFFERENCES = 10  # lines in the error; the rest are counted


def describe_value(value: Any) -> str:
    """A description of a configuration value that is the same in every process.

    Unlike ``repr`` it never holds a memory address: numbers, strings, enums and containers
    are spelled out, dataclasses field by field, arrays by dtype, shape and a digest of their
    bytes, callables and other objects by their qualified name.
    """
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return repr(value)
    if isinstance(value, enum.Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(describe_value(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner})"
    if isinstance(value, Mapping):
        items = sorted((describe_value(k), describe_value(v)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if hasattr(value, "__array__") and hasattr(value, "dtype"):
        array = np.asarray(value)
        digest = hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()[:16]
        return f"array({array.dtype}{list(array.shape)}, sha256 {digest})"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _qualified_name(type(value)) + describe_value(_fields(value))
    return _qualified_name(value if isinstance(value, type) or callable(value) else type(value))


def _qualified_name(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__qualname__)}"


def _fields(config: Any) -> dict[str, Any]:
    """A configuration object's fields: a dataclass's fields, else its public attributes; an algorithm's shared
    configuration (its ``config``) is expanded into its fields."""
    if dataclasses.is_dataclass(config):
        found = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    else:
        found = {k: v for k, v in sorted(getattr(config, "__dict__", {}).items()) if not k.startswith("_")}
    held = found.get("config")
    if dataclasses.is_dataclass(held) and not isinstance(held, type):
        del found["config"]
        found = {**_fields(held), **found}
    return found


def algorithm_config(algorithm: Any, **settings: Any) -> dict[str, str]:
    """The configuration part of a signature: the algorithm's class and fields, then ``settings``.

    Keys are ``"algorithm"`` (the qualified class name), ``"algorithm.<field>"`` for each
    field (public attribute, for a class that is not a dataclass) and each setting's name.
    """
    config = {"algorithm": _qualified_name(type(algorithm))}
    config.update({f"algorithm.{k}": describe_value(v) for k, v in _fields(algorithm).items()})
    config.update({k: describe_value(v) for k, v in settings.items()})
    return config


@dataclasses.dataclass(frozen=True)
class JobSignature:
    """The model's tensors as ``(path, shape, dtype)`` and the configuration as field -> text."""

    leaves: tuple[tuple[str, tuple[int, ...], str], ...]
    config: tuple[tuple[str, str], ...]

    @classmethod
    def of(cls, leaves: Iterable[Leaf], config: Mapping[str, str]) -> JobSignature:
        """Build a signature from ``(path, shape, dtype)`` triples and a configuration mapping."""
        return cls(
            tuple((str(p), tuple(int(d) for d in shape), str(dtype)) for p, shape, dtype in leaves),
            tuple((str(k), str(v)) for k, v in config.items()),
        )

    def encode(self) -> bytes:
        """The canonical JSON encoding of the signature (the same bytes on every rank)."""
        return json.dumps({"leaves": self.leaves, "config": self.config}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> JobSignature:
        """The signature :meth:`encode` encoded."""
        obj = json.loads(data.decode())
        return cls.of(obj["leaves"], dict(obj["config"]))

    def digest(self) -> bytes:
        """The SHA-256 of :meth:`encode`."""
        return hashlib.sha256(self.encode()).digest()


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _by_value(values: list[str]) -> str:
    """``'a' on ranks 0, 2; 'b' on rank 1``: each distinct value and the ranks that have it."""
    groups: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return "; ".join(f"{value} on {_ranks(ranks)}" for value, ranks in groups.items())


def describe_differences(signatures: Sequence[JobSignature]) -> list[str]:
    """One line per difference among the ranks' signatures (rank i's at index i).

    Tensors are matched by path: a tensor some ranks lack, or whose shape or dtype differs,
    is named with the ranks holding each variant; then each differing configuration field.
    """
    lines = []
    leaf_maps = [{path: (shape, dtype) for path, shape, dtype in s.leaves} for s in signatures]
    paths = list(dict.fromkeys(path for s in signatures for path, _, _ in s.leaves))
    for path in paths:
        values = [f"{list(m[path][0])} {m[path][1]}" if path in m else "missing" for m in leaf_maps]
        if len(set(values)) > 1:
            lines.append(f"tensor {path!r}: {_by_value(values)}")
    if not lines:
        orders = [str([path for path, _, _ in s.leaves]) for s in signatures]
        if len(set(orders)) > 1:
            lines.append("the same tensors in a different order: " + _by_value(orders))
    configs = [dict(s.config) for s in signatures]
    for key in dict.fromkeys(k for c in configs for k in c):
        values = [c.get(key, "missing") for c in configs]
        if len(set(values)) > 1:
            lines.append(f"{key}: {_by_value(values)}")
    return lines


def gather_bytes(allgather: AllGather, data: bytes, length: int) -> list[bytes]:
    """Gather ``data`` (zero-padded to ``length`` bytes) from every rank, in rank order."""
    padded = np.zeros(length, np.uint8)
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    return [bytes(row) for row in np.asarray(allgather(padded), np.uint8)]


def check_same_job(signature: JobSignature, allgather: AllGather) -> None:
    """Raise a ``ValueError`` on every rank unless all ranks have the same ``signature``.

    ``allgather`` gathers a uint8 array of the same length from every rank (row r from rank
    r); every rank must call this function. The error lists each difference with the ranks
    holding each variant.
    """
    encoded = signature.encode()
    header = signature.digest() + len(encoded).to_bytes(_LENGTH_BYTES, "little")
    headers = gather_bytes(allgather, header, len(header))
    if len(set(headers)) == 1:
        return
    longest = max(int.from_bytes(h[_DIGEST_BYTES:], "little") for h in headers)
    rows = gather_bytes(allgather, encoded, longest)
    lengths = [int.from_bytes(h[_DIGEST_BYTES:], "little") for h in headers]
    lengths_text = [f"{n} bytes, sha256 {h[:8].hex()}" for n, h in zip(lengths, headers)]
    signatures = [JobSignature.decode(row[:n]) for row, n in zip(rows, lengths)]
    lines = describe_differences(signatures) or ["the encodings differ: " + _by_value(lengths_text)]
    shown = [f"  {line}" for line in lines[:_MAX_DIFFERENCES]]
    if len(lines) > _MAX_DIFFERENCES:
        shown.append(f"  ... and {len(lines) - _MAX_DIFFERENCES} more differences")
    raise ValueError(
        "the ranks do not run the same job (every rank must build the same model, algorithm "
        "and settings):\n" + "\n".join(shown)
    )

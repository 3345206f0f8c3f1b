"""The text the GPT learns: the Python source of the installed torch==2.13.0 wheel, as bytes.

Real text nobody in this project wrote, present offline wherever the project's tests run, and
pinned: the ``.py`` files under torch's package directory (found without importing torch), sorted
by their path relative to it, concatenated as raw bytes (a vocabulary of 256 tokens).
``version.py`` is left out, since it names the build (``+cpu``, the CUDA version) rather than the
release. A file whose relative path's blake2b digest is 0 mod 20 is held out for evaluation.

The bytes are checked against :data:`CORPUS_DIGEST` (blake2b over every file's relative path, a NUL
byte and its content, in order): another torch version gives another digest, and loading refuses
with both digests rather than training on silently different text. The verified text is cached
once per machine (``$XDG_CACHE_HOME/bagua/``, ``~/.cache`` by default, or ``BAGUA_CORPUS_CACHE``)
as one file that every process memory-maps.

Batches are deterministic in ``(seed, step, rank)``: every run, every rank count and every
algorithm trained with the same seed sees the same tokens.

:func:`byte_entropies` gives the yardsticks a loss is read against: the held-out text's unigram
entropy (what a model that learned only byte frequencies reaches) and its bigram conditional
entropy (only the previous byte), in nats per byte like the models' loss.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TORCH_RELEASE = "2.13.0"
"""The torch release whose source is the corpus (the version the README pins)."""

CORPUS_FILES = 2284
CORPUS_BYTES = 46_444_776
HELDOUT_FILES = 122
HELDOUT_BYTES = 2_614_814
CORPUS_DIGEST = "df566372ca05864aba6498776be9694bf6a02737a88ad0bc42dfdd1baf5ae874"
"""The pinned corpus: its files, bytes (training and held-out together), held-out part and digest."""

HELDOUT_MODULUS = 20
_LEFT_OUT = ("version.py",)


def _torch_package_root() -> Path:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the corpus is the source of torch=={TORCH_RELEASE}, which is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def is_heldout(relative_path: str) -> bool:
    """Whether the file at ``relative_path`` (POSIX, relative to torch's package directory) is held out."""
    digest = hashlib.blake2b(relative_path.encode()).digest()
    return int.from_bytes(digest, "big") % HELDOUT_MODULUS == 0


def read_sources(root: Path) -> tuple[bytes, bytes]:
    """(training bytes, held-out bytes) of the ``.py`` files under ``root``, a torch package directory.

    Raises a RuntimeError naming both digests when they are not the pinned corpus.
    """
    paths = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py"))
    digest = hashlib.blake2b(digest_size=32)
    train, heldout = [], []
    for path in paths:
        if path in _LEFT_OUT:
            continue
        text = (root / path).read_bytes()
        digest.update(path.encode() + b"\0" + text)
        (heldout if is_heldout(path) else train).append(text)
    size = sum(map(len, train)) + sum(map(len, heldout))
    if digest.hexdigest() != CORPUS_DIGEST:
        raise RuntimeError(
            f"the corpus read from {root} has blake2b digest {digest.hexdigest()} ({size} bytes), not the pinned "
            f"{CORPUS_DIGEST} ({CORPUS_BYTES} bytes of torch=={TORCH_RELEASE}'s .py files): install "
            f"torch=={TORCH_RELEASE} so that every number trained on it means the same"
        )
    if (len(heldout), sum(map(len, heldout))) != (HELDOUT_FILES, HELDOUT_BYTES):
        raise RuntimeError(
            f"the held-out split of {root} has {len(heldout)} files, {sum(map(len, heldout))} bytes; "
            f"the pinned split has {HELDOUT_FILES} files, {HELDOUT_BYTES} bytes"
        )
    return b"".join(train), b"".join(heldout)


def _cache_path() -> Path:
    explicit = os.environ.get("BAGUA_CORPUS_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bagua" / f"torch-{TORCH_RELEASE}-py-corpus-{CORPUS_DIGEST[:16]}-{HELDOUT_BYTES}.u8"


@dataclass(frozen=True)
class Corpus:
    """The training and held-out text as read-only ``uint8`` arrays, and the batches drawn from them."""

    train: np.ndarray
    heldout: np.ndarray

    def batch(self, seed: int, step: int, rank: int, batch_size: int, length: int) -> np.ndarray:
        """``batch_size`` windows of ``length`` consecutive training bytes, as an int32 ``(batch_size, length)``
        array: the batch of ``rank`` at ``step``, a function of ``(seed, step, rank)`` only. A language model
        reads ``[:, :-1]`` and predicts ``[:, 1:]``, so ``length`` is its context plus one."""
        for name, value in (("seed", seed), ("step", step), ("rank", rank)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"corpus batch: {name} must be an int >= 0, got {value!r}")
        rng = np.random.default_rng([int(seed), int(step), int(rank)])
        starts = rng.integers(0, self.train.size - _checked_length(length, self.train) + 1, size=batch_size)
        return _windows(self.train, starts, length)

    def heldout_batch(self, batch_size: int, length: int) -> np.ndarray:
        """``batch_size`` windows of ``length`` held-out bytes spread evenly over the held-out text, as int32: the
        same evaluation set for every run."""
        starts = np.linspace(0, self.heldout.size - _checked_length(length, self.heldout), batch_size)
        return _windows(self.heldout, starts.astype(np.int64), length)

    def heldout_entropies(self) -> ByteEntropies:
        """The held-out text's unigram and bigram entropies (:func:`byte_entropies`): the losses of a model that
        learned only byte frequencies, and only the previous byte."""
        return byte_entropies(self.heldout)


@dataclass(frozen=True)
class ByteEntropies:
    """A text's empirical entropies in nats per byte: ``unigram``, ``H(X)`` of its byte frequencies, and ``bigram``,
    ``H(X_t | X_{t-1})`` of its byte pairs."""

    unigram: float
    bigram: float


def byte_entropies(text: np.ndarray) -> ByteEntropies:
    """The unigram entropy and bigram conditional entropy of ``text`` (bytes as a ``uint8`` array of at least two),
    from its own counts: ``-sum p(a) log p(a)``, and ``H(pairs) - H(first bytes of the pairs)`` over its ``n - 1``
    overlapping pairs."""
    text = np.asarray(text)
    if text.dtype != np.uint8 or text.ndim != 1 or text.size < 2:
        raise ValueError(f"byte_entropies: need a 1-d uint8 array of at least 2 bytes, got {text.dtype} {text.shape}")
    pairs = np.bincount(text[:-1].astype(np.int64) * 256 + text[1:], minlength=256 * 256)
    first = pairs.reshape(256, 256).sum(axis=1)
    return ByteEntropies(unigram=_entropy(np.bincount(text, minlength=256)), bigram=_entropy(pairs) - _entropy(first))


def _entropy(counts: np.ndarray) -> float:
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def _checked_length(length: int, text: np.ndarray) -> int:
    if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or not 2 <= length <= text.size:
        raise ValueError(f"corpus batch: length must be an int in [2, {text.size}], got {length!r}")
    return int(length)


def _windows(text: np.ndarray, starts: np.ndarray, length: int) -> np.ndarray:
    return text[starts[:, None] + np.arange(length)].astype(np.int32)


def _write_cache(path: Path, train: bytes, heldout: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written whole under a temporary name, then renamed: concurrent ranks never map a partial file.
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=path.name, delete=False) as out:
        out.write(train)
        out.write(heldout)
    os.replace(out.name, path)


@functools.cache
def load_corpus() -> Corpus:
    """The pinned corpus, memory-mapped from the machine's cache, built there from torch's source on first use.

    Raises a RuntimeError naming both digests when the installed torch's source is not the pinned corpus.
    """
    path = _cache_path()
    if not (path.is_file() and path.stat().st_size == CORPUS_BYTES):
        _write_cache(path, *read_sources(_torch_package_root()))
    text = np.memmap(path, dtype=np.uint8, mode="r")
    split = CORPUS_BYTES - HELDOUT_BYTES
    return Corpus(train=text[:split], heldout=text[split:])

"""The workload's corpus: torch 2.13.0's Python source as pinned bytes, its held-out split and its batches.

The expected text is rebuilt here independently (os.walk, its own blake2b split) and compared byte for byte with
what ``load_corpus`` maps; another source tree is refused with both digests named.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from bagua_common.workload import corpus as corpus_module
from bagua_common.workload import load_corpus


def test_corpus_is_torch_source_sorted_by_path_split_by_path_digest(tmp_path, monkeypatch):
    monkeypatch.setenv("BAGUA_CORPUS_CACHE", str(tmp_path / "corpus.u8"))  # built afresh, not the machine's copy
    load_corpus.cache_clear()
    root = Path(importlib.util.find_spec("torch").submodule_search_locations[0])
    paths = sorted(
        os.path.relpath(os.path.join(folder, name), root).replace(os.sep, "/")
        for folder, _, names in os.walk(root)
        for name in names
        if name.endswith(".py")
    )
    paths.remove("version.py")  # names the build, not the release
    heldout = [p for p in paths if int(hashlib.blake2b(p.encode()).hexdigest(), 16) % 20 == 0]
    train = [p for p in paths if p not in set(heldout)]
    corpus = load_corpus()
    load_corpus.cache_clear()
    assert (tmp_path / "corpus.u8").stat().st_size == corpus_module.CORPUS_BYTES
    assert len(paths) == corpus_module.CORPUS_FILES and len(heldout) == corpus_module.HELDOUT_FILES
    assert bytes(corpus.train) == b"".join((root / p).read_bytes() for p in train)
    assert bytes(corpus.heldout) == b"".join((root / p).read_bytes() for p in heldout)
    assert corpus.train.size + corpus.heldout.size == corpus_module.CORPUS_BYTES
    assert corpus.heldout.size == corpus_module.HELDOUT_BYTES
    assert "import torch" in bytes(corpus.heldout).decode("utf-8", "replace")


def test_another_source_tree_is_refused_naming_both_digests(tmp_path):
    (tmp_path / "nn").mkdir()
    (tmp_path / "nn" / "a.py").write_bytes(b"x = 1\n")
    (tmp_path / "b.py").write_bytes(b"y = 2\n")
    digest = hashlib.blake2b(b"b.py\0y = 2\nnn/a.py\0x = 1\n", digest_size=32).hexdigest()
    with pytest.raises(RuntimeError) as error:
        corpus_module.read_sources(tmp_path)
    assert digest in str(error.value) and corpus_module.CORPUS_DIGEST in str(error.value)


def test_batches_are_windows_of_the_text_drawn_from_seed_step_and_rank(rng):
    corpus = load_corpus()
    seed, step, batch, length = int(rng.integers(2**31)), int(rng.integers(10**6)), 3, int(rng.integers(2, 300))
    tokens = corpus.batch(seed, step, 1, batch, length)
    assert tokens.shape == (batch, length) and tokens.dtype == np.int32
    assert np.array_equal(tokens, corpus.batch(seed, step, 1, batch, length))
    for other in ((seed + 1, step, 1), (seed, step + 1, 1), (seed, step, 0)):
        assert not np.array_equal(tokens, corpus.batch(*other, batch, length)), other
    train = bytes(corpus.train)
    assert all(train.find(bytes(row.astype(np.uint8))) >= 0 for row in tokens)
    heldout = corpus.heldout_batch(4, length)
    assert np.array_equal(heldout, corpus.heldout_batch(4, length))
    assert np.array_equal(heldout[0], corpus.heldout[:length]) and np.array_equal(heldout[-1], corpus.heldout[-length:])


@pytest.mark.parametrize("bad", [{"length": 1}, {"rank": -1}, {"step": 1.5}])
def test_bad_batch_arguments_are_refused(bad):
    arguments = {"seed": 0, "step": 0, "rank": 0, "batch_size": 2, "length": 8, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        load_corpus().batch(**arguments)


def _entropies_by_counting(data: bytes) -> tuple[float, float]:
    """Unigram entropy and bigram conditional entropy, written out from Python counts: ``-sum p(a) log p(a)`` and
    ``-sum p(a, b) log p(b | a)`` over the overlapping pairs."""
    singles, pairs = Counter(data), Counter(zip(data, data[1:]))
    firsts = Counter(data[:-1])
    n, m = len(data), len(data) - 1
    unigram = -sum(c / n * math.log(c / n) for c in singles.values())
    bigram = -sum(c / m * math.log(c / firsts[a]) for (a, _), c in pairs.items())
    return unigram, bigram


def test_byte_entropies_match_a_count_of_the_text(rng):
    corpus = load_corpus()
    start = int(rng.integers(corpus.heldout.size - 200_000))
    part = corpus.heldout[start : start + 200_000]
    got = corpus_module.byte_entropies(np.asarray(part))
    assert (got.unigram, got.bigram) == pytest.approx(_entropies_by_counting(bytes(part)), rel=1e-9)
    whole = corpus.heldout_entropies()  # the count of the held-out text: 3.31 and 2.38 nats/byte
    assert round(whole.unigram, 2) == 3.31 and round(whole.bigram, 2) == 2.38
    uniform = corpus_module.byte_entropies(rng.integers(0, 256, 1 << 20).astype(np.uint8))
    assert uniform.unigram == pytest.approx(math.log(256), abs=1e-3) and uniform.bigram < uniform.unigram


@pytest.mark.parametrize("bad", [np.zeros(1, np.uint8), np.zeros(8, np.int32), np.zeros((2, 4), np.uint8)])
def test_byte_entropies_refuse_what_is_not_bytes(bad):
    with pytest.raises(ValueError, match="byte_entropies"):
        corpus_module.byte_entropies(bad)

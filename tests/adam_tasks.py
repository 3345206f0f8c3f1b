"""The two real-model tasks of the QAdam / 1-bit Adam convergence tests, shared by both front ends.

Both tasks are built so that, when the warm-up ends, many coordinates have a frozen second
moment of exactly zero, which is what real models hit (issue 12):

* ``cnn``: a two-layer CNN on scikit-learn's 8x8 digits. Two of the first layer's filters
  start dead (zero weights, bias -1: ReLU never fires), so their weights and the next layer's
  weights reading them get exact-zero gradients for the whole run.
* ``transformer``: an embedding table, one single-head attention block and a classifier on
  synthetic token sequences. During the warm-up only tokens below ``WARMUP_VOCAB`` occur; after
  it tokens up to ``LATE_VOCAB`` do (rows with zero frozen variance that then get a non-zero
  momentum), and rows from ``LATE_VOCAB`` on never occur.

Initial parameters, batches and the transformer's held-out data are NumPy, deterministic functions of the
test run's seed (``BAGUA_TEST_SEED``), so the JAX and torch tests train the same models on the same data, new data
each run. What the tasks are built to show holds for every seed by construction: the dead filters start dead, and
the warm-up's tokens are drawn below ``WARMUP_VOCAB``.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import digits
import numpy as np

STEPS, WARMUP_STEPS, BATCH, LR = 200, 50, 64, 3e-3
LOSS_MARGIN, GROWTH = 0.1, 3.0
CHANNELS, DEAD_FILTERS = (8, 16), 2
VOCAB, WARMUP_VOCAB, LATE_VOCAB, SEQ, WIDTH, CLASSES = 96, 40, 80, 8, 32, 4


def _rng(seed: int, stream: str) -> np.random.Generator:
    """A generator of its own for each use of the run's seed (``stream``: ``params``, ``batches``, ...)."""
    return np.random.default_rng([seed, zlib.crc32(stream.encode())])


def cnn_params(seed: int) -> dict[str, np.ndarray]:
    """conv1 (3x3, 1 -> 8, HWIO), conv2 (3x3, 8 -> 16, stride 2), dense (4*4*16 -> 10); filters 0 and 1
    of conv1 are dead."""
    rng = _rng(seed, "cnn params")
    c1, c2 = CHANNELS
    params = {
        "conv1": rng.standard_normal((3, 3, 1, c1)) / 3,
        "conv1_b": np.zeros(c1),
        "conv2": rng.standard_normal((3, 3, c1, c2)) / np.sqrt(9 * c1),
        "conv2_b": np.zeros(c2),
        "dense": rng.standard_normal((16 * c2, 10)) / np.sqrt(16 * c2),
        "dense_b": np.zeros(10),
    }
    params["conv1"][..., :DEAD_FILTERS] = 0.0
    params["conv1_b"][:DEAD_FILTERS] = -1.0
    return {k: v.astype(np.float32) for k, v in params.items()}


def cnn_batches(seed: int) -> Iterator[dict[str, np.ndarray]]:
    """``STEPS`` global batches of digits as NHWC images (``x``: (BATCH, 8, 8, 1), ``y``: int32 labels)."""
    x, y, _, _ = digits.load()
    for batch in digits.batches(x, y, BATCH, STEPS, seed):
        yield {"x": batch["x"].reshape(-1, 8, 8, 1), "y": batch["y"]}


def cnn_eval(seed: int) -> dict[str, np.ndarray]:
    """The held-out digits, for the final loss (the same whatever the seed)."""
    del seed
    _, _, x_test, y_test = digits.load()
    return {"x": x_test.reshape(-1, 8, 8, 1), "y": y_test}


def transformer_params(seed: int) -> dict[str, np.ndarray]:
    """Token and position embeddings, one attention block (q, k, v, o), an MLP (w1, w2) and the head."""
    rng = _rng(seed, "transformer params")

    def dense(n_in: int, n_out: int) -> np.ndarray:
        return rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)

    params = {
        "embed": rng.standard_normal((VOCAB, WIDTH)) * 0.5,
        "pos": rng.standard_normal((SEQ, WIDTH)) * 0.5,
        "q": dense(WIDTH, WIDTH),
        "k": dense(WIDTH, WIDTH),
        "v": dense(WIDTH, WIDTH),
        "o": dense(WIDTH, WIDTH),
        "w1": dense(WIDTH, 2 * WIDTH),
        "b1": np.zeros(2 * WIDTH),
        "w2": dense(2 * WIDTH, WIDTH),
        "head": dense(WIDTH, CLASSES),
        "head_b": np.zeros(CLASSES),
    }
    return {k: v.astype(np.float32) for k, v in params.items()}


def _sequences(seed: int, rng: np.random.Generator, n: int, vocab: int) -> dict[str, np.ndarray]:
    """``n`` sequences of tokens below ``vocab``; the label is the hidden class of the first token."""
    classes = _rng(seed, "token classes").integers(0, CLASSES, VOCAB)
    tokens = rng.integers(0, vocab, (n, SEQ)).astype(np.int32)
    return {"x": tokens, "y": classes[tokens[:, 0]].astype(np.int32)}


def transformer_batches(seed: int) -> Iterator[dict[str, np.ndarray]]:
    """``STEPS`` global batches: tokens below ``WARMUP_VOCAB`` for the warm-up, below ``LATE_VOCAB`` after."""
    rng = _rng(seed, "transformer batches")
    for step in range(STEPS):
        yield _sequences(seed, rng, BATCH, WARMUP_VOCAB if step < WARMUP_STEPS else LATE_VOCAB)


def transformer_eval(seed: int) -> dict[str, np.ndarray]:
    """512 fresh sequences of the late vocabulary, for the final loss."""
    return _sequences(seed, _rng(seed, "transformer eval"), 512, LATE_VOCAB)


def assert_trains_like_adam(label: str, params: dict, loss: float, adam_params: dict, adam_loss: float) -> None:
    """The acceptance check of both front ends' tests: the held-out ``loss`` is within ``LOSS_MARGIN``
    of Adam's, every parameter is finite, and no parameter's largest magnitude exceeds ``GROWTH``
    times Adam's (the divergence of issue 12 grew embeddings ~10^4-fold)."""
    growth = 0.0
    for name, value in params.items():
        value = np.asarray(value)
        assert np.all(np.isfinite(value)), (label, name)
        ratio = float(np.max(np.abs(value)) / np.max(np.abs(np.asarray(adam_params[name]))))
        assert ratio <= GROWTH, (label, name, ratio)
        growth = max(growth, ratio)
    print(f"{label}: held-out loss {loss:.4f}, adam {adam_loss:.4f}, largest growth {growth:.2f}")
    assert loss <= adam_loss + LOSS_MARGIN, (label, loss, adam_loss)

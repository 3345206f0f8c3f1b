"""Run flax's MNIST examples as they are, offline, on scikit-learn's digits.

The example files (``upstream/`` as flax ships them, or with the changes of ``linen.diff`` and
``nnx.diff`` applied) import TensorFlow, TensorFlow Datasets, ml_collections, flax's
TensorBoard writer and orbax's exporter, none of which an offline CPU job needs: this module
stands in for each of them, replaces the example's ``get_datasets`` with the digits (8x8 images
scaled up to MNIST's 28x28), and reads the test accuracy from what the example writes to its
summary writer. Run one example: ``python examples/flax_mnist/offline.py linen --epochs 3``, or
data-parallel on two processes: ``mpiexec -n 2 python examples/flax_mnist/offline.py nnx
--data-parallel --algorithm bytegrad``. Every name of ``bagua_jax.algorithms.algorithm_names()`` runs;
``qadam`` and ``onebit_adam`` replace the example's SGD with Adam, at the configuration's learning
rate (``--learning-rate``, 0.003 for them unless given).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ADAM_LEARNING_RATE = 0.003
"""The configuration's learning rate for the algorithms that replace flax's SGD with Adam (QAdam, 1-bit Adam)."""
sys.path.insert(0, str(HERE.parent))
import digits_data  # noqa: E402  (examples/digits_data.py, beside this folder)

from bagua_jax.algorithms import is_optimizer  # noqa: E402


class ConfigDict(dict):
    """What the examples use of ``ml_collections.ConfigDict``: attributes that are dict items."""

    __getattr__ = dict.__getitem__
    __setattr__ = dict.__setitem__


class SummaryWriter:
    """flax's TensorBoard writer, keeping the scalars in memory: ``scalars[name]`` is the list of values."""

    def __init__(self, workdir: str):
        self.scalars: dict[str, list[float]] = {}
        WRITERS.append(self)

    def hparams(self, hparams: dict) -> None:
        del hparams

    def scalar(self, name: str, value: float, step: int) -> None:
        del step
        self.scalars.setdefault(name, []).append(float(value))

    def flush(self) -> None:
        pass


class _Exporter:
    """orbax's exporter: the examples export a SavedModel at the end, which an offline run skips."""

    def __init__(self, *args, **kwargs):
        del args, kwargs

    def save(self, path: str) -> None:
        del path


WRITERS: list[SummaryWriter] = []


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    return module


@contextlib.contextmanager
def stand_ins():
    """The stand-ins in ``sys.modules`` while an example imports or runs (it imports orbax's exporter at its end);
    whatever was there before is put back after, so other code in the process never sees them."""
    modules = [
        _module("ml_collections", ConfigDict=ConfigDict),
        _module("tensorflow_datasets"),
        _module(
            "tensorflow",
            random=types.SimpleNamespace(set_seed=lambda seed: None),
            data=types.SimpleNamespace(Dataset=object),
            TensorSpec=lambda **kwargs: kwargs,
            float32="float32",
        ),
        _module("flax.metrics.tensorboard", SummaryWriter=SummaryWriter),
        _module("orbax.export", JaxModule=_Exporter, ExportManager=_Exporter, ServingConfig=_Exporter),
    ]
    saved = {module.__name__: sys.modules.get(module.__name__) for module in modules}
    sys.modules.update({module.__name__: module for module in modules})
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                del sys.modules[name]
            else:
                sys.modules[name] = module


def digits() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The digits' 1400 training and 397 test examples as MNIST-shaped images ``[n, 28, 28, 1]`` with labels."""
    x_train, y_train, x_test, y_test = digits_data.load()

    def images(x: np.ndarray) -> np.ndarray:
        scaled = np.kron(x.reshape(-1, 8, 8), np.ones((3, 3), np.float32))  # 24x24
        return np.pad(scaled, ((0, 0), (2, 2), (2, 2)))[..., None].astype(np.float32)

    return {"image": images(x_train), "label": y_train}, {"image": images(x_test), "label": y_test}


class Batches:
    """What the NNX example uses of a ``tf.data.Dataset``: ``as_numpy_iterator()`` over full batches, the
    training set reshuffled each epoch the same way on every process."""

    def __init__(self, data: dict[str, np.ndarray], batch_size: int, shuffle: bool):
        self.data, self.batch_size, self.shuffle, self.epoch = data, batch_size, shuffle, 0

    def as_numpy_iterator(self):
        order = np.arange(len(self.data["label"]))
        if self.shuffle:
            order = np.random.default_rng(self.epoch).permutation(order)
            self.epoch += 1
        for start in range(0, len(order) - self.batch_size + 1, self.batch_size):
            rows = order[start : start + self.batch_size]
            yield {key: value[rows] for key, value in self.data.items()}


def patched(diff: str) -> dict[str, str]:
    """The files a unified diff of ``upstream/`` produces, by name: each upstream file with the diff's hunks applied
    (and checked: a hunk whose context or removed lines do not match the upstream file raises a ValueError)."""
    files: dict[str, str] = {}
    lines = diff.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("--- a/upstream/"):
            i += 1
            continue
        name = lines[i].removeprefix("--- a/upstream/")
        source, out, taken = (HERE / "upstream" / name).read_text().split("\n"), [], 0
        i += 2  # past the "+++" line
        while i < len(lines) and lines[i].startswith("@@"):
            start = int(lines[i].split()[1].lstrip("-").split(",")[0]) - 1
            out, taken, i = out + source[taken:start], start, i + 1
            while i < len(lines) and lines[i][:1] in (" ", "-", "+", "\\"):
                kind, text = lines[i][:1], lines[i][1:]
                if kind in (" ", "-"):
                    if source[taken] != text:
                        raise ValueError(
                            f"{name}: the diff expects {text!r} at line {taken + 1}, upstream has {source[taken]!r}"
                        )
                    taken += 1
                if kind in (" ", "+"):
                    out.append(text)
                i += 1
        files[name] = "\n".join(out + source[taken:])
    return files


def load(example: str, data_parallel: bool) -> tuple[types.ModuleType, types.ModuleType]:
    """The example's ``train`` and ``default`` config modules (``example``: ``linen`` or ``nnx``), as flax ships
    them or with ``{example}.diff`` applied."""
    names = {"train": f"{example}_train.py", "default": "default.py"}
    if data_parallel:
        sources = patched((HERE / f"{example}.diff").read_text())
    else:
        sources = {name: (HERE / "upstream" / name).read_text() for name in names.values()}
    folder = "data_parallel" if data_parallel else "upstream"  # the changed files' name, for tracebacks
    modules = []
    for part, name in names.items():
        module = types.ModuleType(f"flax_mnist_{example}_{part}")
        with stand_ins():
            exec(compile(sources[name], str(HERE / folder / name), "exec"), module.__dict__)
        modules.append(module)
    train, default = modules
    train_ds, test_ds = digits()
    if example == "linen":
        train.get_datasets = lambda: (dict(train_ds), dict(test_ds))
    else:
        train.get_datasets = lambda config: (
            Batches(train_ds, config.batch_size, shuffle=True),
            Batches(test_ds, config.batch_size, shuffle=False),
        )
    return train, default


def run(
    example: str, data_parallel: bool, epochs: int, algorithm: Any = None, learning_rate: float | None = None
) -> list[float]:
    """Train ``example`` for ``epochs`` with flax's default configuration (``algorithm``: a name or an algorithm
    object, for the data-parallel version; ``learning_rate`` in place of flax's 0.1); its test accuracy (a
    fraction) per epoch."""
    train, default = load(example, data_parallel)
    config = default.get_config()
    config.num_epochs = epochs
    if algorithm is not None:
        config.algorithm = algorithm
    if learning_rate is not None:
        config.learning_rate = learning_rate
    with stand_ins():
        train.train_and_evaluate(config, workdir="")
    return WRITERS[-1].scalars["test_accuracy"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("example", choices=["linen", "nnx"])
    parser.add_argument("--data-parallel", action="store_true", help="the changed example (run it under mpiexec)")
    parser.add_argument("--algorithm", default=None, help="the algorithm's registry name (with --data-parallel)")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--learning-rate",
        type=float,
        default=None,
        help="the configuration's learning rate (default: flax's 0.1, which suits its SGD; 0.003 for qadam and "
        "onebit_adam, which replace the optimizer with Adam and take the configuration's rate)",
    )
    args = parser.parse_args()
    learning_rate = args.learning_rate
    if learning_rate is None and args.algorithm is not None and is_optimizer(args.algorithm):
        learning_rate = ADAM_LEARNING_RATE
    accuracies = run(args.example, args.data_parallel, args.epochs, args.algorithm, learning_rate)
    print("test accuracy per epoch:", " ".join(f"{a:.3f}" for a in accuracies))


if __name__ == "__main__":
    main()

"""The Lightning strategy (bagua_torch.lightning.BaguaStrategy) with the real ``lightning.pytorch.Trainer``.

``lightning_train.py`` runs on 2 CPU processes, started by Lightning's own launcher (every algorithm of the
registry, one process pair) and by ``bagua-launch`` (ByteGrad with error feedback). For each algorithm it trains
one epoch with the Trainer (Lightning's ModelCheckpoint saves it), resumes a new Trainer from that checkpoint for
a second epoch, and trains the same two epochs with ``with_bagua`` on the same batches. The resumed Trainer's
parameters must equal the wrapper's bit for bit (the algorithm's state, the per-rank replicas of the
decentralized algorithms and the optimizers' state all come back from the checkpoint), except for ``async``,
whose background averaging depends on timing: there both must have trained, and stay within a loose bound.
What they train is ``lightning_run.py``'s, which this process imports without Lightning (whose import costs
seconds of CPU).
"""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import numpy as np
from lightning_run import OPTIONS, make_model
from process_group import run_group

from bagua_common.algorithms.registry import CONFIGS
from bagua_torch.algorithms import available_algorithms

TESTS = Path(__file__).resolve().parent
TIMING_DEPENDENT = {"async"}


def _train(tmp_path: Path, seed: int, launcher: list[str], algorithms: list[str]) -> list[dict[str, np.ndarray]]:
    seed = int(np.random.default_rng([seed, zlib.crc32(" ".join(launcher + algorithms).encode())]).integers(2**31))
    command = [*launcher, str(TESTS / "lightning_train.py"), str(tmp_path), str(seed), *algorithms]
    # Lightning's launcher starts rank 1 as rank 0's child: a timeout must kill both.
    done = run_group(command, timeout=300, cwd=TESTS.parent)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    initial = {name: p.detach().numpy() for name, p in make_model(seed).named_parameters()}
    return [dict(np.load(tmp_path / f"rank{r}.npz")) | {f"initial/{k}": v for k, v in initial.items()} for r in (0, 1)]


def _run(out: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {key.removeprefix(prefix): value for key, value in out.items() if key.startswith(prefix)}


def _check(ranks: list[dict[str, np.ndarray]], algorithm: str) -> float:
    """The largest difference between the resumed Trainer's parameters and the wrapper's, over both ranks."""
    largest = 0.0
    for out in ranks:
        resumed, reference = _run(out, f"{algorithm}/resumed/"), _run(out, f"{algorithm}/with_bagua/")
        initial = _run(out, "initial/")
        assert resumed.keys() == reference.keys() == initial.keys()
        for name in resumed:
            assert np.abs(resumed[name] - initial[name]).max() > 0, f"{algorithm}: {name} did not train"
            if algorithm not in TIMING_DEPENDENT:
                np.testing.assert_array_equal(resumed[name], reference[name], err_msg=f"{algorithm}: {name}")
            largest = max(largest, float(np.abs(resumed[name] - reference[name]).max()))
    return largest


def test_every_registered_algorithm_has_a_lightning_run():
    assert sorted(OPTIONS) == sorted(CONFIGS) == sorted(available_algorithms())


def test_lightning_launcher_every_algorithm_resumes_to_the_wrappers_bits(tmp_path, seed):
    ranks = _train(tmp_path, seed, [sys.executable], list(OPTIONS))
    for algorithm in OPTIONS:
        largest = _check(ranks, algorithm)
        if algorithm in TIMING_DEPENDENT:
            assert largest < 0.5, f"{algorithm}: the Trainer and the wrapper drifted apart by {largest}"
    for out in ranks:  # without the strategy's "bagua" entry, the residuals and replicas do not come back
        without = _run(out, "bytegrad/resumed_without_bagua_state/")
        assert max(np.abs(without[k] - v).max() for k, v in _run(out, "bytegrad/with_bagua/").items()) > 0


def test_bagua_launch_starts_the_trainer(tmp_path, seed):
    ranks = _train(tmp_path, seed, [sys.executable, "-m", "bagua_launch", "--nproc-per-node", "2"], ["bytegrad"])
    _check(ranks, "bytegrad")

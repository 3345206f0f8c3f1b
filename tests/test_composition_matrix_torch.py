"""The torch cells of the composition matrix that this file asserts, parametrized from tests/composition_matrix.py.

One 2-gloo-rank job (composition_workers_torch) runs every algorithm under each feature and once
plainly; each test takes the algorithms whose cell cites it and asserts the algorithm's property
under its feature: replicas identical where the algorithm promises it, its averaging rounds
counted per optimizer step, and the parameters against the plain run.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
from composition_matrix import MATRIX

pytest.importorskip("torch")

THIS = "tests/test_composition_matrix_torch.py"
IDENTICAL_REPLICAS = ("gradient_allreduce", "bytegrad", "qadam", "onebit_adam", "powersgd", "diloco")
# Distance from the fp32 run under autocast, relative to the distance moved: bf16 rounding of the gradients moves
# the others about 1%, and flips the signs of some small momenta of the Adam family (up to 16% seen in 4 seeds).
AUTOCAST_BOUND = {"qadam": 0.5, "onebit_adam": 0.5}
COUNTED_STEPS = ("decentralized", "low_precision_decentralized", "powersgd", "diloco", "async")


def citing(function: str, feature: str) -> list[str]:
    """The algorithms whose torch cell under ``feature`` is asserted by ``function`` of this file."""
    cited = [a for a, row in MATRIX.items() if getattr(row[feature]["torch"], "test", None) == f"{THIS}::{function}"]
    assert cited, f"no torch cell under {feature} cites {function}"
    return cited


@pytest.fixture(scope="module")
def runs(seed) -> tuple[int, list[dict]]:
    """``(seed, per rank: feature -> algorithm -> run)`` of one job over every cited feature and algorithm."""
    from composition_workers_torch import FEATURES
    from multiprocess import run_ranks

    seed = int(np.random.default_rng([seed, zlib.crc32(__name__.encode())]).integers(2**31))
    algorithms = list(MATRIX)
    results = run_ranks(
        "composition_workers_torch:every_algorithm_under_each_feature", 2, seed, list(FEATURES), algorithms, timeout=300
    )
    return seed, [r.value for r in results]


def largest_difference(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[n] - b[n]))) for n in a)


def distance(a: dict, b: dict) -> float:
    """The Euclidean distance between two sets of parameters (a few sign flips of 1-bit Adam weigh little in it)."""
    return float(np.sqrt(sum(np.sum((a[n].astype(np.float64) - b[n]) ** 2) for n in a)))


def assert_the_algorithms_property(algorithm: str, feature_runs: list[dict]) -> None:
    """Replicas identical where promised (DiLoCo's after each outer step), every step counted once, parameters
    finite."""
    first, second = (runs[algorithm] for runs in feature_runs)
    if algorithm in IDENTICAL_REPLICAS:
        from composition_workers_torch import OPTIONS

        # DiLoCo's replicas meet at its outer steps only.
        every = OPTIONS["diloco"]["sync_every"] if algorithm == "diloco" else 1
        for step, (a, b) in enumerate(zip(first["history"], second["history"])):
            if (step + 1) % every == 0:
                assert largest_difference(a, b) == 0, f"{algorithm}: replicas differ after step {step}"
    if algorithm in COUNTED_STEPS:
        from composition_workers_torch import STEPS

        assert first.get("step", first.get("steps")) == STEPS, (algorithm, first)
    if algorithm == "async":
        assert first["rounds"] >= 1
    for run in (first, second):
        assert all(np.isfinite(v).all() for v in run["history"][-1].values()), algorithm


def initial_params(seed: int) -> dict:
    from gradient_allreduce_bytegrad_workers_torch import make_mlp, params_of

    return params_of(make_mlp(seed))


@pytest.mark.parametrize("algorithm", citing("test_no_sync_accumulation_matches_the_plain_run", "grad_accumulation"))
def test_no_sync_accumulation_matches_the_plain_run(runs, algorithm):
    """Two micro-batches, the first under ``no_sync()``, give the plain run's parameters on every rank and step
    (within float rounding, and a quantization level's worth of it for the compressed algorithms: 2% of the
    distance the parameters moved; counting each micro-batch as a step or dropping one moves them by half)."""
    seed, ranks = runs
    assert_the_algorithms_property(algorithm, [r["accumulation"] for r in ranks])
    start = initial_params(seed)
    for rank in ranks:
        plain, accumulated = rank["plain"][algorithm], rank["accumulation"][algorithm]
        assert accumulated.get("step") == plain.get("step") and accumulated.get("steps") == plain.get("steps")
        if algorithm == "async":
            continue  # its rounds run on a clock: the counted steps above are what is deterministic
        for step, (want, got) in enumerate(zip(plain["history"], accumulated["history"])):
            assert distance(got, want) <= 0.02 * distance(want, start), f"{algorithm}: step {step}"


@pytest.mark.parametrize("algorithm", citing("test_a_group_at_learning_rate_zero_never_moves", "param_groups"))
def test_a_group_at_learning_rate_zero_never_moves(runs, algorithm):
    """Two parameter groups, the first layer at the optimizer's rate and the others at 0: those never move on any
    rank (through the algorithm's communication either), the first layer does."""
    seed, ranks = runs
    assert_the_algorithms_property(algorithm, [r["param_groups"] for r in ranks])
    start = initial_params(seed)
    for rank in ranks:
        final = rank["param_groups"][algorithm]["history"][-1]
        for name, value in final.items():
            moved = float(np.max(np.abs(value - start[name])))
            assert (moved > 0) == name.startswith("0."), f"{algorithm}: {name} moved {moved:.3g}"


@pytest.mark.parametrize("algorithm", citing("test_mixed_precision_bf16_parameters_and_autocast", "mixed_precision"))
def test_mixed_precision_bf16_parameters_and_autocast(runs, algorithm):
    """bf16 parameters, and fp32 parameters with a bf16 autocast forward pass: the algorithm's property holds and
    the parameters move; under autocast they stay near the fp32 run's (:data:`AUTOCAST_BOUND`), but for asynchronous
    averaging, whose rounds average whatever steps the clock catches (20% apart on a loaded machine)."""
    seed, ranks = runs
    start = initial_params(seed)
    for feature in ("bf16_parameters", "autocast"):
        assert_the_algorithms_property(algorithm, [r[feature] for r in ranks])
        for rank in ranks:
            assert largest_difference(rank[feature][algorithm]["history"][-1], start) > 0, (feature, algorithm)
    if algorithm == "async":
        return  # its rounds run on a clock: which steps they average differs between any two runs
    for rank in ranks:
        want = rank["plain"][algorithm]["history"][-1]
        got = rank["autocast"][algorithm]["history"][-1]
        assert distance(got, want) <= AUTOCAST_BOUND.get(algorithm, 0.05) * distance(want, start), algorithm


@pytest.mark.parametrize("algorithm", citing("test_checkpoint_resume_continues_bit_identically", "checkpoint_resume"))
def test_checkpoint_resume_continues_bit_identically(runs, algorithm):
    """Model (with the algorithm's state) and optimizer saved half-way and loaded into a fresh wrap continue
    exactly as the run that went on."""
    _, ranks = runs
    for rank in ranks:
        run = rank["checkpoint"][algorithm]
        for step, (a, b) in enumerate(zip(run["continued"], run["resumed"])):
            for name in a:
                assert a[name].tobytes() == b[name].tobytes(), (algorithm, step, name)


@pytest.mark.parametrize("algorithm", citing("test_autotune_is_refused_naming_the_algorithm", "autotune"))
def test_autotune_is_refused_naming_the_algorithm(runs, algorithm):
    """Re-bucketing between steps would lose the algorithm's per-bucket state: wrapping refuses, naming both."""
    _, ranks = runs
    for rank in ranks:
        message = rank["autotune"][algorithm]["refused"]
        assert message is not None and message.startswith("autotune: ") and algorithm in message, message

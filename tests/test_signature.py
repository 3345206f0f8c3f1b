"""bagua_common.job.signature: stable descriptions, digests, and the cross-rank check's error text.

The ranks are threads here; their allgather is a barrier over a shared list, so the check
runs exactly as over a communicator without starting processes.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from bagua_common.job.signature import (
    JobSignature,
    algorithm_config,
    check_same_job,
    describe_value,
)


@dataclasses.dataclass(frozen=True)
class Config:
    lr: float = 0.1
    hierarchical: bool = False


class Custom:
    """A custom algorithm that is not a dataclass: its repr holds its address."""

    def __init__(self, peers: int, schedule: np.ndarray):
        self.peers = peers
        self.schedule = schedule
        self._cache = object()


def run_check(signatures: list[JobSignature]) -> list[BaseException | None]:
    """Run ``check_same_job`` on one thread per signature; return what each raised."""
    n = len(signatures)
    rows: list = [None] * n
    barrier = threading.Barrier(n, timeout=10)
    errors: list = [None] * n

    def rank(r: int) -> None:
        def allgather(x: np.ndarray) -> np.ndarray:
            rows[r] = x.copy()
            barrier.wait()
            out = np.stack(rows)
            barrier.wait()
            return out

        try:
            check_same_job(signatures[r], allgather)
        except ValueError as error:
            errors[r] = error

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return errors


LEAVES = [("params/w", (3, 4), "float32"), ("params/b", (4,), "float32")]


def test_custom_algorithm_description_is_stable_and_shows_fields():
    schedule = np.arange(6).reshape(2, 3)
    a, b = Custom(2, schedule), Custom(2, schedule.copy())
    assert algorithm_config(a) == algorithm_config(b)  # repr(a) != repr(b): addresses differ
    config = algorithm_config(a, bucket_bytes=1024)
    assert config["algorithm"] == f"{__name__}.Custom"
    assert config["algorithm.peers"] == "2"
    assert "int64[2, 3]" in config["algorithm.schedule"]
    assert "_cache" not in str(config) and "0x" not in str(config)
    assert config["bucket_bytes"] == "1024"
    assert algorithm_config(Custom(2, schedule + 1)) != algorithm_config(a)


def test_dataclass_fields_enums_and_callables():
    assert algorithm_config(Config(lr=0.2)) == {
        "algorithm": f"{__name__}.Config",
        "algorithm.lr": "0.2",
        "algorithm.hierarchical": "False",
    }
    assert describe_value({"b": (1, 2.5), "a": [None, "x"]}) == "{'a': [None, 'x'], 'b': (1, 2.5)}"
    assert describe_value(np.mean) == "numpy.mean"
    assert "0x" not in describe_value(object())


def test_encode_decode_round_trip_and_digest():
    sig = JobSignature.of(LEAVES, algorithm_config(Config()))
    assert JobSignature.decode(sig.encode()) == sig
    assert sig.digest() == JobSignature.of(LEAVES, algorithm_config(Config())).digest()
    assert sig.digest() != JobSignature.of(LEAVES[:1], algorithm_config(Config())).digest()


def test_same_job_passes():
    sig = JobSignature.of(LEAVES, algorithm_config(Config()))
    assert run_check([sig, sig, sig]) == [None, None, None]


def test_differences_are_named_with_their_ranks():
    same = JobSignature.of(LEAVES, algorithm_config(Config()))
    other_shape = JobSignature.of([("params/w", (4, 4), "float32"), LEAVES[1]], algorithm_config(Config()))
    other_lr = JobSignature.of(LEAVES, algorithm_config(Config(lr=0.5)))
    errors = run_check([same, other_shape, same, other_lr])
    assert all(isinstance(e, ValueError) for e in errors)
    assert len({str(e) for e in errors}) == 1, "every rank raises the same error"
    text = str(errors[0])
    assert "tensor 'params/w': [3, 4] float32 on ranks 0, 2, 3; [4, 4] float32 on rank 1" in text
    assert "algorithm.lr: 0.1 on ranks 0, 1, 2; 0.5 on rank 3" in text
    assert "params/b" not in text and "hierarchical" not in text


def test_missing_tensors_other_algorithms_and_order():
    base = JobSignature.of(LEAVES, algorithm_config(Config()))
    extra = JobSignature.of(
        [*LEAVES, ("params/extra", (2,), "bfloat16")],
        algorithm_config(Custom(1, np.zeros(1))),
    )
    text = str(run_check([base, extra])[0])
    assert "tensor 'params/extra': missing on rank 0; [2] bfloat16 on rank 1" in text
    assert f"algorithm: {__name__}.Config on rank 0; {__name__}.Custom on rank 1" in text
    assert "algorithm.peers: missing on rank 0; 1 on rank 1" in text
    swapped = JobSignature.of(LEAVES[::-1], algorithm_config(Config()))
    assert "the same tensors in a different order" in str(run_check([base, swapped])[1])


def test_dtype_difference():
    a = JobSignature.of(LEAVES, {})
    b = JobSignature.of([("params/w", (3, 4), "bfloat16"), LEAVES[1]], {})
    [error, _] = run_check([a, b])
    assert "tensor 'params/w': [3, 4] float32 on rank 0; [3, 4] bfloat16 on rank 1" in str(error)


def test_many_differences_are_counted():
    a = JobSignature.of([(f"w{i}", (1,), "float32") for i in range(12)], {})
    b = JobSignature.of([(f"w{i}", (2,), "float32") for i in range(12)], {})
    text = str(run_check([a, b])[0])
    assert text.count("tensor 'w") == 10 and "and 2 more differences" in text


def test_ranks_with_different_bagua_codecs_fail_the_cross_rank_check():
    # The torch wrapper and the checkpoint manifest describe the algorithm with algorithm_config.
    from bagua_torch.torch_api.algorithms.decentralized import LowPrecisionDecentralizedAlgorithm

    project, bagua = (LowPrecisionDecentralizedAlgorithm(codec=codec) for codec in ("project", "bagua"))
    signatures = [JobSignature.of(LEAVES, algorithm_config(a, bucket_bytes=1024)) for a in (project, bagua)]
    text = str(run_check(signatures)[0])
    assert "algorithm.codec: 'project' on rank 0; 'bagua' on rank 1" in text
    assert "communication_interval" not in text
    assert bagua.replace(communication_interval=2).codec == "bagua"

"""The JAX trainer's cross-rank check: ranks with different models or algorithms get one clear
error before the first step, for the native communicator (MPI) and ``jax.distributed``.

Two ranks run every case of ``tests/cross_rank_check_workers_jax.py`` in one job; rank 1 differs
as the case says. Both ranks must raise the same ``ValueError`` naming the difference and
the ranks, and ranks that agree (including a custom algorithm that is not a dataclass) train.
"""

from __future__ import annotations

import pytest
from multiprocess import ONE_CPU_DEVICE, run_ranks

W, B, HEAD = (
    "['dense']['w']",
    "['dense']['b']",
    "['head']",
)  # jax.tree_util.keystr paths
GAR = "bagua_jax.algorithms.gradient_allreduce.GradientAllReduce"
EXPECTED = {
    "shape": [
        f"tensor {B!r}: [4] float32 on rank 0; [5] float32 on rank 1",
        f"tensor {W!r}: [3, 4] float32 on rank 0; [3, 5] float32 on rank 1",
    ],
    "dtype": [f"tensor {W!r}: [3, 4] float32 on rank 0; [3, 4] bfloat16 on rank 1"],
    "extra_leaf": [f"tensor {HEAD!r}: missing on rank 0; [2] float32 on rank 1"],
    "algorithm": [  # the class, then the fields that differ
        f"algorithm: {GAR} on rank 0; bagua_jax.algorithms.bytegrad.ByteGrad on rank 1",
        "algorithm.hierarchical: False on rank 0; True on rank 1",
        "algorithm.error_feedback: missing on rank 0; False on rank 1",
    ],
    "field": ["algorithm.average: True on rank 0; False on rank 1"],
    "custom_field": ["algorithm.scale: 1.0 on rank 0; 2.0 on rank 1"],
}
AGREE = ("same", "custom_same")
MODES = {
    "native": {"launcher": "mpiexec"},
    "mesh": {"env": ONE_CPU_DEVICE},
}


@pytest.mark.parametrize("mode", MODES)
def test_ranks_that_differ_get_one_clear_error(mode):
    results = run_ranks("cross_rank_check_workers_jax:check_cases", 2, mode, timeout=300, **MODES[mode])
    first, second = results[0].value, results[1].value
    for case, lines in EXPECTED.items():
        assert first[case] == second[case], f"{case}: the ranks raised different errors"
        assert first[case].startswith("the ranks do not run the same job"), first[case]
        listed = first[case].splitlines()[1:]
        assert sorted(line.strip() for line in listed) == sorted(lines), first[case]
    for case in AGREE:
        assert first[case].startswith("ok ") and first[case] == second[case], (
            case,
            first[case],
        )

"""Bucket-size autotuning of a wrapped torch model: same switches on every rank, bit-identical results."""

from __future__ import annotations

import numpy as np


def test_ranks_switch_together_and_tuning_leaves_gradient_allreduce_bit_identical(tmp_path):
    """Two gloo ranks (rank 1 slowed at random): tuning re-buckets the model several times, at the same
    steps on both ranks, and the parameters end bit-identical to the untuned run's (a 2-rank sum is
    exact whatever the layout). A second run with ``cached`` starts at the stored choice."""
    from autotune_workers_torch import STEPS
    from multiprocess import run_ranks

    ranks = run_ranks("autotune_workers_torch:tuned_against_plain", 2, str(tmp_path / "autotune.json"), timeout=180)
    tuned = [r.value["once"] for r in ranks]
    np.testing.assert_array_equal(tuned[0]["sizes"], tuned[1]["sizes"])
    assert tuned[0]["finished"] and len(set(tuned[0]["sizes"].tolist())) >= 3, tuned[0]["sizes"]
    chosen = int(tuned[0]["sizes"][-1])
    for result in ranks:
        plain, once = result.value["off"], result.value["once"]
        assert set(plain["sizes"].tolist()) == {10 * 2**20}
        for name, value in plain["params"].items():
            assert value.tobytes() == once["params"][name].tobytes(), name
        cached = result.value["cached"]
        assert cached["finished"] and set(cached["sizes"].tolist()) == {chosen}
        assert "bytegrad's numbers depend on its bucket layout" in result.value["bytegrad"]
    assert len(tuned[0]["sizes"]) == STEPS

"""Bucket-size autotuning of a wrapped torch model: same switches on every rank, bit-identical results."""

from __future__ import annotations

import numpy as np
import pytest


def test_ranks_switch_together_and_tuning_leaves_gradient_allreduce_bit_identical(tmp_path, seed):
    """Two gloo ranks (rank 1 slowed at random): tuning re-buckets the model several times, at the same
    steps on both ranks, and the parameters end bit-identical to the untuned run's (a 2-rank sum is
    exact whatever the layout). A second run with ``cached`` starts at the stored choice."""
    from autotune_workers_torch import STEPS
    from multiprocess import run_ranks

    ranks = run_ranks(
        "autotune_workers_torch:tuned_against_plain", 2, seed, str(tmp_path / "autotune.json"), timeout=300
    )
    tuned = [r.value["once"] for r in ranks]
    np.testing.assert_array_equal(tuned[0]["sizes"], tuned[1]["sizes"])
    assert tuned[0]["finished"] and len(set(tuned[0]["sizes"].tolist())) == 2, tuned[0]["sizes"]
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


@pytest.mark.parametrize("between_nodes", [False, True], ids=["one-node", "between-nodes"])
def test_hierarchical_and_ring_threshold_switch_on_every_rank_at_the_same_step(tmp_path, seed, between_nodes):
    """Four native MPI ranks as two nodes of two (``LOCAL_WORLD_SIZE=2``; rank 3 slowed at random): the tuner
    switches ``hierarchical`` (and the bucket size) at the same steps on every rank; world, intra and inter keep
    one ring threshold.

    On one node the ring threshold has no effect and is not searched, and the parameters end bit-identical to
    the untuned run's: MPICH's allreduce of four ranks adds ranks 0+1 and 2+3 first, as the two levels do, and
    the averages divide by powers of two, exactly. With MPICH's MPIR_CVAR_NOLOCAL=1 each process is its own
    node, so the ring threshold is searched too (as is, 0, never), and the ring adds the four ranks in another
    order: an average can differ in its last bit, and 200 steps carry that forward. Measured: at most 7.5e-8
    apart on parameters up to 0.26 (a few float32 ulps); the bound, 1e-6 absolute, is 13 times that.
    """
    from multiprocess import run_ranks

    steps = 200 if between_nodes else 60  # the search over 1 x 2 (x 3) settings takes 36 (171) steps
    ranks = run_ranks(
        "autotune_workers_torch:knobs_on_two_levels",
        4,
        seed,
        str(tmp_path / "autotune.json"),
        steps,
        launcher="mpiexec",
        timeout=300,
        env={"LOCAL_WORLD_SIZE": "2", **({"MPIR_CVAR_NOLOCAL": "1"} if between_nodes else {})},
    )
    tuned = [r.value["once"] for r in ranks]
    for other in tuned[1:]:
        np.testing.assert_array_equal(other["settings"], tuned[0]["settings"])
    settings = tuned[0]["settings"]
    assert tuned[0]["finished"]
    hierarchical, has_levels, rings = settings[:, 1], settings[:, 2], settings[:, 3:]
    np.testing.assert_array_equal(hierarchical, has_levels)  # the flag took effect: two levels exactly when set
    assert set(hierarchical.tolist()) == {0, 1}, settings
    assert (rings == rings[:, :1]).all()  # world, intra and inter switch together
    assert len(set(rings[:, 0].tolist())) == (3 if between_nodes else 1), settings
    for result in ranks:
        plain, once = result.value["off"], result.value["once"]
        assert (plain["settings"][:, 1:] == [0, 0, 2**20, 2**20, 2**20]).all()
        for name, value in plain["params"].items():
            if between_nodes:
                np.testing.assert_allclose(once["params"][name], value, rtol=0, atol=1e-6, err_msg=name)
            else:
                assert once["params"][name].tobytes() == value.tobytes(), name

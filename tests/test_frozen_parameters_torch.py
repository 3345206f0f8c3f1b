"""Frozen parameters (``requires_grad=False``) and parameters the loss never uses stay exactly unchanged under every
torch algorithm.

Two gloo ranks; each algorithm wraps an MLP whose first layer is frozen, with a parameter its forward
never uses, and trains six steps on different data per rank (QAdam and 1-bit Adam past a two-step
warm-up, async with averaging rounds running). The frozen layer and the unused parameter must not
move at all on any rank (1-bit Adam holds the unused one's momentum at zero, since its sign codes
cannot send one); the others must.
"""

from __future__ import annotations

from multiprocess import run_ranks


def test_frozen_parameters_never_move(seed):
    results = run_ranks("frozen_parameters_workers_torch:frozen_first_layer", 2, seed, timeout=300)
    assert len(results[0].value) >= 7, results[0].value  # every built-in algorithm ran
    for result in results:
        for name, moved in result.value.items():
            assert moved["frozen"] == 0, f"rank {result.rank}, {name}: frozen layer moved {moved['frozen']:.3g}"
            assert moved["unused"] == 0, f"rank {result.rank}, {name}: unused parameter moved {moved['unused']:.3g}"
            assert moved["trained"] > 0, f"rank {result.rank}, {name}: the trained layers did not move"

"""bagua_common.comm.topology and bagua_common.algorithms.option_checks, without processes.

The ``shift_one`` table is judged on the properties the pairing promises (a perfect matching
every round, symmetric, each rank meeting the whole other half once per cycle) and on a
plain-Python evaluation of the SPEC formula; the front ends' ``shift_one_peer`` must read it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from bagua_common.algorithms.option_checks import (
    check_communication_interval,
    check_sync_interval_ms,
    check_warmup_steps,
)
from bagua_common.comm.topology import (
    check_pairable,
    check_peer_selection_mode,
    check_two_levels,
    ring_neighbours,
    shift_one_schedule,
)


def spec_peer(rank: int, round_index: int, size: int) -> int:
    half = size // 2
    if rank < half:
        return (round_index + rank) % half + half
    return (rank - half - round_index) % half


@pytest.mark.parametrize("size", [2, 4, 6, 8, 16])
def test_shift_one_schedule_is_a_symmetric_matching_meeting_the_other_half(size):
    table = shift_one_schedule(size)
    half = size // 2
    assert table.shape == (half, size) and table.dtype == np.int32
    for t, row in enumerate(table):
        assert sorted(row.tolist()) == list(range(size))
        for rank in range(size):
            assert row[row[rank]] == rank and row[rank] != rank
            assert row[rank] == spec_peer(rank, t, size)
    for rank in range(half):
        assert sorted(table[:, rank].tolist()) == list(range(half, size))


@pytest.mark.parametrize("size", [0, 1, 3, 5, True, 2.0])
def test_shift_one_schedule_rejects_sizes_it_cannot_pair(size):
    with pytest.raises(ValueError, match=r"at least 2 ranks|even number of them"):
        shift_one_schedule(size)


def test_pairable_names_the_group_and_the_way_out():
    check_pairable(1, "decentralized")
    check_pairable(4, "decentralized", across_nodes=True)
    with pytest.raises(ValueError, match="decentralized: .* pairs ranks .* got 3; .* or an even count$"):
        check_pairable(3, "decentralized")
    with pytest.raises(ValueError, match="pairs nodes .* got 3; .* or hierarchical=False$"):
        check_pairable(3, "decentralized", across_nodes=True)


def test_front_ends_read_the_same_table():
    jax_decentralized = pytest.importorskip("bagua_jax.algorithms.decentralized")
    torch_decentralized = pytest.importorskip("bagua_torch.algorithms.decentralized")
    size = 6
    for t in range(7):
        ranks = np.arange(size, dtype=np.int32)
        jax_peers = np.asarray(jax_decentralized.shift_one_peer(ranks, np.int32(t), size))
        torch_peers = [torch_decentralized.shift_one_peer(r, t, size) for r in range(size)]
        expected = [spec_peer(r, t % (size // 2), size) for r in range(size)]
        assert jax_peers.tolist() == torch_peers == expected


def test_ring_neighbours_and_two_levels():
    assert [ring_neighbours(r, 4) for r in range(4)] == [(3, 1), (0, 2), (1, 3), (2, 0)]
    assert ring_neighbours(0, 2) == (1, 1)
    with pytest.raises(ValueError, match="rank 4 is not in 0..3"):
        ring_neighbours(4, 4)
    check_two_levels(2, 3, 6, "bytegrad")
    with pytest.raises(ValueError, match=r"bytegrad: intra \(2 ranks\) x inter \(2 ranks\) must equal world"):
        check_two_levels(2, 2, 6, "bytegrad")
    check_peer_selection_mode("shift_one", "decentralized")
    with pytest.raises(ValueError, match="decentralized: peer_selection_mode must be one of .*'ring'"):
        check_peer_selection_mode("ring", "decentralized")


@pytest.mark.parametrize("bad", [0, -1, 1.0, True, "2", None])
def test_communication_interval_accepts_positive_ints_only(bad):
    assert check_communication_interval(np.int64(3), "decentralized") == 3
    with pytest.raises(ValueError, match=f"decentralized: communication_interval .* got {bad!r}"):
        check_communication_interval(bad, "decentralized")


@pytest.mark.parametrize("bad", [-1, math.nan, math.inf, True, "10", None])
def test_sync_interval_and_warmup(bad):
    assert check_sync_interval_ms(np.float32(2.5), "async") == 2.5
    assert check_sync_interval_ms(0, "async") == 0.0
    with pytest.raises(ValueError, match="async: sync_interval_ms must be a finite number"):
        check_sync_interval_ms(bad, "async")
    assert check_warmup_steps(np.int32(0), "async") == 0
    with pytest.raises(ValueError, match="async: warmup_steps must be a non-negative int"):
        check_warmup_steps(bad if bad != math.inf else -3, "async")

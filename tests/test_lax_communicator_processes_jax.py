"""LaxCommunicator across real processes: jax.distributed with gloo CPU collectives.

Each rank is one process with one CPU device (see tests/lax_communicator_workers_jax.py). The
dead-peer tests document what JAX 0.10.2 itself offers when a peer fails:

* a peer that exits once the gloo connections exist: the survivors' next
  collective raises ``JaxRuntimeError: Gloo all-reduce failed: ... Connection
  closed by peer`` (or ``Connection reset by peer``) at once, with no setting;
* a peer that exits before the first collective (gloo has not connected yet):
  the coordination service misses its heartbeats for
  ``heartbeat_timeout_seconds`` (an argument of ``jax.distributed.initialize``)
  and terminates every survivor (SIGABRT, "Terminating process because the JAX
  distributed service detected fatal errors"); without that, the gloo context
  set-up raises ``DEADLINE_EXCEEDED`` after a fixed 30 s;
* a peer that stays alive but never joins: only the XLA flag
  ``--xla_cpu_collective_timeout_seconds`` (default 1800 s) bounds the wait; the
  survivors then raise ``Gloo all-reduce failed: ... Timed out waiting ...ms``.
"""

from __future__ import annotations

import re
import time

import ml_dtypes
import numpy as np
import pytest
from lax_communicator_workers_jax import (
    alltoall_v_counts,
    pairing_schedule,
    rank_inputs,
    ring_peers,
)
from multiprocess import ONE_CPU_DEVICE, RankResult, run_ranks

BF16 = np.dtype(ml_dtypes.bfloat16)


def assert_reduced(got: np.ndarray, xs: np.ndarray, op: str) -> None:
    """``got`` against the NumPy reduction of ``xs`` over its leading axis (any summation order)."""
    n = xs.shape[0]
    assert got.dtype == xs.dtype
    if op in ("min", "max") or xs.dtype.kind in "iu":
        expected = {"min": xs.min(0), "max": xs.max(0)}.get(op, xs.sum(0, dtype=xs.dtype))
        np.testing.assert_array_equal(got, expected)
        return
    wide = xs.astype(np.float64)
    divisor = n if op == "avg" else 1
    eps = 2.0**-7 if xs.dtype == BF16 else float(np.finfo(np.float32).eps)
    bound = n * eps * np.abs(wide).sum(0) / divisor + 1e-30
    assert np.all(np.abs(got.astype(np.float64) - wide.sum(0) / divisor) <= bound)


def alltoall_v_expected(vs: np.ndarray, counts: np.ndarray, rank: int, out_size: int) -> np.ndarray:
    out = np.zeros(out_size, vs.dtype)
    packed = np.concatenate([vs[j, counts[j, :rank].sum() :][: counts[j, rank]] for j in range(len(vs))])
    out[: packed.size] = packed
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_collectives_across_processes(world, rng):
    seed, root = int(rng.integers(2**31)), world - 1
    results = run_ranks("lax_communicator_workers_jax:collectives", world, seed, root, timeout=300, env=ONE_CPU_DEVICE)
    inputs = [rank_inputs(seed, r, world) for r in range(world)]
    f, b, i, v = (np.stack([d[k] for d in inputs]) for k in ("f32", "bf16", "i32", "v"))
    counts = alltoall_v_counts(seed, world, v.shape[1])
    for rank, res in enumerate(r.value for r in results):
        assert int(res["rank"]) == rank
        for op in ("sum", "avg", "min", "max"):
            assert_reduced(res[f"allreduce_{op}"], f, op)
        assert_reduced(res["allreduce_bf16_sum"], b, "sum")
        assert_reduced(res["allreduce_i32_sum"], i, "sum")
        if rank == root:
            assert_reduced(res["reduce_max"], f, "max")
            assert res["gather"].tobytes() == i.tobytes()
        else:
            np.testing.assert_array_equal(res["reduce_max"], 0)
            np.testing.assert_array_equal(res["gather"], 0)
        assert res["broadcast"].tobytes() == f[root].tobytes()
        assert res["broadcast_bf16"].tobytes() == b[root].tobytes()
        assert_reduced(res["reduce_scatter_sum"], f[:, rank], "sum")
        assert_reduced(res["reduce_scatter_min"], f[:, rank], "min")
        assert res["allgather"].tobytes() == v.tobytes()
        np.testing.assert_array_equal(res["scatter"], i[root, rank])
        np.testing.assert_array_equal(res["alltoall"], i[:, rank])
        np.testing.assert_array_equal(res["alltoall_v"], alltoall_v_expected(v, counts, rank, 2 * v.shape[1]))
        np.testing.assert_array_equal(res["send_recv"], v[ring_peers(rank, world)])
        np.testing.assert_array_equal(res["send_recv_scheduled"], v[pairing_schedule(world)[seed % 2, rank]])
        assert res["barrier"].tobytes() == v[rank].tobytes()
    # Bit-identical on every rank wherever every rank receives the same value.
    same = [k for k in results[0].value if k.startswith(("allreduce", "broadcast", "allgather"))]
    for key in same:
        for other in results[1:]:
            assert other.value[key].tobytes() == results[0].value[key].tobytes(), key


JAX_TERMINATED = "Terminating process because the JAX distributed service detected fatal errors"
NAMES_THE_FAILURE = re.compile(
    r"Gloo .* failed|Connection (closed|reset) by peer|Timed out|DEADLINE_EXCEEDED|UNAVAILABLE"
)


def outcome(result: RankResult) -> str:
    """How a survivor ended: 'raised' (a Python exception naming the failure) or 'terminated'
    (killed by JAX's own failure detection); anything else fails the test."""
    value = result.value
    if isinstance(value, dict) and value.get("raised"):
        assert NAMES_THE_FAILURE.search(value["message"]), value["message"]
        return "raised"
    if result.returncode not in (0, None) and JAX_TERMINATED in result.output:
        return "terminated"
    pytest.fail(
        f"rank {result.rank} neither raised nor was terminated by JAX "
        f"({'killed at the timeout' if result.returncode is None else f'exit {result.returncode}'}):\n"
        f"{result.output[-3000:]}"
    )


# (world, victim, warm-up collective first, heartbeat_timeout_seconds, hang_seconds, XLA_FLAGS,
#  what every survivor must do or None for either, bound in seconds on the whole run)
DEAD_PEER_CASES = {
    "exits-after-first-collective": (2, 1, True, 100, 0, "", "raised", 30),
    "exits-before-first-collective": (4, 2, False, 3, 0, "", None, 30),
    "coordinator-exits": (2, 0, True, 100, 0, "", None, 30),
    "hangs-alive": (2, 1, True, 100, 60, "--xla_cpu_collective_timeout_seconds=3", "raised", 30),
}


@pytest.mark.parametrize("case", DEAD_PEER_CASES)
def test_a_dead_peer_fails_the_survivors_within_a_bound(case):
    world, victim, warmup, heartbeat, hang, flags, expected, bound = DEAD_PEER_CASES[case]
    start = time.monotonic()
    results = run_ranks(
        "lax_communicator_workers_jax:dead_peer",
        world,
        victim,
        warmup,
        heartbeat,
        hang,
        timeout=bound,
        check=False,
        env={**ONE_CPU_DEVICE, "XLA_FLAGS": flags},
    )
    elapsed = time.monotonic() - start
    survivors = [r for r in results if r.rank != victim]
    outcomes = {r.rank: outcome(r) for r in survivors}
    assert elapsed < bound, f"took {elapsed:.1f}s"
    if expected is not None:
        assert set(outcomes.values()) == {expected}, outcomes
    if case == "exits-before-first-collective":
        # The coordinator (rank 0) saw the victim's heartbeats stop.
        assert "stopped sending heartbeats" in results[0].output or any(v == "raised" for v in outcomes.values())
    if case == "hangs-alive":
        assert all("Timed out waiting 3000ms" in r.value["message"] for r in survivors)
    if expected == "raised":
        assert all(r.value["elapsed"] < bound for r in survivors)

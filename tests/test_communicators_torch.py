"""The bagua_torch communicators on 2 and 4 processes, against NumPy.

``gloo``: ProcessGroupCommunicator over torch.distributed (python launcher).
``mpi``: NativeCommunicator over the MPI engine through DLPack (mpiexec).
Each configuration runs every primitive, sync and async, in one multi-process job;
the tests below check different aspects of that one run.
"""

from __future__ import annotations

import numpy as np
import pytest
from communicators_workers_torch import EXTRA_DTYPES, OPS, rank_data
from multiprocess import run_ranks
from scenarios import has_mpi

import bagua_torch

ENGINES = {
    "gloo": {"launcher": "python", "skip": None},
    "mpi": {
        "launcher": "mpiexec",
        "skip": None if has_mpi(bagua_torch.build_info()) else "built without the MPI engine, or no mpiexec",
    },
}
CONFIGS = [(engine, size) for engine in ENGINES for size in (2, 4)]

_REDUCE = {"sum": np.sum, "avg": np.mean, "min": np.min, "max": np.max}
_EXACT = {"min", "max"}


def _skip(engine: str) -> None:
    if ENGINES[engine]["skip"]:
        pytest.skip(ENGINES[engine]["skip"])


@pytest.fixture(scope="module", params=CONFIGS, ids=[f"{e}-{n}ranks" for e, n in CONFIGS])
def run(request, seed):
    """One job per (engine, size): each rank's results, with the seed its data came from."""
    engine, size = request.param
    _skip(engine)
    results = run_ranks(
        "communicators_workers_torch:every_primitive",
        size,
        engine,
        seed,
        launcher=ENGINES[engine]["launcher"],
        timeout=300,
    )
    values = sorted((r.value for r in results), key=lambda v: v["rank"])
    return engine, size, seed, values


def _check(actual, expected, op: str = "sum", parts=None, rtol: float = 1e-5):
    """Exact for min/max and data movement; sums and averages to float tolerance."""
    assert actual is not None
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if op in _EXACT or parts is None:
        np.testing.assert_array_equal(actual, expected)
    else:
        scale = float(np.abs(parts).max()) if parts.size else 0.0
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=rtol * scale * parts.shape[0])


def test_every_primitive_matches_numpy(run):
    engine, size, seed, values = run
    xs = np.stack([rank_data(seed, r, "x") for r in range(size)])
    rows = np.stack([rank_data(seed, r, "rows", (size, 4)) for r in range(size)])
    sent = xs + 1000 * np.arange(size, dtype=np.float32)[:, None, None]
    for res in values:
        rank = res["rank"]
        assert (res["comm_rank"], res["comm_size"]) == (rank, size)
        assert res["protocol"] is True
        for suffix in ("", "/async"):
            get = lambda key: res[key + suffix]  # noqa: E731
            for op in OPS:
                _check(get(f"allreduce_{op}"), _REDUCE[op](xs, 0), op, xs)
                expected = _REDUCE[op](xs, 0) if rank == size - 1 else np.zeros_like(xs[0])
                _check(get(f"reduce_{op}"), expected, op, xs)
                _check(get(f"reduce_scatter_{op}"), _REDUCE[op](rows[:, rank], 0), op, rows[:, rank])
            _check(get("broadcast"), xs[1])
            _check(get("allgather"), xs)
            _check(get("gather"), xs if rank == 1 else np.zeros_like(xs))
            _check(get("scatter"), rows[size - 1, rank])
            _check(get("alltoall"), rows[:, rank])
            expected_v = np.zeros(size * size + 3, np.float32)
            expected_v[: size * (size + 1) // 2] = np.concatenate(
                [
                    np.arange(size * (j + 1), dtype=np.float32)[rank * (j + 1) : (rank + 1) * (j + 1)] + 100 * j
                    for j in range(size)
                ]
            )
            _check(get("alltoall_v"), expected_v)
            _check(get("send_recv"), sent[[(rank + 1) % size, (rank - 1) % size] * 2])
            assert get("barrier") is None
        _check(res["noncontiguous"], rows.transpose(0, 2, 1).sum(0), "sum", rows.transpose(0, 2, 1))


@pytest.mark.parametrize("dtype", EXTRA_DTYPES)
def test_every_dtype(run, dtype):
    engine, size, seed, values = run
    data = np.stack([rank_data(seed, r, dtype, (7,), dtype) for r in range(size)])
    rtol = {"float64": 1e-12, "float16": 4e-3, "bfloat16": 3e-2}.get(dtype, 0)
    for res in values:
        assert res[f"{dtype}/dtype"] == f"torch.{dtype}"
        if rtol:
            _check(
                res[f"{dtype}/sum"],
                data.sum(0, dtype=np.float64).astype(np.float32) if dtype != "float64" else data.sum(0),
                "sum",
                data,
                rtol,
            )
        else:
            np.testing.assert_array_equal(res[f"{dtype}/sum"], data.sum(0, dtype=data.dtype))
        np.testing.assert_array_equal(res[f"{dtype}/max"], data.max(0))
        np.testing.assert_array_equal(res[f"{dtype}/min"], data.min(0))
        np.testing.assert_array_equal(res[f"{dtype}/broadcast"], data[0])
        np.testing.assert_array_equal(res[f"{dtype}/allgather"], data)


def test_results_are_bit_identical_across_ranks(run):
    engine, size, seed, values = run
    shared = [
        f"{name}{suffix}"
        for name in ("broadcast", "allgather", *[f"allreduce_{op}" for op in OPS])
        for suffix in ("", "/async")
    ]
    shared += [f"{d}/{k}" for d in EXTRA_DTYPES for k in ("sum", "max", "min", "broadcast", "allgather")]
    shared += ["overlap/a", "overlap/b", "overlap/broadcast", "noncontiguous"]
    for key in shared:
        first = values[0][key]
        for other in values[1:]:
            assert first.dtype == other[key].dtype and first.tobytes() == other[key].tobytes(), key


def test_async_collectives_overlap_and_complete_in_issue_order(run):
    engine, size, seed, values = run
    a = np.stack([rank_data(seed, r, "overlap_a", (1000,)) for r in range(size)])
    b = np.stack([rank_data(seed, r, "overlap_b", (1000,)) for r in range(size)])
    for res in values:
        _check(res["overlap/a"], a.sum(0), "sum", a)
        _check(res["overlap/b"], b.max(0), "max")
        _check(res["overlap/broadcast"], a[0])
        np.testing.assert_array_equal(res["overlap/again"], res["overlap/a"])
        assert res["overlap/completed"] is True
        assert res["input_untouched"] is True


def test_sub_communicators(run):
    engine, size, seed, values = run
    xs = np.stack([rank_data(seed, r, "x") for r in range(size)])
    rows = np.stack([rank_data(seed, r, "rows", (size, 4)) for r in range(size)])
    for res in values:
        rank = res["rank"]
        members = [r for r in range(size) if r % 2 == rank % 2]
        if engine == "mpi":
            members = members[::-1]  # split with key = -rank
        n, me = len(members), members.index(rank)
        assert (res["sub/rank"], res["sub/size"]) == (me, n)
        _check(res["sub/allgather"], xs[members])
        _check(res["sub/broadcast"], xs[members[-1]])
        _check(res["sub/gather"], xs[members] if me == 0 else np.zeros_like(xs[members]))
        expected = xs[members].sum(0) if me == n - 1 else np.zeros_like(xs[0])
        _check(res["sub/reduce"], expected, "sum", xs[members])
        if n > 1:
            _check(res["sub/send_recv"], xs[[members[(me + 1) % n]]])
        if engine == "gloo":
            _check(res["fallback/reduce_scatter_sum"], rows[:, rank].sum(0), "sum", rows[:, rank])
            _check(res["fallback/reduce_scatter_avg"], rows[:, rank].mean(0), "avg", rows[:, rank])


def test_a_job_on_the_native_thread_issues_its_collectives_inline(run):
    """The pipelines' collectives cross one thread: issued from a job of the thread that issues them, they run
    there at once (a second hop onto the same thread would wait behind the job forever)."""
    engine, size, seed, values = run
    if engine != "mpi":
        pytest.skip("torch.distributed issues from any thread; only native communicators have one")
    xs = np.stack([rank_data(seed, r, "x") for r in range(size)])
    for res in values:
        _check(res["thread/sum"], xs.sum(0), "sum", xs)
        _check(res["thread/max"], xs.max(0), "max")
        _check(res["thread/min"], xs.min(0), "min")
        assert res["thread/queued"] == ["world", "own"]
        assert res["thread/shared"] and res["thread/own"]


# What each refused request (communicators_workers_torch._errors) raises: by exception type, the
# words its message holds.
ERRORS = {
    "TypeError": {"dtype": "int16", "not_tensor": "torch.Tensor", "avg_int": "avg"},
    "ValueError": {
        "op": "prod",
        "root": "root",
        "negative_root": "root -1",
        "rows": "shape",
        "scalar_rows": "shape",
        "counts_length": "one entry per rank",
        "counts_exceed": "x has only",
        "out_size": "out_size",
        "self_peer": "peer",
        "bad_peer": "peer",
    },
}


def test_odd_requests_raise_clear_errors(run):
    engine, size, seed, values = run
    for res in values:
        for kind, cases in ERRORS.items():
            for case, words in cases.items():
                message = res["errors"][case]
                assert message.startswith(kind + ":") and words in message, (case, message)


@pytest.mark.parametrize("mode", ["die", "stall"])
@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_dead_or_stalled_peer_raises_within_the_timeout(engine, mode):
    _skip(engine)
    timeout = 2.0
    results = run_ranks(
        "communicators_workers_torch:dead_or_stalled_peer",
        2,
        engine,
        mode,
        timeout,
        launcher=ENGINES[engine]["launcher"],
        timeout=300,
        check=False,
    )
    survivor = results[0]
    assert survivor.value is not None, survivor.output
    message = survivor.value["error"]
    assert message.startswith("CommunicationError:"), message
    assert "allreduce" in message and "'world'" in message and "rank 0 of 2" in message, message
    assert survivor.value["elapsed"] < timeout + 10, survivor.value
    if engine == "mpi":
        assert f"did not complete within {timeout:g}" in message, message


# --- in-process checks (no peers needed) -------------------------------------------


def test_default_timeout_reads_the_environment(monkeypatch):
    from bagua_common.comm.timeout import DEFAULT_TIMEOUT_SECONDS, default_timeout

    monkeypatch.delenv("BAGUA_COMM_TIMEOUT", raising=False)
    assert default_timeout() == DEFAULT_TIMEOUT_SECONDS == 300
    monkeypatch.setenv("BAGUA_COMM_TIMEOUT", "7.5")
    assert default_timeout() == 7.5
    for bad in ("soon", "0", "-3", "inf", "nan"):
        monkeypatch.setenv("BAGUA_COMM_TIMEOUT", bad)
        with pytest.raises(ValueError, match="BAGUA_COMM_TIMEOUT"):
            default_timeout()


def test_process_group_communicator_needs_torch_distributed():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("torch.distributed is initialized in this process")
    with pytest.raises(RuntimeError, match="init_process_group"):
        bagua_torch.ProcessGroupCommunicator()


def test_the_nccl_unique_id_travels_through_a_torch_store():
    """Rank 0 puts the id in the store, the others read it; a missing leader times out."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist
    from multiprocess import free_port

    from bagua_torch.communicator import CommunicationError, NativeCommunicator

    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=10), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=10))
    fake_nccl = SimpleNamespace(unique_id=lambda: b"\x00id\xff" * 32)
    sent = NativeCommunicator._share_unique_id(master, "bagua/test/id", True, fake_nccl, 5.0)
    received = NativeCommunicator._share_unique_id(client, "bagua/test/id", False, fake_nccl, 5.0)
    assert sent == received == b"\x00id\xff" * 32
    with pytest.raises(CommunicationError, match="did not arrive within 0.5"):
        NativeCommunicator._share_unique_id(client, "bagua/test/nobody", False, fake_nccl, 0.5)

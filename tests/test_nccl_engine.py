"""The NCCL engine on one rank, through the DLPack bindings (torch) and the XLA FFI
(jax), plus its timeouts; needs a GPU.

On one rank every collective moves a rank's data to itself, so the expectations
are the inputs laid out as each operation specifies. The timeout tests run in a
subprocess, so that a hang fails the test instead of the whole run.
"""

import importlib
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import random_values

pytestmark = pytest.mark.gpu

SUM, AVG, MIN, MAX = 0, 1, 2, 3
DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8"]
FLOATS = DTYPES[:4]


@pytest.fixture(scope="module")
def torch():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device visible to torch")
    return torch


@pytest.fixture(scope="module")
def nccl():
    """The engine module; request it only once a GPU is known to be there."""
    import _bagua_ffi

    assert _bagua_ffi.build_info()["nccl"], "a GPU is present but bagua was built without the NCCL engine"
    return importlib.import_module("_bagua_nccl")


@pytest.fixture(scope="module")
def world(torch, nccl):
    handle = nccl.create(nccl.unique_id(), 0, 1, "world", 30.0)
    yield handle
    assert nccl.destroy(handle)


def _stream(torch):
    return torch.cuda.current_stream().cuda_stream


def _tensor(torch, rng, dtype: str, n: int):
    """A CUDA tensor of ``dtype`` with random values, and the same values in NumPy."""
    values = random_values(rng, n) if dtype in FLOATS else rng.integers(0, 100, n)
    t = torch.from_numpy(values).to(getattr(torch, dtype))
    return t.cuda(), _numpy(t)


def _numpy(t):
    t = t.cpu()
    return t.float().numpy() if t.is_floating_point() and t.element_size() == 2 else t.numpy()


def _filled(torch, like, n: int, value: int = 7):
    return torch.full((n,), value, dtype=like.dtype, device="cuda")


@pytest.mark.parametrize("in_place", [False, True], ids=["out_of_place", "in_place"])
@pytest.mark.parametrize(
    ("dtype", "op"),
    [(d, op) for d in DTYPES for op in (SUM, AVG, MIN, MAX) if op != AVG or d in FLOATS],
    ids=lambda v: v if isinstance(v, str) else ["sum", "avg", "min", "max"][v],
)
def test_allreduce_on_one_rank_is_the_identity(torch, nccl, world, rng, dtype, op, in_place):
    x, expected = _tensor(torch, rng, dtype, 10_007)
    out = x if in_place else _filled(torch, x, x.numel())
    nccl.allreduce(world, x, out, op, _stream(torch))
    np.testing.assert_array_equal(_numpy(out), expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int64", "uint8"])
def test_every_collective_on_one_rank(torch, nccl, world, rng, dtype):
    n, s = 4_099, _stream(torch)
    x, expected = _tensor(torch, rng, dtype, n)

    out = _filled(torch, x, n)
    nccl.reduce(world, x, out, MAX, 0, s)
    np.testing.assert_array_equal(_numpy(out), expected)

    buffer = x.clone()
    nccl.broadcast(world, buffer, 0, s)
    np.testing.assert_array_equal(_numpy(buffer), expected)

    for name in ("reduce_scatter", "allgather", "alltoall"):
        out = _filled(torch, x, n)
        if name == "reduce_scatter":
            nccl.reduce_scatter(world, x, out, SUM, s)
        else:
            getattr(nccl, name)(world, x, out, s)
        np.testing.assert_array_equal(_numpy(out), expected, err_msg=name)

    for name in ("gather", "scatter"):
        out = _filled(torch, x, n)
        getattr(nccl, name)(world, x, out, 0, s)
        np.testing.assert_array_equal(_numpy(out), expected, err_msg=name)


def test_alltoall_v_moves_the_counted_prefix(torch, nccl, world, rng):
    x, values = _tensor(torch, rng, "float32", 7)
    out = _filled(torch, x, 6, -1)
    nccl.alltoall_v(world, x, [5], out, [5], _stream(torch))
    np.testing.assert_array_equal(_numpy(out), np.concatenate([values[:5], [-1]]))

    nothing = _filled(torch, x, 6, -1)
    nccl.alltoall_v(world, x, [0], nothing, [0], _stream(torch))
    np.testing.assert_array_equal(_numpy(nothing), np.full(6, -1, np.float32))


@pytest.mark.parametrize("peers", [[0], [0, 0, 0]], ids=["once", "three_times"])
def test_send_recv_to_self(torch, nccl, world, rng, peers):
    x, values = _tensor(torch, rng, "bfloat16", 1_001)
    out = _filled(torch, x, x.numel() * len(peers))
    nccl.send_recv(world, x, out, peers, _stream(torch))
    np.testing.assert_array_equal(_numpy(out), np.tile(values, len(peers)))


def test_many_calls_without_a_host_synchronization(torch, nccl, world, rng):
    """Hundreds of operations in flight at once: the watchdog keeps up and recycles its events."""
    x, expected = _tensor(torch, rng, "float32", 1 << 20)
    out = _filled(torch, x, x.numel())
    s = _stream(torch)
    for _ in range(500):
        nccl.allreduce(world, x, out, SUM, s)
        nccl.barrier(world, s)
    np.testing.assert_array_equal(_numpy(out), expected)


def test_a_side_stream_is_used_as_given(torch, nccl, world, rng):
    side = torch.cuda.Stream()
    x, expected = _tensor(torch, rng, "float16", 65_537)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = _filled(torch, x, x.numel())
        nccl.allreduce(world, x, out, SUM, side.cuda_stream)
    side.synchronize()
    np.testing.assert_array_equal(_numpy(out), expected)


def test_empty_tensors_are_a_no_op(torch, nccl, world):
    empty = torch.empty(0, device="cuda")
    nccl.allreduce(world, empty, torch.empty(0, device="cuda"), SUM, _stream(torch))
    nccl.allgather(world, empty, torch.empty(0, device="cuda"), _stream(torch))


def test_split_and_barrier(torch, nccl, world, rng):
    nccl.barrier(world, _stream(torch))
    sub = nccl.split(world, 0, 0, "sub")
    try:
        assert (nccl.rank(sub), nccl.size(sub)) == (0, 1)
        x, expected = _tensor(torch, rng, "float32", 100)
        out = _filled(torch, x, 100)
        nccl.allreduce(sub, x, out, SUM, _stream(torch))
        np.testing.assert_array_equal(_numpy(out), expected)
    finally:
        assert nccl.destroy(sub)
    with pytest.raises(ValueError, match="no communicator with handle"):
        nccl.rank(sub)


def test_avg_needs_a_float_type(torch, nccl, world):
    x = torch.ones(4, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=r"NCCL allreduce on communicator 'world' \(rank 0 of 1\): avg needs a float"):
        nccl.allreduce(world, x, x, AVG)


def test_argument_errors(torch, nccl, world):
    x = torch.ones(8, device="cuda")
    with pytest.raises(ValueError, match="no communicator with handle 123456"):
        nccl.allreduce(123456, x, x, SUM)
    with pytest.raises(ValueError, match="send and receive sizes differ"):
        nccl.allreduce(world, x, torch.ones(9, device="cuda"), SUM)
    with pytest.raises(ValueError, match="one send-sized block per rank"):
        nccl.allgather(world, x, torch.ones(16, device="cuda"))
    with pytest.raises(ValueError, match="one send-sized block per peer"):
        nccl.send_recv(world, x, torch.ones(8, device="cuda"), [0, 0])
    with pytest.raises(TypeError, match="dtypes differ"):
        nccl.allreduce(world, x, torch.ones(8, dtype=torch.float64, device="cuda"), SUM)
    with pytest.raises(ValueError, match="communicates CUDA tensors"):
        nccl.allreduce(world, torch.ones(8), torch.ones(8), SUM)
    root_error = r"NCCL broadcast on communicator 'world' \(rank 0 of 1\): root 1 is not a rank"
    with pytest.raises(ValueError, match=root_error):
        nccl.broadcast(world, x, 1)
    with pytest.raises(ValueError, match="peer 1 is not a rank of 1"):
        nccl.send_recv(world, x, torch.ones(8, device="cuda"), [1])
    with pytest.raises(ValueError, match="unknown reduction 9"):
        nccl.allreduce(world, x, x, 9)
    with pytest.raises(ValueError, match="the color must be >= 0"):
        nccl.split(world, -1, 0, "none")
    with pytest.raises(ValueError, match="the 128 bytes of unique_id"):
        nccl.create(b"short", 0, 1, "world", 30.0)
    with pytest.raises(ValueError, match="the rank is out of range"):
        nccl.create(nccl.unique_id(), 1, 1, "world", 30.0)
    # The communicator still works after refused calls.
    nccl.allreduce(world, x, x, SUM, _stream(torch))
    assert torch.equal(x.cpu(), torch.ones(8))


def test_jax_ffi_collectives_on_one_rank(request, rng):
    jax = pytest.importorskip("jax")
    try:
        gpu = jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("needs a CUDA device visible to JAX")
    import jax.numpy as jnp

    nccl = request.getfixturevalue("nccl")

    from bagua_jax.engines import engine
    from bagua_jax.native_communicator import NativeCommunicator

    comm = NativeCommunicator(engine("nccl").create(nccl.unique_id(), 0, 1, "world", 30.0), "nccl")
    try:
        x_np = random_values(rng, 3 * 5).reshape(3, 5)
        rows = random_values(rng, 5).reshape(1, 5)
        with jax.default_device(gpu):
            x, r = jnp.asarray(x_np), jnp.asarray(rows)

            @jax.jit
            def everything(x, r):
                return {
                    "allreduce": comm.allreduce(x, "sum"),
                    "avg": comm.allreduce(x, "avg"),
                    "reduce": comm.reduce(x, 0, "max"),
                    "broadcast": comm.broadcast(x, 0),
                    "reduce_scatter": comm.reduce_scatter(r),
                    "allgather": comm.allgather(x),
                    "gather": comm.gather(x, 0),
                    "scatter": comm.scatter(r, 0),
                    "alltoall": comm.alltoall(r),
                    "alltoall_v": comm.alltoall_v(x.ravel(), jnp.array([4]), jnp.array([4]), 6),
                    "send_recv": comm.send_recv(x, jnp.array([0, 0], jnp.int32)),
                    "barrier": comm.barrier(x),
                }

            got = {k: np.asarray(v) for k, v in everything(x, r).items()}
        for name in ("allreduce", "avg", "reduce", "broadcast", "barrier"):
            np.testing.assert_array_equal(got[name], x_np, err_msg=name)
        for name in ("allgather", "gather"):
            np.testing.assert_array_equal(got[name], x_np[None], err_msg=name)
        for name in ("reduce_scatter", "scatter"):
            np.testing.assert_array_equal(got[name], rows[0], err_msg=name)
        np.testing.assert_array_equal(got["alltoall"], rows)
        np.testing.assert_array_equal(got["alltoall_v"], np.concatenate([x_np.ravel()[:4], np.zeros(2, np.float32)]))
        np.testing.assert_array_equal(got["send_recv"], np.stack([x_np, x_np]))
    finally:
        comm.close()


def _run(script: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, **(env_extra or {}))
    command = [sys.executable, "-c", textwrap.dedent(script)]
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=300, env=env)


def _value(label: str, stdout: str) -> str:
    match = re.search(rf"^{label}: (.*)$", stdout, re.MULTILINE)
    assert match, f"no {label} line in:\n{stdout}"
    return match.group(1)


def test_init_times_out_when_a_rank_never_joins(torch, nccl):
    result = _run(
        """
        import time
        import _bagua_nccl as nccl
        start = time.monotonic()
        try:
            nccl.create(nccl.unique_id(), 0, 2, "world", 3.0)
        except RuntimeError as e:
            print("ERROR:", e)
        print("ELAPSED:", time.monotonic() - start)
        """
    )
    assert result.returncode == 0, result.stderr
    error = _value("ERROR", result.stdout)
    assert "NCCL create of communicator 'world' (rank 0 of 2): did not complete within 3 s" in error
    assert 2.5 < float(_value("ELAPSED", result.stdout)) < 60


def test_watchdog_aborts_a_collective_a_peer_never_joins(torch, nccl):
    """Two ranks as threads on one GPU: both run one allreduce, then rank 0 runs
    one alone. The watchdog must abort it (unblocking the stream) and every later
    call must fail naming the communicator, the operation and the rank. The
    timeout leaves room for a first NCCL initialization on a fresh machine."""
    result = _run(
        """
        import sys, threading, time
        import torch
        import _bagua_nccl as nccl

        uid = nccl.unique_id()
        handles, errors = [None, None], []

        def create(rank):
            try:
                handles[rank] = nccl.create(uid, rank, 2, "world", 10.0, 0)
            except Exception as e:
                errors.append(str(e))

        def on_both(fn):
            threads = [threading.Thread(target=fn, args=(rank,)) for rank in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()

        on_both(create)
        if errors:
            print("CREATE:", errors[0].replace("\\n", " "))
            sys.exit(0)
        streams = [torch.cuda.Stream() for _ in range(2)]
        xs = [torch.ones(1024, device="cuda") for _ in range(2)]
        torch.cuda.synchronize()

        def allreduce(rank):
            nccl.allreduce(handles[rank], xs[rank], xs[rank], 0, streams[rank].cuda_stream)

        on_both(allreduce)
        torch.cuda.synchronize()
        print("SUMS:", xs[0][0].item(), xs[1][0].item())
        start = time.monotonic()
        try:
            allreduce(0)
            streams[0].synchronize()
        except RuntimeError as e:
            print("FIRST:", e)
        print("UNBLOCKED:", time.monotonic() - start)
        try:
            nccl.barrier(handles[0], streams[0].cuda_stream)
        except RuntimeError as e:
            print("ERROR:", e)
        start = time.monotonic()
        nccl.finalize()
        print("FINALIZED:", time.monotonic() - start)
        """,
        {"NCCL_MULTI_RANK_GPU_ENABLE": "1"},
    )
    assert result.returncode == 0, result.stderr
    if "CREATE:" in result.stdout:
        message = _value("CREATE", result.stdout)
        if "same GPU" in message or "Duplicate GPU" in message:
            pytest.skip(f"this NCCL cannot put two ranks on one GPU: {message}")
        pytest.fail(message)
    assert _value("SUMS", result.stdout) == "2.0 2.0"
    assert 9 < float(_value("UNBLOCKED", result.stdout)) < 120
    failure = (
        r"NCCL allreduce on communicator 'world' \(rank 0 of 2\): (did not complete|could not be enqueued) within 10 s"
    )
    assert re.search(
        r"NCCL barrier on communicator 'world' \(rank 0 of 2\): .*aborted.*" + failure, _value("ERROR", result.stdout)
    )
    assert re.search("bagua: " + failure, result.stderr)
    assert float(_value("FINALIZED", result.stdout)) < 60

"""Rank bodies for test_communicators_torch.py.

``engine`` is "gloo" (a ProcessGroupCommunicator over torch.distributed, started
with the python launcher) or "mpi" (the NativeCommunicator over the MPI engine,
started under mpiexec). Results come back as NumPy arrays keyed by name.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np

from bagua_common.comm.collectives import ReduceOp

OPS = ("sum", "avg", "min", "max")
# dtypes beyond float32 that every communicator carries, and how each is checked.
EXTRA_DTYPES = ("float64", "float16", "bfloat16", "int32", "int64", "uint8")


def rank_data(seed: int, rank: int, tag: str, shape=(3, 5), dtype: str = "float32") -> np.ndarray:
    """Fresh per-rank data, reproducible from (seed, rank, tag) by the test process."""
    rng = np.random.default_rng([seed, rank, sum(map(ord, tag)) * 7919 + len(tag)])
    if dtype == "uint8":
        return rng.integers(0, 50, shape).astype(np.uint8)
    if dtype in ("int32", "int64"):
        return rng.integers(-1000, 1000, shape).astype(dtype)
    data = rng.standard_normal(shape) * 10.0 ** rng.uniform(-2, 2)
    # Values representable in the narrow float types, kept as float32 here.
    if dtype in ("float16", "bfloat16"):
        import torch

        return torch.from_numpy(data.astype(np.float32)).to(getattr(torch, dtype)).float().numpy()
    return data.astype(dtype)


def _torch(a: np.ndarray, dtype: str | None = None):
    import torch

    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.to(getattr(torch, dtype)) if dtype else t


def _numpy(t) -> np.ndarray:
    import torch

    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.float()  # exact
    return t.cpu().numpy().copy()


def setup(engine: str, timeout: float):
    """This rank's world communicator for ``engine``."""
    from bagua_torch import NativeCommunicator, ProcessGroupCommunicator

    if engine == "gloo":
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]),
            init_method=f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            timeout=timedelta(seconds=max(timeout, 30)),
        )
        return ProcessGroupCommunicator(timeout=timeout)
    if engine == "mpi":
        return NativeCommunicator.mpi_world(timeout=timeout)
    raise ValueError(engine)


def _issue_all(comm, data: dict, asynchronous: bool) -> dict:
    """Every primitive once on float32 data; async: all issued first, then waited in order."""
    size, rank = comm.size, comm.rank
    x, rows, flat = data["x"], data["rows"], data["flat"]
    suffix = "_async" if asynchronous else ""
    calls = {}
    for name in OPS:
        op = ReduceOp(name) if asynchronous else name  # both spellings: the member and its name
        calls[f"allreduce_{name}"] = ("allreduce", (x, op))
        calls[f"reduce_{name}"] = ("reduce", (x, size - 1, op))
        calls[f"reduce_scatter_{name}"] = ("reduce_scatter", (rows, op))
    calls["broadcast"] = ("broadcast", (x, 1))
    calls["allgather"] = ("allgather", (x,))
    calls["gather"] = ("gather", (x, 1))
    calls["scatter"] = ("scatter", (rows, size - 1))
    calls["alltoall"] = ("alltoall", (rows,))
    # Rank r sends r+1 elements to every rank, so it receives j+1 elements from rank j.
    calls["alltoall_v"] = ("alltoall_v", (flat, [rank + 1] * size, list(range(1, size + 1)), size * size + 3))
    # Next and previous twice (symmetric): repeated peers must pair up in order.
    peers = [(rank + 1) % size, (rank - 1) % size] * 2
    calls["send_recv"] = ("send_recv", (x + 1000 * rank, peers))
    calls["barrier"] = ("barrier", ())
    if asynchronous:
        works = {key: getattr(comm, name + suffix)(*args) for key, (name, args) in calls.items()}
        values = {key: work.wait() for key, work in works.items()}
        assert all(work.is_completed() for work in works.values())
    else:
        values = {key: getattr(comm, name)(*args) for key, (name, args) in calls.items()}
    return {key: None if v is None else _numpy(v) for key, v in values.items()}


def _errors(comm) -> dict[str, str]:
    """Requests refused on this rank before anything is communicated."""
    import torch

    size, rank = comm.size, comm.rank
    good = torch.ones(size, 2)
    cases = {
        "dtype": lambda: comm.allreduce(torch.ones(3, dtype=torch.int16)),
        "not_tensor": lambda: comm.allreduce([1.0, 2.0]),
        "op": lambda: comm.allreduce(good, "prod"),
        "avg_int": lambda: comm.allreduce(torch.ones(3, dtype=torch.int32), "avg"),
        "root": lambda: comm.broadcast(good, size),
        "negative_root": lambda: comm.reduce_async(good, -1),
        "rows": lambda: comm.reduce_scatter(torch.ones(size + 1, 2)),
        "scalar_rows": lambda: comm.alltoall(torch.tensor(1.0)),
        "counts_length": lambda: comm.alltoall_v(torch.ones(8), [1] * (size + 1), [1] * size, 8),
        "counts_exceed": lambda: comm.alltoall_v(torch.ones(size - 1), [1] * size, [1] * size, size + 5),
        "out_size": lambda: comm.alltoall_v(torch.ones(size), [1] * size, [2] * size, size),
        "self_peer": lambda: comm.send_recv(good, [rank]),
        "bad_peer": lambda: comm.send_recv(good, [size]),
    }
    found = {}
    for key, call in cases.items():
        try:
            call()
            found[key] = "no error"
        except Exception as error:  # noqa: BLE001 (reported to the test)
            found[key] = f"{type(error).__name__}: {error}"
    return found


def every_primitive(engine: str, seed: int) -> dict:
    """Every primitive, sync and async, on fresh data; plus dtypes, overlap, subgroups and errors."""
    import torch

    comm = setup(engine, timeout=60)
    size, rank = comm.size, comm.rank
    data = {
        "x": _torch(rank_data(seed, rank, "x")),
        "rows": _torch(rank_data(seed, rank, "rows", (size, 4))),
        "flat": _torch(np.arange(size * (rank + 1), dtype=np.float32) + 100 * rank),
    }
    out = {"rank": rank, "size": size, "comm_rank": comm.rank, "comm_size": comm.size}
    out.update(_issue_all(comm, data, asynchronous=False))
    out.update({f"{k}/async": v for k, v in _issue_all(comm, data, asynchronous=True).items()})

    for dtype in EXTRA_DTYPES:
        t = _torch(rank_data(seed, rank, dtype, (7,), dtype), dtype)
        out[f"{dtype}/sum"] = _numpy(comm.allreduce(t, "sum"))
        out[f"{dtype}/max"] = _numpy(comm.allreduce_async(t, "max").wait())
        out[f"{dtype}/min"] = _numpy(comm.allreduce(t, "min"))
        out[f"{dtype}/broadcast"] = _numpy(comm.broadcast(t, 0))
        out[f"{dtype}/allgather"] = _numpy(comm.allgather(t))
        out[f"{dtype}/dtype"] = str(comm.allreduce(t).dtype)

    # Overlap: two allreduces in flight, a synchronous broadcast issued behind them, waited in reverse.
    a = _torch(rank_data(seed, rank, "overlap_a", (1000,)))
    b = _torch(rank_data(seed, rank, "overlap_b", (1000,)))
    work_a, work_b = comm.allreduce_async(a), comm.allreduce_async(b, "max")
    out["overlap/broadcast"] = _numpy(comm.broadcast(a, 0))
    out["overlap/b"] = _numpy(work_b.wait())
    out["overlap/a"] = _numpy(work_a.wait())
    out["overlap/again"] = _numpy(work_a.wait())
    out["overlap/completed"] = work_a.is_completed() and work_b.is_completed()
    out["input_untouched"] = bool(torch.equal(a, _torch(rank_data(seed, rank, "overlap_a", (1000,)))))

    # Non-contiguous input and a leading dimension that is not a block axis.
    out["noncontiguous"] = _numpy(comm.allreduce(data["rows"].t()))

    # Sub-communicators: the ranks of one parity; for MPI ordered by descending rank.
    x = data["x"]
    if engine == "gloo":
        import torch.distributed as dist

        from bagua_torch import ProcessGroupCommunicator

        groups = [dist.new_group([r for r in range(size) if r % 2 == p]) for p in (0, 1)]
        sub = ProcessGroupCommunicator(groups[rank % 2], timeout=60, name=f"parity{rank % 2}")
        # The reduce_scatter emulation for backends without reduce_scatter_tensor.
        fallback = ProcessGroupCommunicator(timeout=60, name="fallback")
        fallback._has_reduce_scatter = False
        out["fallback/reduce_scatter_sum"] = _numpy(fallback.reduce_scatter(data["rows"]))
        out["fallback/reduce_scatter_avg"] = _numpy(fallback.reduce_scatter_async(data["rows"], "avg").wait())
    else:
        sub = comm.split(rank % 2, -rank)
        out.update(_one_thread(comm, x))
    out["sub/rank"], out["sub/size"] = sub.rank, sub.size
    out["sub/allgather"] = _numpy(sub.allgather(x))
    out["sub/broadcast"] = _numpy(sub.broadcast(x, sub.size - 1))
    out["sub/gather"] = _numpy(sub.gather(x, 0))
    out["sub/reduce"] = _numpy(sub.reduce(x, sub.size - 1))
    if sub.size > 1:
        out["sub/send_recv"] = _numpy(sub.send_recv(x, [(sub.rank + 1) % sub.size]))
    from bagua_torch import Communicator, Work

    out["protocol"] = isinstance(comm, Communicator) and isinstance(comm.barrier_async(), Work)
    out["errors"] = _errors(comm)
    comm.barrier()
    return out


def _one_thread(comm, x) -> dict:
    """A job on a native communicator's thread: what it issues there, or on a child sharing the thread, runs
    inline (nothing more is queued); on a child with a thread of its own it is queued there."""
    shared = comm.split(0, comm.rank, name="shared", share_thread=True)
    own = comm.split(0, comm.rank, name="own")
    queued = []
    for name, worker in (("world", comm.ordered_worker), ("own", own.ordered_worker)):

        def counting(job, tensors=(), submit=worker.submit, name=name):
            queued.append(name)
            return submit(job, tensors)

        worker.submit = counting
    job = comm.ordered_worker.submit(
        lambda stream: (comm.allreduce(x, "sum"), shared.allreduce(x, "max"), own.allreduce(x, "min"))
    )
    total, largest, smallest = job.wait()
    del comm.ordered_worker.submit, own.ordered_worker.submit
    out = {
        "thread/sum": _numpy(total),
        "thread/max": _numpy(largest),
        "thread/min": _numpy(smallest),
        "thread/queued": queued,
        "thread/shared": shared.ordered_worker is comm.ordered_worker,
        "thread/own": own.ordered_worker is not comm.ordered_worker,
    }
    shared.close()
    own.close()
    return out


def dead_or_stalled_peer(engine: str, mode: str, timeout: float) -> dict:
    """Rank 1 dies ("die") or skips the collective ("stall"); the others must get an error in time."""
    import torch

    comm = setup(engine, timeout=timeout)
    comm.barrier()  # everyone connected
    if comm.rank == 1:
        if mode == "die":
            os._exit(1)
        # Stay alive (never entering the allreduce) until rank 0 has reported its error.
        marker = Path(os.environ["BAGUA_TEST_WORKDIR"]) / "survivor_done"
        deadline = time.monotonic() + timeout + 30
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"error": "stalled rank"}
    start = time.monotonic()
    try:
        if mode == "die":
            comm.allreduce(torch.ones(1000))
        else:
            comm.allreduce_async(torch.ones(1000)).wait()
        message = "no error"
    except Exception as error:  # noqa: BLE001 (what a user sees)
        message = f"{type(error).__name__}: {error}"
    (Path(os.environ["BAGUA_TEST_WORKDIR"]) / "survivor_done").touch()
    return {"error": message, "elapsed": time.monotonic() - start, "rank": comm.rank, "size": comm.size}

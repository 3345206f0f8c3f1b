"""Algorithm and bus bandwidth of Bagua's collectives: native engines next to lax and torch.distributed.

What is measured
----------------
Every primitive below runs, for float32 messages of each size, through four engines,
each its own group of processes (one process per rank, all on this machine):

    native-jax    bagua_jax.NativeCommunicator under jax.jit: the MPI engine
                  (``mpiexec -n N``) on CPU, the NCCL engine on GPU
    native-jax-tcp  bagua_jax.NativeCommunicator under jax.jit over the TCP engine
                  (``tcp_through_store``, the fault-tolerant JAX jobs' engine), CPU only:
                  one process per rank, the world built through a store rank 0 serves
    native-torch  bagua_torch.NativeCommunicator: the MPI engine (``mpiexec -n N``) on
                  CPU, the NCCL engine on GPU
    lax           bagua_jax.LaxCommunicator inside jax.shard_map over a mesh of every
                  process's device: XLA's collectives, over gloo between CPU processes
                  joined by jax.distributed; on GPU one device
    torch         bagua_torch.ProcessGroupCommunicator over torch.distributed: gloo
                  on CPU, nccl on GPU

    allreduce       sum of an S-byte buffer
    allgather       every rank contributes S/n bytes, gets the S-byte concatenation
    reduce_scatter  every rank contributes [n, S/n] (S bytes), gets its reduced S/n row
    alltoall        [n, S/n] (S bytes) in, row j to rank j
    broadcast       root 0's S-byte buffer to every rank
    send_recv       ring exchange: with 2 ranks S bytes to and from the other rank; with
                    more, S/2 bytes to and from each neighbour (S sent, S received per
                    rank); skipped on one rank

S is the message size as nccl-tests defines it per operation (the "size" column of
nccl-tests): the buffer for allreduce, broadcast and send_recv, and the full n-block
buffer for allgather (output), reduce_scatter (input) and alltoall. Following
nccl-tests, ``algbw = S / t`` and ``busbw = algbw * factor``, with factor 2(n-1)/n for
allreduce, (n-1)/n for allgather, reduce_scatter and alltoall, and 1 for broadcast and
send_recv; busbw is the bandwidth of the busiest link of an optimal algorithm, so it
is comparable across operations and rank counts (it is 0 for collectives on one rank,
where nothing moves). GB/s is 1e9 bytes per second. The ratio columns are time
ratios: ``native-jax/lax`` is lax's time over native-jax's and ``native-torch/torch``
torch.distributed's time over native-torch's, so above 1 means the native engine is
faster.

``native-jax-tcp/native-jax`` is the MPI engine's time over the TCP engine's (CPU).

Each engine is called through its communicator, as Bagua's algorithms call it: every
call returns a new buffer (ProcessGroupCommunicator clones the input of allreduce and
broadcast first, as torch.distributed works in place). LaxCommunicator's broadcast is
an all-reduce of the bits (every other rank contributes zeros) and its send_recv, whose
peers are chosen at run time, an all_gather of ``n`` times the block; the timings
include those costs, as an algorithm using them pays them.

How each measurement is taken
-----------------------------
The first call at every size (for JAX the one that compiles) is untimed, and its result
is checked on every rank against the exact expected values (small integers in float32,
so the sums are exact): every element up to 64Ki elements, beyond that 64Ki evenly
strided ones, 64Ki random ones and the last 64. A wrong result fails that primitive for
the engine (its larger sizes are skipped). One timed estimate call comes next;
the estimate, the largest over the ranks, sets the number of timed calls so that they
take about ``--target-seconds`` (0.3 s by default), at least 3 and at most 1000, the
same count on every rank. The calls run in at most 10 batches: the ranks meet in a
barrier (a one-element max-allreduce through the same engine) before each batch, then
run the batch's calls back to back, each waited for (``block_until_ready`` for JAX,
``torch.cuda.synchronize`` for CUDA torch), timed with ``time.perf_counter``. A rank's
time is the median over its batches of the time per call; rank 0 reports the largest
over the ranks (and records the smallest), gathered through the engine itself. Large
messages get one call per batch, timed from the barrier. Smaller ones run like
nccl-tests' loops, back to back, after one untimed call that absorbs how unevenly the
ranks left the barrier: timing small calls from a barrier would mostly measure that.
A rank that waits in the MPI engine for more than 1000 polls then polls only every
100 us (about 170 us on this VM), so after a rooted or uneven collective the rank that
reached the next barrier first left it several such intervals late (a 4 KiB native
broadcast timed per call from a barrier took ~0.8 ms on the non-root rank, ~35 us back
to back).

On CPU every worker first asks glibc to keep freed memory for reuse (as
benchmarks/kernels.py does, see ``retain_freed_memory``) so that every engine reuses
its output buffers instead of faulting in fresh pages for each call; ``--fresh-pages``
keeps glibc's default. ``OMP_NUM_THREADS`` is set to the cores per rank (at least 1,
as torchrun does) unless already set: with every rank's torch using all the cores,
spinning OpenMP threads starve the other ranks' communication (on 2 cores and 2 ranks
gloo's 256 KiB allreduce took ~15 ms instead of ~0.5 ms).

Robustness: every engine's process group runs under a time limit (``--timeout``,
seconds per engine) and is killed as a whole when it runs over; a rank that exits
with an error takes its group down after a short grace period; each communicator gets
``--comm-timeout`` seconds per collective. An engine that fails or times out is shown
as failed in the tables, with the last line of its error, and the other engines run
on. What a failed engine measured before it failed is kept.

How to run
----------
    python3 benchmarks/collectives.py --ranks 2        # 4 KiB .. 64 MiB on CPU
    python3 benchmarks/collectives.py --ranks 4
    python3 benchmarks/collectives.py --ranks 2 --max-size 256M --timeout 1200
    python3 benchmarks/collectives.py --quick          # 4 KiB .. 256 KiB smoke run
    python3 benchmarks/collectives.py --device gpu     # one rank on one GPU, 4 KiB .. 256 MiB

It prints a progress line per measurement, then one table per primitive, and writes
``collectives-cpu-<N>ranks.md`` and ``.json`` (``collectives-gpu-1rank.*`` on GPU, with
``-quick`` for a ``--quick`` run) to ``--out`` (default ``benchmarks/results/``),
recording the device, the versions, the date and the command line.

Sizes are powers of 4 from ``--min-size`` (4 KiB) to ``--max-size``. On CPU the default
maximum is 64 MiB, to keep a full run well under 8 minutes on the shared 2-core VM
(AMD EPYC, 23 GiB) this was written on: the default run of all four engines took 78 s
with 2 ranks and 107 s with 4 on a quiet machine, about 2.5 minutes with 4 ranks while
other jobs ran. 256 MiB costs far more: with 4 ranks (which oversubscribe the 2 cores)
its calls take up to 1.8 s, and the 256 MiB sizes alone took 5.5 minutes while other
jobs ran, with the buffers of all ranks and engines then taking several GiB of host
memory. Pass ``--max-size 256M`` (and a larger ``--timeout`` where needed) on a bigger
machine. On GPU the default maximum is 256 MiB.

The GPU mode (``--device gpu``) measures one rank: the NCCL engine through
``NativeCommunicator.nccl_world`` after a one-process ``jax.distributed.initialize``
and through bagua_torch's ``NativeCommunicator.from_store`` (``_bagua_nccl``),
LaxCommunicator on one GPU, and torch.distributed nccl with world size 1. With one rank
nothing crosses a link (busbw is 0 by definition), so the algbw and the ratios measure
each engine's per-call overhead and local copy bandwidth.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import harness.machine
import harness.results
import numpy as np
from harness.machine import retain_freed_memory
from harness.options import add_out_option, add_subset_option
from harness.results import finish_meta, header_lines, run_meta

from bagua_common.comm import topology
from bagua_common.fault_tolerance.settings import temporary_job_secret
from bagua_common.job.local_launch import free_port, mpiexec
from bagua_common.job.rank_environment import threads_per_rank

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
GB = 1e9
ENGINES = ("native-jax", "native-jax-tcp", "native-torch", "lax", "torch")
CPU_ONLY = ("native-jax-tcp",)
# (native, baseline) per front end; the TCP engine against the MPI engine
PAIRS = (("native-jax", "lax"), ("native-torch", "torch"), ("native-jax-tcp", "native-jax"))
PRIMITIVES = ("allreduce", "allgather", "reduce_scatter", "alltoall", "broadcast", "send_recv")
BLOCKED = ("allgather", "reduce_scatter", "alltoall")  # S is n blocks, one per rank
ENGINE_DESCRIPTIONS = {
    "cpu": {
        "native-jax": "bagua_jax.NativeCommunicator, MPI engine (mpiexec), under jax.jit",
        "native-jax-tcp": "bagua_jax.NativeCommunicator.tcp_through_store (TCP engine), under jax.jit",
        "native-torch": "bagua_torch.NativeCommunicator, MPI engine (mpiexec)",
        "lax": "bagua_jax.LaxCommunicator in jax.shard_map: XLA collectives over gloo (jax.distributed)",
        "torch": "bagua_torch.ProcessGroupCommunicator over torch.distributed gloo",
    },
    "gpu": {
        "native-jax": "bagua_jax.NativeCommunicator.nccl_world (NCCL engine), under jax.jit",
        "native-torch": "bagua_torch.NativeCommunicator.from_store (NCCL engine, _bagua_nccl)",
        "lax": "bagua_jax.LaxCommunicator in jax.shard_map on one GPU (XLA collectives)",
        "torch": "bagua_torch.ProcessGroupCommunicator over torch.distributed nccl",
    },
}
MIN_SIZE = 4 * KIB
CPU_MAX_SIZE, GPU_MAX_SIZE, QUICK_MAX_SIZE = 64 * MIB, 256 * MIB, 256 * KIB
SIZE_STEP = 4
TARGET_SECONDS, QUICK_TARGET_SECONDS = 0.3, 0.05
WARMUP_CALLS, MIN_CALLS, MAX_CALLS, MAX_BATCHES = 1, 3, 1000, 10
ENGINE_TIMEOUT_SECONDS = 600.0  # per engine, the whole group of processes
COMM_TIMEOUT_SECONDS = 120.0  # per collective, inside the communicators
FAILURE_GRACE_SECONDS = 10.0  # after one rank failed, before the others are killed
ROOT = 0


# --------------------------------------------------------------------------- definitions


def bus_factor(primitive: str, n: int) -> float:
    """busbw / algbw for ``primitive`` on ``n`` ranks (nccl-tests' definitions)."""
    if primitive == "allreduce":
        return 2 * (n - 1) / n
    if primitive in BLOCKED:
        return (n - 1) / n
    return 1.0  # broadcast, send_recv


FACTOR_TEXT = {
    "allreduce": "2(n-1)/n",
    "allgather": "(n-1)/n",
    "reduce_scatter": "(n-1)/n",
    "alltoall": "(n-1)/n",
    "broadcast": "1",
    "send_recv": "1",
}


def ring_peers(rank: int, n: int) -> list[int] | None:
    """send_recv's peers, as Bagua's ring algorithms take them; None on one rank."""
    return None if n < 2 else topology.ring_peers(rank, n)


def element_count(primitive: str, nbytes: int, n: int) -> int:
    """float32 elements of the S-byte message, rounded down so the blocks split evenly."""
    unit = n if primitive in BLOCKED else len(ring_peers(0, n) or [1]) if primitive == "send_recv" else 1
    count = nbytes // 4 // unit * unit
    if count == 0:
        raise ValueError(f"{nbytes} bytes is too small for {primitive} on {n} ranks")
    return count


def rank_data(rank: int, count: int) -> np.ndarray:
    """Rank ``rank``'s values ``i % 1021 + 1024 * rank``: small integers, so float32 sums are exact."""
    return _value(rank, np.arange(count, dtype=np.int64)).astype(np.float32)


def _value(rank: Any, index: np.ndarray) -> np.ndarray:
    return index % 1021 + 1024 * np.asarray(rank, np.int64)


def local_input(primitive: str, rank: int, n: int, count: int) -> np.ndarray:
    """This rank's input for an S-byte (``count`` elements) message."""
    if primitive == "allgather":
        return rank_data(rank, count // n)
    if primitive in ("reduce_scatter", "alltoall"):
        return rank_data(rank, count).reshape(n, count // n)
    if primitive == "send_recv":
        return rank_data(rank, count // len(ring_peers(rank, n)))
    return rank_data(rank, count)


def expected(primitive: str, rank: int, n: int, count: int, flat: np.ndarray) -> tuple[tuple[int, ...], np.ndarray]:
    """The shape of rank ``rank``'s result and its values at the flat indices ``flat``.

    Computed from the closed form of every rank's ``local_input``, so checking a large
    message needs neither the other ranks' inputs nor a full-size expected array.
    """
    m, all_ranks = count // n, 1024 * n * (n - 1) // 2  # sum over j of 1024 * j
    if primitive == "allreduce":
        return (count,), n * (flat % 1021) + all_ranks
    if primitive == "broadcast":
        return (count,), _value(ROOT, flat)
    if primitive == "allgather":
        j, i = np.divmod(flat, m)
        return (n, m), _value(j, i)
    if primitive == "reduce_scatter":
        return (m,), n * ((rank * m + flat) % 1021) + all_ranks
    if primitive == "alltoall":
        j, i = np.divmod(flat, m)
        return (n, m), _value(j, rank * m + i)
    if primitive == "send_recv":
        peers = np.asarray(ring_peers(rank, n), np.int64)
        k = count // len(peers)
        row, i = np.divmod(flat, k)
        return (len(peers), k), _value(peers[row], i)
    raise ValueError(primitive)


CHECKED_ELEMENTS = 1 << 16


def wrong_elements(primitive: str, rank: int, n: int, count: int, got: np.ndarray) -> int:
    """How many checked elements of ``got`` differ from the expected result (-1: wrong shape).

    Every element is checked up to ``CHECKED_ELEMENTS`` elements; beyond, that many
    evenly strided ones (so any wrong stretch longer than the stride is seen), as many
    random ones and the last 64.
    """
    shape, _ = expected(primitive, rank, n, count, np.zeros(1, np.int64))
    if tuple(got.shape) != shape:
        return -1
    total = int(np.prod(shape))
    if total <= CHECKED_ELEMENTS:
        flat = np.arange(total, dtype=np.int64)
    else:
        rng = np.random.default_rng([rank, total])
        flat = np.unique(
            np.concatenate(
                [
                    np.arange(0, total, total // CHECKED_ELEMENTS, dtype=np.int64),
                    rng.integers(0, total, CHECKED_ELEMENTS),
                    np.arange(total - 64, total, dtype=np.int64),
                ]
            )
        )
    _, want = expected(primitive, rank, n, count, flat)
    return int(np.count_nonzero(got.reshape(-1)[flat] != want.astype(np.float32)))


# --------------------------------------------------------------------------- engines (workers)


def jax_primitives(comm: Any) -> dict[str, Callable[..., Any]]:
    """The measured primitives over a ``bagua_jax`` communicator, by name, as functions of the input."""
    return {
        "allreduce": lambda x: comm.allreduce(x, "sum"),
        "allgather": comm.allgather,
        "reduce_scatter": lambda x: comm.reduce_scatter(x, "sum"),
        "alltoall": comm.alltoall,
        "broadcast": lambda x: comm.broadcast(x, ROOT),
        "send_recv": comm.send_recv,
    }


class Engine:
    """One rank's communicator of one engine; ``prepare`` gives a call that runs and waits."""

    name = ""

    def __init__(self, device: str, ranks: int, timeout: float) -> None:
        self.device, self.timeout = device, timeout
        self.rank, self.size = 0, ranks

    def prepare(self, primitive: str, x: np.ndarray, peers: list[int] | None) -> Callable[[], Any]:
        """A function that runs ``primitive`` once on ``x`` and returns its finished result."""
        raise NotImplementedError

    def to_numpy(self, out: Any) -> np.ndarray:
        raise NotImplementedError

    def allmax(self, values: Sequence[float]) -> np.ndarray:
        """The elementwise max over the ranks of float32 ``values`` (a collective)."""
        raise NotImplementedError

    def barrier(self) -> None:
        self.allmax([0.0])

    def info(self) -> dict[str, Any]:
        return {}


class NativeJaxEngine(Engine):
    """bagua_jax.NativeCommunicator under jax.jit: MPI on CPU (under mpiexec), NCCL on GPU."""

    name = "native-jax"

    def __init__(self, device: str, ranks: int, timeout: float) -> None:
        super().__init__(device, ranks, timeout)
        import jax
        import jax.numpy as jnp

        from bagua_jax.native_communicator import NativeCommunicator

        if device == "gpu":
            _require_jax_gpu(jax)
            jax.distributed.initialize(
                coordinator_address=_coordinator(), num_processes=1, process_id=0, initialization_timeout=60
            )
            self.comm = NativeCommunicator.nccl_world(timeout)
        else:
            self.comm = self._cpu_world(timeout)
        self.jax, self.jnp = jax, jnp
        self.rank, self.size = int(self.comm.rank()), self.comm.size
        comm = self.comm
        self._max = jax.jit(lambda v: comm.allreduce(v, "max"))
        self._ops = jax_primitives(comm)

    def prepare(self, primitive, x, peers):
        jax, jnp = self.jax, self.jnp
        fn = jax.jit(self._ops[primitive])
        args = [jax.device_put(x)] + ([jnp.asarray(peers, jnp.int32)] if primitive == "send_recv" else [])
        jax.block_until_ready(args)
        return lambda: fn(*args).block_until_ready()

    def to_numpy(self, out):
        return np.asarray(out)

    def allmax(self, values):
        return np.asarray(self._max(self.jnp.asarray(np.asarray(values, np.float32))))

    def _cpu_world(self, timeout: float) -> Any:
        from bagua_jax.native_communicator import NativeCommunicator

        return NativeCommunicator.mpi_world(timeout)

    def info(self):
        d = self.jax.devices()[0]
        return {"device_name": getattr(d, "device_kind", str(d)), "engine": "nccl" if self.device == "gpu" else "mpi"}


class NativeJaxTcpEngine(NativeJaxEngine):
    """bagua_jax.NativeCommunicator under jax.jit over the TCP engine (CPU): rank 0 serves the store the world is built
    through, at MASTER_ADDR:MASTER_PORT, under the job's secret (``BAGUA_FT_SECRET_FILE``)."""

    name = "native-jax-tcp"

    def _cpu_world(self, timeout: float) -> Any:
        from bagua_common.fault_tolerance import job_secret
        from bagua_common.fault_tolerance.kv_store import KVServer, connect
        from bagua_jax.native_communicator import NativeCommunicator

        host, port, rank = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["RANK"])
        self._server = KVServer(host, port, secret=job_secret()) if rank == 0 else None
        store = connect(host, port, timeout, secret=job_secret())
        return NativeCommunicator.tcp_through_store(store, "world/", rank, self.size, host, timeout)

    def info(self):
        return {**super().info(), "engine": "tcp"}


class LaxEngine(Engine):
    """bagua_jax.LaxCommunicator in jax.shard_map over one device per process (gloo on CPU)."""

    name = "lax"

    def __init__(self, device: str, ranks: int, timeout: float) -> None:
        super().__init__(device, ranks, timeout)
        import jax
        from jax.sharding import Mesh, NamedSharding
        from jax.sharding import PartitionSpec as P

        from bagua_jax import LaxCommunicator

        if ranks > 1:
            rank = int(os.environ["RANK"])
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(
                coordinator_address=_coordinator(),
                num_processes=ranks,
                process_id=rank,
                initialization_timeout=60,
                heartbeat_timeout_seconds=int(timeout),
            )
            devices = jax.devices()
            if jax.local_device_count() != 1 or len(devices) != ranks:
                raise RuntimeError(
                    f"expected one device per process, got {devices} (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})"
                )
        else:
            if device == "gpu":
                _require_jax_gpu(jax)
            devices = jax.local_devices()[:1]
        self.jax, self.P = jax, P
        self.mesh = Mesh(np.array(devices), ("r",))
        self.sharding = NamedSharding(self.mesh, P("r"))
        self.comm = comm = LaxCommunicator("r", ranks)
        self.rank, self.size = jax.process_index(), ranks
        self._max = self._step(lambda v: comm.allreduce(v, "max"), 1)
        self._ops = jax_primitives(comm)

    def _step(self, fn: Callable[..., Any], nargs: int) -> Callable[..., Any]:
        """``fn`` on each process's block, as a jitted shard_map over the ranks' axis."""

        def body(*blocks):
            return fn(*(b[0] for b in blocks))[None]

        P = self.P
        return self.jax.jit(self.jax.shard_map(body, mesh=self.mesh, in_specs=(P("r"),) * nargs, out_specs=P("r")))

    def _global(self, local: np.ndarray) -> Any:
        return self.jax.make_array_from_process_local_data(self.sharding, local[None])

    def prepare(self, primitive, x, peers):
        args = [self._global(x)]
        if primitive == "send_recv":
            args.append(self._global(np.asarray(peers, np.int32)))
        step = self._step(self._ops[primitive], len(args))
        self.jax.block_until_ready(args)
        return lambda: step(*args).block_until_ready()

    def to_numpy(self, out):
        return np.asarray(out.addressable_shards[0].data)[0]

    def allmax(self, values):
        return self.to_numpy(self._max(self._global(np.asarray(values, np.float32))))

    def info(self):
        d = self.jax.local_devices()[0]
        return {
            "device_name": getattr(d, "device_kind", str(d)),
            "collectives": "gloo" if self.device == "cpu" and self.size > 1 else "xla",
        }


class TorchEngine(Engine):
    """bagua_torch's NativeCommunicator ("native-torch") or ProcessGroupCommunicator ("torch")."""

    def __init__(self, name: str, device: str, ranks: int, timeout: float) -> None:
        super().__init__(device, ranks, timeout)
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from bagua_torch import NativeCommunicator, ProcessGroupCommunicator

        self.name, self.torch = name, torch
        cuda = device == "gpu"
        if cuda:
            if not torch.cuda.is_available():
                raise RuntimeError("--device gpu: torch sees no CUDA device")
            torch.cuda.set_device(0)
        self.torch_device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        self.sync: Callable[[], None] = torch.cuda.synchronize if cuda else (lambda: None)
        if name == "native-torch":
            if cuda:
                store = dist.TCPStore(
                    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), 1, True, timedelta(seconds=timeout)
                )
                self.comm = NativeCommunicator.from_store(store, 0, 1, timeout=timeout, device=self.torch_device)
            else:
                self.comm = NativeCommunicator.mpi_world(timeout=timeout)
        else:
            dist.init_process_group(
                "nccl" if cuda else "gloo",
                rank=int(os.environ["RANK"]),
                world_size=ranks,
                init_method=f"tcp://{_coordinator()}",
                timeout=timedelta(seconds=timeout),
            )
            self.comm = ProcessGroupCommunicator(timeout=timeout)
        self.rank, self.size = self.comm.rank, self.comm.size

    def prepare(self, primitive, x, peers):
        t = self.torch.from_numpy(np.ascontiguousarray(x)).to(self.torch_device)
        comm = self.comm
        call: Callable[[], Any] = {
            "allreduce": lambda: comm.allreduce(t, "sum"),
            "allgather": lambda: comm.allgather(t),
            "reduce_scatter": lambda: comm.reduce_scatter(t, "sum"),
            "alltoall": lambda: comm.alltoall(t),
            "broadcast": lambda: comm.broadcast(t, ROOT),
            "send_recv": lambda: comm.send_recv(t, peers),
        }[primitive]
        self.sync()

        def run() -> Any:
            out = call()
            self.sync()
            return out

        return run

    def to_numpy(self, out):
        return out.cpu().numpy()

    def allmax(self, values):
        t = self.torch.tensor(list(values), dtype=self.torch.float32, device=self.torch_device)
        return self.comm.allreduce(t, "max").cpu().numpy()

    def info(self):
        out: dict[str, Any] = {"torch_threads": self.torch.get_num_threads()}
        if self.device == "gpu":
            out["device_name"] = self.torch.cuda.get_device_name(0)
        if self.name == "torch":
            out["backend"] = self.comm.backend
            has = getattr(self.comm, "_has_reduce_scatter", None)
            if has is not None:  # known once a reduce_scatter ran
                out["reduce_scatter"] = "reduce_scatter_tensor" if has else "allreduce fallback"
        return out


def make_engine(name: str, device: str, ranks: int, timeout: float) -> Engine:
    if name == "native-jax":
        return NativeJaxEngine(device, ranks, timeout)
    if name == "native-jax-tcp":
        return NativeJaxTcpEngine(device, ranks, timeout)
    if name == "lax":
        return LaxEngine(device, ranks, timeout)
    if name in ("native-torch", "torch"):
        return TorchEngine(name, device, ranks, timeout)
    raise ValueError(f"unknown engine {name!r}")


def _require_jax_gpu(jax: Any) -> None:
    if jax.default_backend() != "gpu":
        raise RuntimeError(f"--device gpu: JAX sees no GPU (its backend is {jax.default_backend()})")


def _coordinator() -> str:
    return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"


# --------------------------------------------------------------------------- measuring (workers)


def measure(engine: Engine, primitive: str, nbytes: int, target: float) -> dict[str, Any]:
    """Time ``primitive`` on an S = ``nbytes`` message on every rank; the same collectives on all."""
    n, rank = engine.size, engine.rank
    count = element_count(primitive, nbytes, n)
    peers = ring_peers(rank, n) if primitive == "send_recv" else None
    run = engine.prepare(primitive, local_input(primitive, rank, n, count), peers)
    first = run()  # compiles (JAX), allocates; its result is checked
    wrong = wrong_elements(primitive, rank, n, count, engine.to_numpy(first))
    del first
    per_rank = engine.allmax([float(wrong) if j == rank else -2.0 for j in range(n)])
    bad = {j: int(v) for j, v in enumerate(per_rank) if v != 0}
    if bad:
        raise AssertionError(
            f"{primitive} {format_size(nbytes)}: wrong results on rank "
            + ", ".join(f"{j} ({'wrong shape' if v == -1 else f'{v} checked elements'})" for j, v in bad.items())
        )
    for _ in range(WARMUP_CALLS - 1):
        run()
    engine.barrier()
    start = time.perf_counter()
    run()
    estimate = float(engine.allmax([time.perf_counter() - start])[0])
    calls = int(min(MAX_CALLS, max(MIN_CALLS, math.ceil(target / max(estimate, 1e-9)))))
    batches = min(calls, MAX_BATCHES)
    per_batch = math.ceil(calls / batches)
    times = []
    for _ in range(batches):
        engine.barrier()
        if per_batch > 1:
            run()  # untimed: absorbs how unevenly the ranks left the barrier
        start = time.perf_counter()
        for _ in range(per_batch):
            run()
        times.append((time.perf_counter() - start) / per_batch)
    median = statistics.median(times)
    high, neg_low = (float(v) for v in engine.allmax([median, -median]))
    s = 4 * count
    return {
        "engine": engine.name,
        "primitive": primitive,
        "size": nbytes,
        "bytes": s,
        "ranks": n,
        "median_s": high,
        "min_rank_median_s": -neg_low,
        "calls": batches * per_batch,
        "batches": batches,
        "algbw": s / high / GB,
        "busbw": s / high / GB * bus_factor(primitive, n),
    }


def _seconds(t: float) -> str:
    return f"{t * 1e6:.1f} us" if t < 1e-3 else f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.2f} s"


def run_worker(args: argparse.Namespace) -> None:
    """One rank of one engine: measure every primitive and size, appending JSON lines to the
    result file (rank 0 its measurements, every rank its errors); does not return."""
    if args.device == "cpu" and not args.fresh_pages:
        retain_freed_memory()
    engine = make_engine(args.worker, args.device, args.ranks, args.comm_timeout)
    if engine.size != args.ranks:
        raise RuntimeError(f"{engine.name}: {engine.size} ranks, expected {args.ranks}")
    lead = engine.rank == 0
    with open(args.result_file, "a") as results:  # O_APPEND: the ranks' lines do not mix

        def record(entry: dict[str, Any], every_rank: bool = False) -> None:
            if lead or every_rank:
                results.write(json.dumps(entry) + "\n")
                results.flush()

        record({"kind": "info", "engine": engine.name, "ranks": engine.size, "pid": os.getpid(), **engine.info()})
        primitives = [p for p in args.primitives if p != "send_recv" or engine.size > 1]
        total, done = len(primitives) * len(args.sizes), 0
        for primitive in primitives:
            for i, nbytes in enumerate(args.sizes):
                try:
                    m = measure(engine, primitive, nbytes, target=args.target_seconds)
                except Exception as error:  # noqa: BLE001 - reported, then the next primitive
                    traceback.print_exc()
                    text = "".join(traceback.format_exception_only(error))
                    last = [line for line in text.splitlines() if line.strip()]
                    record(
                        {
                            "kind": "error",
                            "engine": engine.name,
                            "primitive": primitive,
                            "size": nbytes,
                            "rank": engine.rank,
                            "error": last[-1][:500] if last else type(error).__name__,
                            "detail": text[-2000:],
                        },
                        every_rank=True,
                    )
                    done += len(args.sizes) - i
                    break
                done += 1
                record({"kind": "measurement", **m})
                if lead:
                    print(
                        f"[{done:3d}/{total}] {engine.name:<12} {primitive:<14} {format_size(nbytes):>8}  "
                        f"algbw {m['algbw']:8.3f} GB/s  busbw {m['busbw']:8.3f} GB/s  "
                        f"(median {_seconds(m['median_s'])} of {m['calls']}; fastest rank "
                        f"{_seconds(m['min_rank_median_s'])})",
                        flush=True,
                    )
        record({"kind": "info", "engine": engine.name, **engine.info()})  # what became known while running
        engine.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown (jax.distributed shutdown, MPI finalize): every rank is done.
    os._exit(0)


# --------------------------------------------------------------------------- launching


class Output:
    """Relays a group's merged output line by line (prefixed with the time) and keeps the tail."""

    def __init__(self, fd: int, start: float) -> None:
        self.tail: collections.deque[str] = collections.deque(maxlen=400)
        self._file = os.fdopen(fd, "r", errors="replace")
        self._start = start
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for line in self._file:
            line = line.rstrip("\n")
            self.tail.append(line)
            print(f"{time.perf_counter() - self._start:6.0f}s  {line}", flush=True)

    def close(self, wait: float = 5.0) -> None:
        self._thread.join(wait)
        with contextlib.suppress(OSError):
            self._file.close()


_ERROR_LINE = re.compile(r"^\s*([\w.]*(Error|Exception|Interrupt)|CommunicationError|Killed|Segmentation)\b")


def last_error_line(lines: Sequence[str]) -> str:
    """The last line that looks like an error (a Python exception), else the last line."""
    lines = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("=")]
    for line in reversed(lines):
        if _ERROR_LINE.match(line):
            return line[:500]
    return lines[-1][:500] if lines else "no output"


def run_engine(engine: str, args: argparse.Namespace, workdir: Path, start: float) -> dict[str, Any]:
    """Run one engine's group of processes under the time limit; return its outcome and records."""
    result_file = workdir / f"{engine}.jsonl"
    worker = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        engine,
        "--device",
        args.device,
        "--ranks",
        str(args.ranks),
        "--sizes",
        *map(str, args.sizes),
        "--primitives",
        *args.primitives,
        "--target-seconds",
        str(args.target_seconds),
        "--comm-timeout",
        str(args.comm_timeout),
        "--result-file",
        str(result_file),
    ] + (["--fresh-pages"] if args.fresh_pages else [])
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "BAGUA_COMM_TIMEOUT": str(args.comm_timeout),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(args.ranks),
    }
    env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(args.ranks)))
    if args.device == "cpu":
        env |= {"XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"}  # one CPU device per process
    else:
        env |= {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    read_fd, write_fd = os.pipe()
    procs: list[subprocess.Popen] = []
    try:
        if engine in ("native-jax", "native-torch") and args.device == "cpu":
            command = [mpiexec(), "-n", str(args.ranks), *worker]
            procs.append(
                subprocess.Popen(
                    command, env=env, stdin=subprocess.DEVNULL, stdout=write_fd, stderr=write_fd, start_new_session=True
                )
            )
        else:
            command = worker
            for r in range(args.ranks):
                procs.append(
                    subprocess.Popen(
                        worker,
                        env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                        stdin=subprocess.DEVNULL,
                        stdout=write_fd,
                        stderr=write_fd,
                        start_new_session=True,
                    )
                )
    finally:
        os.close(write_fd)
    output = Output(read_fd, start)
    began = time.perf_counter()
    deadline, failed_at, timed_out = began + args.timeout, None, False
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        now = time.perf_counter()
        if failed_at is None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > FAILURE_GRACE_SECONDS):
            timed_out = now > deadline
            for p in procs:
                if p.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)  # the process's own session: it and its children
            break
        time.sleep(0.05)
    codes = [p.wait() for p in procs]
    seconds = time.perf_counter() - began
    output.close()

    records = []
    if result_file.exists():
        for line in result_file.read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    info: dict[str, Any] = {}
    for r in records:
        if r["kind"] == "info":
            info |= {k: v for k, v in r.items() if k not in ("kind", "engine")}
    errors: list[dict[str, Any]] = []  # one per failure, with the ranks that reported it
    for r in records:
        if r["kind"] == "error":
            key = (r["primitive"], r["size"], r["error"])
            same = [e for e in errors if (e["primitive"], e["size"], e["error"]) == key]
            if same:
                same[0]["ranks"].append(r["rank"])
            else:
                errors.append({**r, "ranks": [r["rank"]]})
    outcome: dict[str, Any] = {
        "engine": engine,
        "description": ENGINE_DESCRIPTIONS[args.device][engine],
        "command": harness.results.command_line(command),
        "returncodes": codes,
        "seconds": round(seconds, 1),
        "info": info,
        "errors": errors,
    }
    if timed_out:
        outcome["status"] = "timed out"
        outcome["error"] = f"timed out after {args.timeout:g} s; last output: {last_error_line(output.tail)}"
    elif any(codes) or errors:
        outcome["status"] = "failed"
        outcome["error"] = last_error_line(output.tail) if any(codes) else errors[0]["error"]
    else:
        outcome["status"] = "ok"
    return {"outcome": outcome, "measurements": [r for r in records if r["kind"] == "measurement"]}


# --------------------------------------------------------------------------- reporting


def format_size(nbytes: int) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def parse_size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 4K, 64M, 1G)")
    scale = {"": 1, "K": KIB, "M": MIB, "G": GIB}[match.group(2).upper()]
    return int(float(match.group(1)) * scale)


def default_sizes(low: int, high: int) -> list[int]:
    sizes, s = [], low
    while s <= high:
        sizes.append(s)
        s *= SIZE_STEP
    return sizes


def _gbps(v: float | None) -> str:
    if v is None:
        return "—"
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}" if v >= 0.1 else f"{v:.3f}"


def _ratio(v: float | None) -> str:
    return "—" if v is None else f"{v:.2f}"


def active_pairs(engines: Sequence[str]) -> list[tuple[str, str]]:
    """The (native, baseline) pairs whose engines both ran."""
    return [(a, b) for a, b in PAIRS if a in engines and b in engines]


def _died(outcome: dict[str, Any]) -> bool:
    """Whether the engine's processes timed out or exited with an error (not just a primitive failing)."""
    return outcome["status"] == "timed out" or any(outcome["returncodes"])


def build_rows(
    primitives: Sequence[str],
    sizes: Sequence[int],
    engines: Sequence[str],
    measurements: Sequence[dict[str, Any]],
    outcomes: dict[str, dict[str, Any]],
) -> list[dict[str, Any]]:
    """Per primitive and size: every engine's algbw, busbw and time, and the native ratios.

    A size an engine did not measure is "failed" when the engine timed out or died, or
    when it reported an error for that primitive at that size or a smaller one.
    """
    table = {(m["engine"], m["primitive"], m["size"]): m for m in measurements}
    failed_from: dict[tuple[str, str], int] = {}
    for engine, o in outcomes.items():
        for e in o["errors"]:
            key = (engine, e["primitive"])
            failed_from[key] = min(failed_from.get(key, e["size"]), e["size"])
    died = {e for e, o in outcomes.items() if _died(o)}
    rows = []
    for primitive in primitives:
        for size in sizes:
            row: dict[str, Any] = {"primitive": primitive, "size": size, "engines": {}, "ratios": {}}
            for engine in engines:
                m = table.get((engine, primitive, size))
                if m:
                    row["engines"][engine] = {
                        "algbw": m["algbw"],
                        "busbw": m["busbw"],
                        "median_s": m["median_s"],
                        "bytes": m["bytes"],
                    }
                elif engine in died or size >= failed_from.get((engine, primitive), math.inf):
                    row["engines"][engine] = {"status": "failed"}
                else:
                    row["engines"][engine] = {"status": "not run"}
            for native, baseline in active_pairs(engines):
                a, b = table.get((native, primitive, size)), table.get((baseline, primitive, size))
                row["ratios"][f"{native}/{baseline}"] = b["median_s"] / a["median_s"] if a and b else None
            if any("algbw" in e or e["status"] == "failed" for e in row["engines"].values()):
                rows.append(row)
    return rows


def _cells(row: dict[str, Any], engines: Sequence[str]) -> list[str]:
    cells = []
    for engine in engines:
        e = row["engines"][engine]
        if "algbw" in e:
            cells += [_gbps(e["algbw"]), _gbps(e["busbw"])]
        else:
            cells += [e["status"], ""] if e["status"] == "failed" else ["—", "—"]
    cells += [_ratio(row["ratios"].get(f"{a}/{b}")) for a, b in active_pairs(engines)]
    return cells


def markdown_table(primitive: str, rows: Sequence[dict[str, Any]], engines: Sequence[str]) -> list[str]:
    head = ["size"] + [f"{e} {kind}" for e in engines for kind in ("algbw", "busbw")]
    head += [f"{a}/{b}" for a, b in active_pairs(engines)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for row in rows:
        if row["primitive"] == primitive:
            lines.append("| " + " | ".join([format_size(row["size"]), *_cells(row, engines)]) + " |")
    return lines


def print_tables(
    primitives: Sequence[str],
    rows: Sequence[dict[str, Any]],
    engines: Sequence[str],
    n: int,
    outcomes: dict[str, dict[str, Any]],
) -> None:
    for primitive in primitives:
        mine = [r for r in rows if r["primitive"] == primitive]
        if not mine:
            continue
        print(
            f"\n{primitive}: GB/s (busbw = algbw x {FACTOR_TEXT[primitive]} = {bus_factor(primitive, n):.2f}); "
            "ratios: baseline time / native time"
        )
        pairs = active_pairs(engines)
        print(f"{'':>9}" + "".join(f"{e:>18}" for e in engines) + "".join(f"{a + '/':>17}" for a, _ in pairs))
        print(f"{'size':>9}" + f"{'algbw':>9}{'busbw':>9}" * len(engines) + "".join(f"{b:>17}" for _, b in pairs))
        for row in mine:
            cells = _cells(row, engines)
            k = 2 * len(engines)
            print(
                f"{format_size(row['size']):>9}"
                + "".join(f"{c:>9}" for c in cells[:k])
                + "".join(f"{c:>17}" for c in cells[k:])
            )
    for engine, o in outcomes.items():
        if _died(o):
            print(f"\n{engine}: {o['status']}: {o['error']}")
        for e in o["errors"]:
            print(f"\n{engine}: {e['primitive']} failed at {format_size(e['size'])}: {e['error']}")


def device_info(device: str, outcomes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The machine the run measured, with the GPU the workers reported on a GPU run."""
    if device != "gpu":
        return harness.machine.device_info(device)
    names = [o["info"].get("device_name") for o in outcomes.values() if o["info"].get("device_name")]
    return harness.machine.device_info(device, names[0] if names else "unknown GPU")


def write_results(
    out_dir: Path,
    stem: str,
    meta: dict[str, Any],
    outcomes: dict[str, dict[str, Any]],
    rows: Sequence[dict[str, Any]],
    measurements: Sequence[dict[str, Any]],
) -> tuple[Path, Path]:
    """Write ``<stem>.md`` and ``<stem>.json`` to ``out_dir``."""
    n, engines = meta["ranks"], meta["engines"]
    sizes = meta["sizes"]
    md = [
        f"# Bagua collectives: {meta['device']['kind'].upper()}, {n} rank{'s' if n > 1 else ''}",
        "",
        *header_lines(meta),
        (
            f"- ranks: {n}, one process each on this machine; float32 messages of "
            f"{format_size(sizes[0])} to {format_size(sizes[-1])}"
        ),
        (
            f"- timing: {MIN_CALLS} to {MAX_CALLS} calls (~{meta['target_seconds']:g} s) in at most {MAX_BATCHES} "
            "batches, each after a barrier; median time per call over the batches, the largest over the ranks"
        ),
        f"- host memory: {meta['host_memory']}; OMP_NUM_THREADS={meta['omp_num_threads']} per rank",
        f"- total time: {meta['seconds']:.0f} s",
        "",
        "Engines:",
        "",
    ]
    for engine, o in outcomes.items():
        extra = ", ".join(f"{k} {v}" for k, v in o["info"].items() if k not in ("pid", "ranks"))
        md.append(
            f"- `{engine}`: {o['description']}; {o['status']} in {o['seconds']:.0f} s"
            + (f" ({extra})" if extra else "")
            + (f"; error: `{o['error']}`" if _died(o) else "")
        )
        md += [
            f"  - failed: {e['primitive']} at {format_size(e['size'])} "
            f"(reported by rank {', '.join(map(str, sorted(e['ranks'])))}): `{e['error']}`"
            for e in o["errors"]
        ]
    md += [
        "",
        "algbw = S / t and busbw = algbw x factor, as nccl-tests defines them: S is the buffer for allreduce,",
        "broadcast and send_recv and the whole n-block buffer for allgather (output), reduce_scatter (input)",
        "and alltoall; the factor is 2(n-1)/n for allreduce, (n-1)/n for allgather, reduce_scatter and",
        "alltoall, 1 for broadcast and send_recv. GB/s = 1e9 B/s. The ratio columns are time ratios",
        "(baseline time / native time, = native algbw / baseline algbw): above 1 the native engine is faster.",
        "send_recv is a ring exchange (S bytes sent and received per rank; LaxCommunicator's run-time-peer",
        "send_recv is an all_gather). `failed` marks sizes an engine did not reach because it failed.",
    ]
    for primitive in meta["primitives"]:
        if any(r["primitive"] == primitive for r in rows):
            md += [
                "",
                f"## {primitive} (busbw factor {FACTOR_TEXT[primitive]} = {bus_factor(primitive, n):.2f})",
                "",
                *markdown_table(primitive, rows, engines),
            ]
    md.append("")
    payload = {**meta, "engine_outcomes": outcomes, "rows": list(rows), "measurements": list(measurements)}
    return harness.results.write_results(out_dir, stem, md, payload)


# --------------------------------------------------------------------------- command line


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=("cpu", "gpu"), default="cpu", help="cpu (MPI, gloo; default) or gpu (NCCL, one rank)"
    )
    parser.add_argument(
        "--ranks", type=int, default=None, help="processes per engine (default 2 on cpu; gpu runs one rank)"
    )
    parser.add_argument(
        "--sizes",
        type=parse_size,
        nargs="+",
        default=None,
        metavar="SIZE",
        help="message sizes S (e.g. 4K 1M 64M); default: powers of 4 from --min-size to --max-size",
    )
    parser.add_argument("--min-size", type=parse_size, default=MIN_SIZE, help="smallest size (default 4K)")
    parser.add_argument(
        "--max-size",
        type=parse_size,
        default=None,
        help="largest size (default 64M on cpu, 256M on gpu, 256K with --quick)",
    )
    add_subset_option(parser, "--engines", ENGINES, "engines to run (default: all)")
    add_subset_option(parser, "--primitives", PRIMITIVES, "primitives to measure (default: all)")
    parser.add_argument(
        "--target-seconds",
        type=float,
        default=None,
        help=f"timed calls per measurement take about this long (default {TARGET_SECONDS}, "
        f"{QUICK_TARGET_SECONDS} with --quick)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=ENGINE_TIMEOUT_SECONDS,
        help=f"seconds per engine before its processes are killed (default {ENGINE_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument(
        "--comm-timeout",
        type=float,
        default=COMM_TIMEOUT_SECONDS,
        help=f"seconds per collective inside the communicators (default {COMM_TIMEOUT_SECONDS:g})",
    )
    parser.add_argument("--quick", action="store_true", help="smoke run: 4 KiB to 256 KiB, short measurements")
    add_out_option(parser)
    parser.add_argument(
        "--fresh-pages",
        action="store_true",
        help="on cpu, keep glibc's default of unmapping freed large blocks (see retain_freed_memory)",
    )
    parser.add_argument("--worker", choices=ENGINES, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ranks is None:
        args.ranks = 1 if args.device == "gpu" else 2
    if args.device == "gpu" and args.ranks != 1:
        parser.error("--device gpu measures one rank; leave --ranks out or pass --ranks 1")
    if args.ranks < 1:
        parser.error("--ranks must be positive")
    if args.device == "gpu":
        if set(CPU_ONLY) & set(args.engines) and "--engines" in (argv if argv is not None else sys.argv):
            parser.error(f"--device gpu: {', '.join(CPU_ONLY)} run(s) on the CPU only")
        args.engines = [e for e in args.engines if e not in CPU_ONLY]
    if args.target_seconds is None:
        args.target_seconds = QUICK_TARGET_SECONDS if args.quick else TARGET_SECONDS
    if args.sizes is None:
        high = args.max_size or (
            QUICK_MAX_SIZE if args.quick else GPU_MAX_SIZE if args.device == "gpu" else CPU_MAX_SIZE
        )
        args.sizes = default_sizes(args.min_size, high)
    if not args.sizes:
        parser.error("no sizes: --min-size is above --max-size")
    for s in args.sizes:
        for p in args.primitives:
            try:
                element_count(p, s, args.ranks)
            except ValueError as error:
                parser.error(str(error))
    if args.worker and args.result_file is None:
        parser.error("--worker needs --result-file")
    return args


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every engine, print the tables, write the results; return the engines' outcomes."""
    args = parse_args(argv)
    if args.worker:
        run_worker(args)  # does not return
    argv_used = sys.argv[1:] if argv is None else list(argv)
    start = time.perf_counter()
    # The device is filled in once the workers have reported it (the GPU's name).
    meta = run_meta(
        ("jax", "jaxlib", "torch", "numpy"),
        argv=argv_used,
        device={},
        ranks=args.ranks,
        sizes=args.sizes,
        engines=args.engines,
        primitives=args.primitives,
        target_seconds=args.target_seconds,
        calls={"warmup": WARMUP_CALLS, "min": MIN_CALLS, "max": MAX_CALLS, "max_batches": MAX_BATCHES},
        omp_num_threads=os.environ.get("OMP_NUM_THREADS", str(threads_per_rank(args.ranks))),
        engine_timeout_s=args.timeout,
        comm_timeout_s=args.comm_timeout,
        host_memory=(
            "allocator default"
            if args.device == "gpu" or args.fresh_pages
            else "freed blocks retained for reuse (mallopt)"
        ),
    )
    if meta["load_average_before"][0] > 0.5:
        print(
            f"warning: the 1-minute load average is {meta['load_average_before'][0]:.1f}; "
            "other work on this machine will disturb the timings",
            file=sys.stderr,
        )
    print(
        f"{args.device}, {args.ranks} rank(s); engines: {' '.join(args.engines)}; sizes: "
        f"{' '.join(format_size(s) for s in args.sizes)}",
        flush=True,
    )
    outcomes: dict[str, dict[str, Any]] = {}
    measurements: list[dict[str, Any]] = []
    workdir = Path(tempfile.mkdtemp(prefix="bagua-collectives-"))
    try:
        with temporary_job_secret():  # the TCP engine's store's
            for engine in args.engines:
                result = run_engine(engine, args, workdir, start)
                o = result["outcome"]
                outcomes[engine] = o
                measurements += result["measurements"]
                print(
                    f"{time.perf_counter() - start:6.0f}s  {engine}: {o['status']} in {o['seconds']:.0f} s, "
                    f"{len(result['measurements'])} measurements" + (f"; {o['error']}" if o["status"] != "ok" else ""),
                    flush=True,
                )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    meta["seconds"] = time.perf_counter() - start
    finish_meta(meta)
    meta["device"] = device_info(args.device, outcomes)
    rows = build_rows(args.primitives, args.sizes, args.engines, measurements, outcomes)
    print_tables(args.primitives, rows, args.engines, args.ranks, outcomes)
    stem = (
        f"collectives-gpu-{args.ranks}rank{'s' if args.ranks > 1 else ''}"
        if args.device == "gpu"
        else f"collectives-cpu-{args.ranks}rank{'s' if args.ranks > 1 else ''}"
    ) + ("-quick" if args.quick else "")
    paths = write_results(args.out, stem, meta, outcomes, rows, measurements)
    print(f"\ntotal {meta['seconds']:.0f} s; wrote " + " and ".join(str(p) for p in paths))
    return outcomes


if __name__ == "__main__":
    main()

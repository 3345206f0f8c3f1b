"""Starting a Bagua job: ``bagua_torch.init_process_group()``.

Reads the launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, as ``torchrun`` and Bagua's
launcher set them; under ``mpiexec`` or ``srun`` the rank, size and node size may come
from the MPI launcher's variables, read by :mod:`bagua_common.job.rank_environment`)
or takes them as arguments,
initializes ``torch.distributed`` (gloo on CPU, nccl on GPU) and builds the
communicators the algorithms use:

* ``world``: all ranks. The native communicator when available: the MPI engine for CPU
  tensors when the job was started by ``mpiexec`` and bagua was built with MPI, the
  NCCL engine for CUDA tensors when built with NCCL; otherwise a
  :class:`~bagua_torch.ProcessGroupCommunicator` over a process group of its own (so
  Bagua's collectives never interleave with the user's on the default group).
* ``intra`` / ``inter`` for hierarchical algorithms, when the job spans several nodes
  with several ranks each (``1 < LOCAL_WORLD_SIZE < WORLD_SIZE``). Ranks are laid out
  node by node: world rank ``r`` is local rank ``r % LOCAL_WORLD_SIZE`` of node
  ``r // LOCAL_WORLD_SIZE``.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bagua_common.comm.timeout import timeout_seconds
from bagua_common.comm.topology import Communicators
from bagua_common.fault_tolerance.settings import ENV_FAULT_TOLERANCE, ENV_JOIN
from bagua_common.job.rank_environment import environment_int, started_by_mpi
from bagua_torch.communicator import (
    Communicator,
    NativeCommunicator,
    ProcessGroupCommunicator,
)


@dataclass
class BaguaProcessGroup:
    """A group of the job's ranks, its communicators, and where this process sits in the job.

    :func:`init_process_group` makes the job's world group (the default, see the module
    docstring); :func:`new_group` and :func:`from_torch_group` groups of some ranks. ``ranks`` are
    the members' job ranks, in order; ``communicators`` is None on a rank that is not a member.
    ``rank``, ``size``, ``local_rank``, ``local_size`` and ``device`` are this process's place in
    the job. ``native`` tells whether the world communicator is a
    :class:`~bagua_torch.NativeCommunicator`; ``backend`` is the ``torch.distributed`` backend
    (None if ``torch.distributed`` was not initialized, which happens only for a native MPI job
    without ``MASTER_ADDR``).
    """

    communicators: Communicators | None
    rank: int
    size: int
    local_rank: int
    local_size: int
    device: torch.device
    backend: str | None
    native: bool
    store: Any = None
    ranks: Sequence[int] = ()
    name: str = "default"
    fault_tolerance: Any = None
    """The :class:`~bagua_torch.fault_tolerance.FaultTolerance` of a fault-tolerant job (its members, the
    training loop's steps), else None."""

    def __post_init__(self) -> None:
        self.ranks: list[int] = list(self.ranks) or list(range(self.size))

    @property
    def world(self) -> Communicator:
        return self.communicators.world

    def use(self, world: Communicator) -> None:
        """Make ``world`` this group's communicator, its rank and size (a fault-tolerant job's epoch changed, or
        joiners sit out a DiLoCo round outside the loop: its collectives span the members training it)."""
        self.communicators, self.rank, self.size = Communicators(world), world.rank, world.size

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_size

    @property
    def num_nodes(self) -> int:
        return self.size // self.local_size

    def close(self) -> None:
        """Release native communicators (torch.distributed itself is left alone)."""
        seen = set()
        for comm in self.communicators or ():
            if isinstance(comm, NativeCommunicator) and id(comm) not in seen:
                seen.add(id(comm))
                comm.close()


_default: BaguaProcessGroup | None = None
_GROUP_NUMBERS = itertools.count(1)


def _argument_or_environment(name: str, value: Any, key: str) -> int | None:
    """``value`` if given, else the launcher's variable ``key`` (or, under MPI, its launcher's value of it)."""
    if value is None:
        return environment_int(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"init_process_group: {name} must be an int, got {value!r}")
    return value


def _destroy_at_exit(world: dist.ProcessGroup) -> None:
    """At exit: destroy torch.distributed's groups if ``world``, made by :func:`init_process_group`, is the default.

    A gloo group left for the interpreter's finalization aborts the process ("terminate called
    without an active exception") when one of its worker threads drops the last reference to a
    collective's tensors then: releasing them needs the GIL of a finalizing interpreter. DCP's
    own collectives on the default group leave such references. Destroying the groups here, while
    the interpreter is alive, ends those threads first (it does not wait for a peer, live or gone).
    """
    if dist.is_initialized() and dist.group.WORLD is world:
        dist.destroy_process_group()


def init_process_group(
    backend: str | None = None,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
    master_addr: str | None = None,
    master_port: int | None = None,
    timeout: float | timedelta | None = None,
    native: bool | None = None,
    fault_tolerance: bool | None = None,
) -> BaguaProcessGroup:
    """Initialize the job (every process calls it once, before wrapping models) and return its communicators.

    * ``backend``: ``"gloo"`` or ``"nccl"`` for ``torch.distributed``; default nccl when CUDA
      is available, else gloo. With nccl the current CUDA device becomes ``local_rank``.
    * ``rank``, ``world_size``, ``local_rank``, ``local_world_size``, ``master_addr``,
      ``master_port``: default to the environment variables of the same names in upper case
      (under an MPI launcher, its variables fill in ``rank``, ``world_size`` and
      ``local_world_size``; ``local_world_size`` defaults to ``world_size``: one node).
    * ``timeout``: seconds (or a ``timedelta``) after which a collective that does not
      complete raises instead of hanging; default ``BAGUA_COMM_TIMEOUT`` or 300.
    * ``native``: None uses the native engine when available (MPI under ``mpiexec`` for
      CPU, NCCL for GPU), True requires it, False never uses it.
    * ``fault_tolerance``: True starts a job that survives a lost rank without a restart (default
      ``BAGUA_FAULT_TOLERANCE=1``; with ``BAGUA_FT_JOIN=1`` this process joins a running one): the
      group's ``fault_tolerance`` runs the training loop (:mod:`bagua_torch.fault_tolerance`). It uses
      ``torch.distributed``'s gloo or nccl groups of its own, never the native engines, and does not
      initialize ``torch.distributed``'s default group.

    If ``torch.distributed`` is already initialized it is reused (its rank and size must
    match). The result is also kept as the default for :func:`bagua_torch.with_bagua`
    (see :func:`get_process_group`).
    """
    global _default
    if _default is not None:
        raise RuntimeError("bagua_torch.init_process_group() was already called in this process")
    if backend is not None and backend not in ("gloo", "nccl"):
        raise ValueError(f"init_process_group: backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if native is not None and not isinstance(native, bool):
        raise TypeError(f"init_process_group: native must be None or a bool, got {native!r}")
    seconds = timeout_seconds(timeout)
    if fault_tolerance is None:
        fault_tolerance = os.environ.get(ENV_FAULT_TOLERANCE) == "1" or os.environ.get(ENV_JOIN) == "1"
    if fault_tolerance:
        if native:
            raise ValueError("init_process_group: fault tolerance runs over gloo/nccl groups, not the native engines")
        _default = _fault_tolerant_group(backend, rank, world_size, master_addr, master_port, seconds)
        return _default

    rank = _argument_or_environment("rank", rank, "RANK")
    world_size = _argument_or_environment("world_size", world_size, "WORLD_SIZE")
    if rank is None or world_size is None:
        raise ValueError(
            "init_process_group: the rank and world size are unknown; set RANK and WORLD_SIZE (a launcher such as "
            "torchrun does) or pass rank= and world_size="
        )
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"init_process_group: need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    local_world_size = _argument_or_environment("local_world_size", local_world_size, "LOCAL_WORLD_SIZE")
    local_world_size = world_size if local_world_size is None else local_world_size
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(
            f"init_process_group: local_world_size={local_world_size} must divide world_size={world_size} "
            "(the same number of ranks on every node)"
        )
    local_rank = _argument_or_environment("local_rank", local_rank, "LOCAL_RANK")
    expected_local = rank % local_world_size
    if local_rank is None:
        local_rank = expected_local
    elif local_rank != expected_local:
        raise ValueError(
            f"init_process_group: local_rank={local_rank} does not fit rank={rank} with local_world_size="
            f"{local_world_size}; ranks must be laid out node by node (local rank = rank % local_world_size)"
        )

    if backend is None and dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend())  # reuse the user's torch.distributed as it is
    use_cuda = backend == "nccl" if backend is not None else torch.cuda.is_available()
    backend = backend or ("nccl" if use_cuda else "gloo")
    if use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("init_process_group: backend 'nccl' needs CUDA, and torch sees no GPU")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")

    from bagua_torch.ops import build_info

    info = build_info()
    engine = "nccl" if use_cuda else "mpi"
    engine_ready = bool(info.get(engine)) and (use_cuda or started_by_mpi())
    if native and not engine_ready:
        raise RuntimeError(
            f"init_process_group(native=True): the native {engine.upper()} engine is not usable here "
            + ("(bagua was built without it)" if not info.get(engine) else "(start the job with mpiexec)")
        )
    use_native = engine_ready if native is None else native

    master_addr = master_addr if master_addr is not None else os.environ.get("MASTER_ADDR")
    master_port = _argument_or_environment("master_port", master_port, "MASTER_PORT")
    store = None
    if dist.is_available() and dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise ValueError(
                f"init_process_group: torch.distributed is already initialized as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, not rank {rank} of {world_size}"
            )
        backend = str(dist.get_backend())
    elif master_addr is None or master_port is None:
        if not (use_native and engine == "mpi"):
            raise ValueError(
                "init_process_group: MASTER_ADDR and MASTER_PORT are not set; set them (a launcher such as torchrun "
                "does) or pass master_addr= and master_port="
            )
        backend = None  # a pure MPI job: the native engine alone
    else:
        store = dist.TCPStore(
            master_addr, master_port, world_size, is_master=rank == 0, timeout=timedelta(seconds=max(seconds, 30))
        )
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=max(seconds, 30))
        )
        atexit.register(_destroy_at_exit, dist.group.WORLD)

    if use_native and engine == "nccl" and store is None:
        if native:
            raise RuntimeError(
                "init_process_group(native=True): torch.distributed was initialized elsewhere, so there is no store "
                "to share the NCCL id through; let init_process_group initialize torch.distributed"
            )
        use_native = False  # fall back to the torch.distributed nccl group

    num_nodes = world_size // local_world_size
    two_levels = local_world_size > 1 and num_nodes > 1
    if use_native:
        if engine == "mpi":
            world: Communicator = NativeCommunicator.mpi_world(timeout=seconds, name="bagua")
            if (world.rank, world.size) != (rank, world_size):
                raise RuntimeError(
                    f"init_process_group: MPI says this is rank {world.rank} of {world.size}, but the job is "
                    f"configured as rank {rank} of {world_size}"
                )
        else:
            world = NativeCommunicator.from_store(
                dist.PrefixStore("bagua", store), rank, world_size, timeout=seconds, name="bagua", device=device
            )
        intra = inter = None
        if two_levels:
            node, local = rank // local_world_size, rank % local_world_size
            # One thread for the three: a two-level pipeline issues on both levels without a second hop.
            intra = world.split(node, local, name=f"bagua/intra{node}", share_thread=True)
            inter = world.split(local, node, name=f"bagua/inter{local}", share_thread=True)
    else:
        group = dist.new_group(backend=backend, timeout=timedelta(seconds=max(seconds, 30)))
        world = ProcessGroupCommunicator(group, timeout=seconds, name="bagua")
        intra = inter = None
        if two_levels:
            nodes = [list(range(n * local_world_size, (n + 1) * local_world_size)) for n in range(num_nodes)]
            locals_ = [list(range(l, world_size, local_world_size)) for l in range(local_world_size)]
            intra_group, _ = dist.new_subgroups_by_enumeration(nodes, backend=backend)
            inter_group, _ = dist.new_subgroups_by_enumeration(locals_, backend=backend)
            intra = ProcessGroupCommunicator(
                intra_group, timeout=seconds, name=f"bagua/intra{rank // local_world_size}"
            )
            inter = ProcessGroupCommunicator(inter_group, timeout=seconds, name=f"bagua/inter{rank % local_world_size}")

    _default = BaguaProcessGroup(
        communicators=Communicators(world, intra, inter),
        rank=rank,
        size=world_size,
        local_rank=local_rank,
        local_size=local_world_size,
        device=device,
        backend=backend,
        native=use_native,
        store=store,
    )
    return _default


def _fault_tolerant_group(
    backend: str | None,
    rank: int | None,
    world_size: int | None,
    master_addr: str | None,
    master_port: int | None,
    seconds: float,
) -> BaguaProcessGroup:
    """Start or join a fault-tolerant job (see :mod:`bagua_torch.fault_tolerance`): the group of its first epoch."""
    from bagua_torch.fault_tolerance import start_fault_tolerance

    master_addr = master_addr if master_addr is not None else os.environ.get("MASTER_ADDR")
    master_port = _argument_or_environment("master_port", master_port, "MASTER_PORT")
    if master_addr is None or master_port is None:
        raise ValueError("init_process_group: a fault-tolerant job needs MASTER_ADDR and MASTER_PORT (or master_addr=)")
    use_cuda = backend == "nccl" if backend is not None else torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    job = start_fault_tolerance(
        _argument_or_environment("rank", rank, "RANK"),
        _argument_or_environment("world_size", world_size, "WORLD_SIZE"),
        master_addr,
        master_port,
        "nccl" if use_cuda else "gloo",
        device,
        seconds,
    )
    group = BaguaProcessGroup(
        communicators=job.communicators,
        rank=0 if job.epoch is None else job.epoch.rank,
        size=1 if job.epoch is None else job.epoch.size,
        local_rank=0,
        local_size=1,
        device=device,
        backend=job.backend,
        native=False,
        fault_tolerance=job,
    )
    job.group = group
    return group


def is_initialized() -> bool:
    """Whether :func:`init_process_group` has been called in this process."""
    return _default is not None


def get_process_group() -> BaguaProcessGroup:
    """The job's communicators from :func:`init_process_group` (a RuntimeError if it has not been called)."""
    if _default is None:
        raise RuntimeError("call bagua_torch.init_process_group() first")
    return _default


def new_group(ranks: Sequence[int] | None = None) -> BaguaProcessGroup:
    """A group of the job's ``ranks`` (default all); collective: every rank of the job calls it, in the same order.

    Its communicator splits the native world communicator, or is a new ``torch.distributed``
    group; on ranks outside the group ``communicators`` is None.
    """
    job = get_process_group()
    ranks = sorted(range(job.size) if ranks is None else (int(r) for r in ranks))
    for r in ranks:
        if not 0 <= r < job.size:
            raise ValueError(f"new_group: invalid rank {r}, should be non-negative and less than world size {job.size}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"new_group: ranks repeat: {ranks}")
    name = f"bagua/group{next(_GROUP_NUMBERS)}"
    member = job.rank in ranks
    if isinstance(job.world, NativeCommunicator):
        child = job.world.split(0 if member else 1, job.rank, name=name)
        if not member:
            child.close()
        communicators = Communicators(child) if member else None
    else:
        torch_group = dist.new_group(ranks)
        communicators = Communicators(ProcessGroupCommunicator(torch_group, name=name)) if member else None
    return dataclasses.replace(job, communicators=communicators, store=None, ranks=ranks, name=name)


def from_torch_group(group: dist.ProcessGroup) -> BaguaProcessGroup:
    """The group of a ``torch.distributed`` group's ranks, communicating over that group (this rank is a member)."""
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"from_torch_group: expected a torch.distributed ProcessGroup, got {type(group).__name__}")
    name = f"bagua/torch-group{next(_GROUP_NUMBERS)}"
    communicators = Communicators(ProcessGroupCommunicator(group, name=name))
    ranks = dist.get_process_group_ranks(group)
    return dataclasses.replace(get_process_group(), communicators=communicators, store=None, ranks=ranks, name=name)


def fault_tolerance_of(process_group: Any) -> Any:
    """The :class:`~bagua_torch.fault_tolerance.FaultTolerance` of ``process_group`` (None: the default group),
    or None when it is not a fault-tolerant job's group."""
    group = _default if process_group is None else process_group
    return group.fault_tolerance if isinstance(group, BaguaProcessGroup) else None


def communicators_from(process_group: Any) -> Communicators:
    """Turn what a user may pass as ``process_group`` into :class:`Communicators`.

    Accepts None (the default from :func:`init_process_group`; failing that, when only
    ``torch.distributed`` is initialized, a new process group of all ranks, created
    collectively), a :class:`BaguaProcessGroup`, a :class:`Communicators`, a single
    communicator (flat), or a ``torch.distributed`` process group.
    """
    if process_group is None:
        if _default is not None:
            return _default.communicators
        if dist.is_available() and dist.is_initialized():
            return Communicators(ProcessGroupCommunicator(dist.new_group(), name="bagua"))
        raise RuntimeError(
            "no process group: call bagua_torch.init_process_group() (or torch.distributed.init_process_group()) "
            "before wrapping a model, or pass process_group="
        )
    if isinstance(process_group, BaguaProcessGroup):
        if process_group.communicators is None:
            raise ValueError(f"this rank is not a member of process group {process_group.name!r} {process_group.ranks}")
        return process_group.communicators
    if isinstance(process_group, Communicators):
        return process_group
    if isinstance(process_group, dist.ProcessGroup):
        return Communicators(ProcessGroupCommunicator(process_group))
    if isinstance(process_group, Communicator):
        return Communicators(process_group)
    raise TypeError(
        "process_group must be None, a bagua_torch BaguaProcessGroup, Communicators or Communicator, or a "
        f"torch.distributed ProcessGroup; got {type(process_group).__name__}"
    )

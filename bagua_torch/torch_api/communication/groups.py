"""Bagua's process groups and communicator handles, on the project's :class:`bagua_torch.job.BaguaProcessGroup`.

The group is the project's (one class, one default group: the job's, from
:func:`bagua_torch.init_process_group`); this module adds Bagua's spelling: the
``get_*_communicator()`` methods, which return :class:`CommunicatorHandle` objects with Bagua's
``rank()`` and ``nranks()``, and Bagua's functions to make groups. Where Bagua differs:
:func:`init_process_group` starts no autotuning HTTP service (Bagua's listened on every
interface, ``0.0.0.0``); :func:`from_torch_group` reuses the torch group itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from bagua_common.comm.topology import Communicators
from bagua_torch import job
from bagua_torch.communicator import Communicator

__all__ = [
    "BaguaProcessGroup",
    "CommMember",
    "CommunicatorHandle",
    "from_torch_group",
    "get_default_group",
    "group_of",
    "init_process_group",
    "is_initialized",
    "new_group",
]


class CommunicatorHandle:
    """What Bagua calls a communicator (``BaguaSingleCommunicatorPy``): ``rank()``, ``nranks()``.

    ``communicator`` is the project's :class:`~bagua_torch.communicator.Communicator` underneath,
    and ``global_ranks`` the job ranks of its members in order.
    """

    def __init__(self, communicator: Communicator, global_ranks: Sequence[int]):
        self.communicator = communicator
        self.global_ranks = list(global_ranks)

    def rank(self) -> int:
        """This process's index in the communicator."""
        return self.communicator.rank

    def nranks(self) -> int:
        """The number of ranks in the communicator."""
        return self.communicator.size

    def __repr__(self) -> str:
        return f"CommunicatorHandle(rank={self.rank()}, nranks={self.nranks()}, ranks={self.global_ranks})"


class CommMember:
    """Bagua's markers: ``WORLD`` (the default group's communicator) and ``NON_COMM_MEMBER``."""

    WORLD = object()
    NON_COMM_MEMBER = object()


class BaguaProcessGroup(job.BaguaProcessGroup):
    """The project's process group with Bagua's methods (Bagua's ``BaguaProcessGroup``).

    On ranks outside the group ``get_*_communicator()`` return :attr:`CommMember.NON_COMM_MEMBER`
    (collectives on it return at once). The inter- and intra-node communicators exist when the
    group is the job's world on several nodes with several ranks each; on one node the intra-node
    communicator is the global one.
    """

    @property
    def group_name(self) -> str:
        """The group's name."""
        return self.name

    def _handle(self, comm: Communicator | None, ranks: Sequence[int], which: str) -> Any:
        if self.communicators is None:
            return CommMember.NON_COMM_MEMBER
        if comm is None:
            raise ValueError(
                f"process group {self.name!r} has no {which} communicator: it exists for the job's world on "
                "several nodes with several ranks each"
            )
        return CommunicatorHandle(comm, ranks)

    def get_global_communicator(self) -> Any:
        """The communicator of every rank of the group."""
        world = None if self.communicators is None else self.communicators.world
        return self._handle(world, self.ranks, "global")

    def get_intra_node_communicator(self) -> Any:
        """The communicator of the group's ranks on this node."""
        if self.communicators is None:
            return CommMember.NON_COMM_MEMBER
        if self.communicators.intra is None and len(self.ranks) <= self.local_size:
            return self.get_global_communicator()
        mine = [r for r in self.ranks if r // self.local_size == self.node_rank]
        return self._handle(self.communicators.intra, mine, "intra-node")

    def get_inter_node_communicator(self) -> Any:
        """The communicator of the group's ranks with this rank's local index, one per node."""
        ranks = [r for r in self.ranks if r % self.local_size == self.local_rank]
        inter = None if self.communicators is None else self.communicators.inter
        return self._handle(inter, ranks, "inter-node")

    def __repr__(self) -> str:
        return f"BaguaProcessGroup(name={self.name!r}, ranks={list(self.ranks)})"


def _with_bagua_methods(group: job.BaguaProcessGroup) -> BaguaProcessGroup:
    return BaguaProcessGroup(**{f.name: getattr(group, f.name) for f in dataclasses.fields(group)})


def group_of(communicators: Communicators, device: torch.device) -> BaguaProcessGroup:
    """The group over ``communicators`` (a wrapped model's), as Bagua's algorithms see their ``process_group``."""
    world = communicators.world
    if job.is_initialized():
        place = job.get_process_group()
        return dataclasses.replace(
            _with_bagua_methods(place), communicators=communicators, store=None, ranks=range(world.size), name="model"
        )
    return BaguaProcessGroup(communicators, world.rank, world.size, world.rank, world.size, device, None, False)


def init_process_group(
    store: dist.Store | None = None, rank: int = -1, world_size: int = -1, local_world_size: int = -1
) -> None:
    """Start the job (Bagua's signature): every process calls it once, before the other APIs.

    Without ``store``, the rank and sizes come from the launcher's environment (``RANK``,
    ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) or from ``rank``,
    ``world_size`` and ``local_world_size`` where those are given (not -1). With ``store`` (a
    ``torch.distributed.Store`` every rank can reach) all three are required, as in Bagua.
    Delegates to :func:`bagua_torch.init_process_group` (gloo on CPU, nccl on GPU, the native
    engines where available).
    """
    if job.is_initialized():
        raise RuntimeError("trying to initialize the default process group twice!")
    given = {"rank": rank, "world_size": world_size, "local_world_size": local_world_size}
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"init_process_group: {key} must be an int, got {value!r}")
    if store is not None:
        if rank < 0 or world_size <= 0 or local_world_size <= 0:
            raise ValueError("init_process_group: with a store, rank, world_size and local_world_size are required")
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    job.init_process_group(**{key: value for key, value in given.items() if value > 0 or (key, value) == ("rank", 0)})


def is_initialized() -> bool:
    """Whether :func:`init_process_group` has been called."""
    return job.is_initialized()


def get_default_group() -> BaguaProcessGroup:
    """The job's world group (Bagua's ``_get_default_group``, which its examples use)."""
    if not job.is_initialized():
        raise RuntimeError(
            "Default process group has not been initialized, please make sure to call init_process_group."
        )
    return _with_bagua_methods(job.get_process_group())


def new_group(ranks: Sequence[int] | None = None, stream: Any = None) -> BaguaProcessGroup:
    """A group of ``ranks`` (default all), created collectively: every rank of the job calls it, in the same order.

    ``stream`` is accepted for Bagua's signature; collectives run on the communicator's own stream.
    """
    get_default_group()
    return _with_bagua_methods(job.new_group(ranks))


def from_torch_group(group: dist.ProcessGroup, stream: Any = None) -> BaguaProcessGroup:
    """The Bagua group of a ``torch.distributed`` group (its ranks, communicating over that group)."""
    get_default_group()
    return _with_bagua_methods(job.from_torch_group(group))

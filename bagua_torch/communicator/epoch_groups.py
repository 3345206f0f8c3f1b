"""Process groups of a fault-tolerant job's epoch, built on the coordinator's store (not torch.distributed's registry).

Every communicator of an epoch (the world, a dedicated one for a background thread, the pair that
sends a joiner the state) is a ``ProcessGroup`` holding a gloo (or NCCL) backend made on the
epoch's store under its own prefix; its waits give up with ``MembershipChanged`` once the epoch
closes. Such groups are never destroyed (:func:`_never_destroy`, as each is made): one may hold an abandoned
operation, and a thread may still be using one (the state sent in the background) when its epoch is left.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Collection
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from bagua_common.fault_tolerance import Epoch, MembershipChanged, StoreClient, StoreUnreachable
from bagua_common.fault_tolerance.background import get_unless, in_background, wait_unless
from bagua_torch.communicator.process_group_communicator import ProcessGroupCommunicator
from bagua_torch.communicator.protocol import CommunicationError

__all__ = ["epoch_communicator", "pair_communicator", "solo_communicator", "trainers_communicator"]


class _StoreForTorch(dist.Store):
    """A member's :class:`~bagua_common.fault_tolerance.StoreClient` as a ``torch.distributed`` store (for gloo's and
    NCCL's rendezvous)."""

    def __init__(self, client: StoreClient, timeout: float, closed: threading.Event):
        super().__init__()
        self._client, self._timeout, self._closed = client, timeout, closed

    def _call(self, operation: Callable[[], Any]) -> Any:
        try:
            return operation()
        except StoreUnreachable as error:  # the coordinator is gone: so is its epoch
            raise MembershipChanged(f"the group was not made: {error}") from error

    def set(self, key: str, value: Any) -> None:
        self._call(lambda: self._client.set(key, bytes(value) if not isinstance(value, str) else value))

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting for it; MembershipChanged once the epoch closes (a member died while the
        group was being made) or its coordinator's store is gone."""
        why = f"the group was not made: the members changed while waiting for {key!r}"
        value = self._call(lambda: get_unless(self._client, key, self._timeout, self._closed, why))
        if value is None:
            raise RuntimeError(f"fault tolerance: the store key {key!r} was not set within {self._timeout:g} s")
        return value

    def add(self, key: str, amount: int) -> int:
        return self._call(lambda: self._client.add(key, amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call(lambda: self._client.compare_set(key, expected, desired))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        for key in keys:
            self.get(key)

    def check(self, keys: list[str]) -> bool:
        return all(self._call(lambda key=key: self._client.check(key)) is not None for key in keys)

    def delete_key(self, key: str) -> bool:
        return self._call(lambda: self._client.delete(key))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout.total_seconds()

    def num_keys(self) -> int:  # torch requires the method; gloo and NCCL never count keys
        raise RuntimeError("the fault-tolerance store does not count its keys")


def epoch_communicator(
    epoch: Epoch, purpose: str, backend: str, device: torch.device, timeout: float
) -> ProcessGroupCommunicator:
    """A communicator of ``epoch``'s members (collective: every member makes it), named ``purpose``; its waits give
    up with MembershipChanged when the epoch closes. Dedicated communicators made from it
    (:func:`~bagua_torch.communicator.dedicated_communicator`) are further groups of the same epoch."""
    comm = _group_on_store(epoch, purpose, epoch.rank, epoch.size, backend, timeout)
    comm.dedicated = lambda name: epoch_communicator(epoch, f"{purpose}/{name}", backend, device, timeout)
    return comm


def _group_on_store(
    epoch: Epoch, purpose: str, rank: int, size: int, backend: str, timeout: float
) -> ProcessGroupCommunicator:
    """A gloo or NCCL group of ``size`` ranks made on ``epoch``'s store under the prefix of ``purpose``."""
    assert epoch.store is not None
    adapter = _StoreForTorch(epoch.store, timeout, epoch.failed)
    store = dist.PrefixStore(epoch.prefix(purpose), adapter)
    # torch.distributed's collectives take a ProcessGroup holding the backend (as new_group builds it)
    group = dist.ProcessGroup(store, rank, size)
    _never_destroy(group)
    if backend == "nccl":
        kind, device = dist.ProcessGroup.BackendType.NCCL, torch.device("cuda")
        engine: Any = _connect(
            epoch, purpose, lambda: dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
        )
    else:
        kind, device = dist.ProcessGroup.BackendType.GLOO, torch.device("cpu")
        engine = _connect(epoch, purpose, lambda: dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout)))
    group._set_default_backend(kind)
    group._register_backend(device, kind, engine)
    comm = ProcessGroupCommunicator(group, timeout=timeout, name=f"ft{epoch.number}/{purpose}", abandon=epoch.failed)
    comm.store_in_use = adapter  # torch keeps only the C++ side: the Python methods must outlive the group
    return comm


def _connect(epoch: Epoch, purpose: str, make_backend: Callable[[], Any]) -> Any:
    """``make_backend()`` run on a thread, given up with MembershipChanged once ``epoch`` fails: a member that dies
    after the rendezvous leaves the others in the backend's connect, which only its timeout would end."""
    connecting = in_background(make_backend, f"bagua-ft-connect-{epoch.number}")
    try:
        return wait_unless(
            connecting, epoch.failed, f"the group {purpose!r} was not made: the members changed while it connected"
        )
    except MembershipChanged:
        raise
    except RuntimeError as error:  # a member gone while the group connected
        raise CommunicationError(f"the group {purpose!r} of epoch {epoch.number} could not connect: {error}") from error


def pair_communicator(
    epoch: Epoch, holder_rank: int, joiner_rank: int, backend: str, timeout: float, purpose: str = "transfer"
) -> ProcessGroupCommunicator:
    """A group of the member ``holder_rank`` that sends the job's state (rank 0 in it) and the joiner
    ``joiner_rank`` that receives it (rank 1), for ``purpose`` (one group per purpose and joiner)."""
    rank = 0 if epoch.rank == holder_rank else 1
    return _group_on_store(epoch, f"{purpose}/{joiner_rank}", rank, 2, backend, timeout)


def trainers_communicator(
    epoch: Epoch, sitting_out: Collection[int], backend: str, timeout: float
) -> ProcessGroupCommunicator:
    """A group of ``epoch``'s members but those ``sitting_out`` (collective over them: each made it), ranked by
    :meth:`~bagua_common.fault_tolerance.Epoch.training_place`: the training loop's own collectives while joiners sit
    out a DiLoCo round inside its exchange."""
    rank, size = epoch.training_place(sitting_out)
    return _group_on_store(epoch, f"trainers/{','.join(map(str, sorted(sitting_out)))}", rank, size, backend, timeout)


def solo_communicator(timeout: float) -> ProcessGroupCommunicator:
    """This process alone (a model wraps without collectives before its job's loop starts)."""
    group = dist.ProcessGroup(dist.HashStore(), 0, 1)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    engine = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=timeout))
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, engine)
    comm = ProcessGroupCommunicator(group, timeout=timeout, name="alone")
    comm.dedicated = lambda purpose: solo_communicator(timeout)
    return comm


def _never_destroy(group: Any) -> None:
    """Keep ``group`` alive for the process's life: an epoch's groups may hold abandoned operations (gloo cannot
    cancel them), and destroying a gloo group with an operation pending throws from its threads, which aborts the
    process. A group costs a few threads and sockets; a job leaks one set per change of members."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))

"""The communicator protocol for PyTorch: the methods every communicator has, and its errors.

The methods and their semantics are those of :mod:`bagua_jax.communicator`, on
torch tensors: shapes are per rank; where a method moves one block per rank, the
blocks lie along the leading dimension; ``reduce`` and ``gather`` give zeros off
the root; every method returns a new tensor and never writes into its input.
Results are bit-identical across ranks wherever every rank receives the same
value. ``rank`` is a plain ``int`` here, counts and peers are lists of ints, and
``barrier()`` takes no tensor.

Each collective also has an ``<name>_async`` variant that issues it and returns a
:class:`Work` handle at once; ``wait()`` returns the result. Collectives are
issued in call order on every rank (sync and async alike), so PyTorch can overlap
communication with the backward pass as long as every rank issues the same
sequence. As with ``torch.distributed``, do not modify an asynchronous
collective's input before its ``wait()`` returns.

:class:`~bagua_torch.communicator.ProcessGroupCommunicator` runs over a
``torch.distributed`` process group (gloo on CPU, nccl on GPU);
:class:`~bagua_torch.communicator.NativeCommunicator` runs over Bagua's native engines
through DLPack (``_bagua_mpi`` for CPU tensors, ``_bagua_nccl`` for CUDA tensors). A peer that
dies, or a collective that never completes, raises
:class:`CommunicationError` on the surviving ranks within the communicator's
timeout (default ``BAGUA_COMM_TIMEOUT`` or 300 seconds) instead of hanging.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from bagua_common.comm.collectives import REDUCE_OPS as REDUCE_OPS  # the communicators' checks import it from here
from bagua_common.comm.collectives import Collectives, ReduceOp

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.uint8,
    torch.int32,
    torch.int64,
)
"""The element types every communicator carries (the native engines' set)."""

SUPPORTED_FLOATS: tuple[torch.dtype, ...] = tuple(d for d in SUPPORTED_DTYPES if d.is_floating_point)
"""The floating-point types among them: what the full-precision algorithms average."""


class CommunicationError(RuntimeError):
    """A collective failed or did not complete within the communicator's timeout.

    The message names the communicator, the operation and this rank. After such an
    error the communicator (and, for a process group, the group) should be
    considered unusable: peers may be dead or out of step.
    """


@runtime_checkable
class Work(Protocol):
    """The handle of an asynchronous collective."""

    def wait(self) -> torch.Tensor | None:
        """Block until the collective is done (or fails) and return its result.

        For CUDA tensors this orders the caller's current stream after the
        communication rather than synchronizing the host with the device. Calling it
        again returns the same tensor. ``barrier_async`` yields ``None``.
        """

    def is_completed(self) -> bool:
        """Whether the collective has finished, without blocking."""


@runtime_checkable
class Communicator(Collectives[torch.Tensor], Protocol):
    """Collectives among ``size`` ranks on torch tensors (see :class:`bagua_common.comm.collectives.Collectives`); see
    the module docstring."""

    @property
    def rank(self) -> int:
        """This process's index among the ranks."""

    def alltoall_v(
        self, x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], out_size: int
    ) -> torch.Tensor:
        """Variable all-to-all on 1-D ``x``: ``send_counts[j]`` leading elements (packed in rank
        order) go to rank j; the result has ``out_size`` elements, the ``recv_counts[j]`` from
        rank j packed in rank order, then zeros. Counts must agree across ranks."""

    def send_recv(self, x: torch.Tensor, peers: Sequence[int]) -> torch.Tensor:
        """Send ``x`` to each rank in ``peers`` and return ``[len(peers), *x.shape]`` where row i
        came from ``peers[i]``. Peers must be symmetric: if rank r lists q, q lists r as often."""

    def barrier(self) -> None:
        """Return once every rank has reached this point."""

    def allreduce_async(self, x: torch.Tensor, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`allreduce`; ``wait()`` returns its result."""

    def reduce_async(self, x: torch.Tensor, root: int, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`reduce`; ``wait()`` returns its result."""

    def broadcast_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`broadcast`; ``wait()`` returns its result."""

    def reduce_scatter_async(self, x: torch.Tensor, op: ReduceOp = "sum") -> Work:
        """Issue :meth:`reduce_scatter`; ``wait()`` returns its result."""

    def allgather_async(self, x: torch.Tensor) -> Work:
        """Issue :meth:`allgather`; ``wait()`` returns its result."""

    def gather_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`gather`; ``wait()`` returns its result."""

    def scatter_async(self, x: torch.Tensor, root: int) -> Work:
        """Issue :meth:`scatter`; ``wait()`` returns its result."""

    def alltoall_async(self, x: torch.Tensor) -> Work:
        """Issue :meth:`alltoall`; ``wait()`` returns its result."""

    def alltoall_v_async(
        self, x: torch.Tensor, send_counts: Sequence[int], recv_counts: Sequence[int], out_size: int
    ) -> Work:
        """Issue :meth:`alltoall_v`; ``wait()`` returns its result."""

    def send_recv_async(self, x: torch.Tensor, peers: Sequence[int]) -> Work:
        """Issue :meth:`send_recv`; ``wait()`` returns its result."""

    def barrier_async(self) -> Work:
        """Issue :meth:`barrier`; ``wait()`` returns ``None``."""


class DoneWork:
    """A :class:`Work` that is already complete and returns ``result`` (nothing to communicate)."""

    def __init__(self, result: torch.Tensor | None = None):
        self._result = result

    def wait(self) -> torch.Tensor | None:
        return self._result

    def is_completed(self) -> bool:
        return True

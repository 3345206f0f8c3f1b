"""Bagua's collectives (``bagua.torch_api.communication``), written into ``recv`` as Bagua writes them.

See :mod:`bagua_torch.torch_api.communication` for what they do and where they differ from Bagua's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from bagua_common.comm.collectives import REDUCE_OPS, ReduceOp
from bagua_torch.communicator import ProcessGroupCommunicator
from bagua_torch.torch_api.communication.groups import (
    BaguaProcessGroup,
    CommMember,
    CommunicatorHandle,
    get_default_group,
)

__all__ = [
    "BAGUA_OP_VALUES",
    "ReduceOp",
    "allgather",
    "allgather_inplace",
    "allreduce",
    "allreduce_inplace",
    "alltoall",
    "alltoall_inplace",
    "alltoall_v",
    "alltoall_v_inplace",
    "barrier",
    "broadcast",
    "gather",
    "gather_inplace",
    "recv",
    "reduce",
    "reduce_inplace",
    "reduce_scatter",
    "reduce_scatter_inplace",
    "scatter",
    "scatter_inplace",
    "send",
]


BAGUA_OP_VALUES: dict[int, ReduceOp] = {
    0: ReduceOp.SUM,
    1: ReduceOp.PRODUCT,
    2: ReduceOp.MIN,
    3: ReduceOp.MAX,
    7: ReduceOp.BOR,
    8: ReduceOp.BAND,
    9: ReduceOp.BXOR,
    10: ReduceOp.AVG,
}
"""Bagua's integer values of its ``ReduceOp`` members (an ``IntEnum``), which callers may pass instead of a member."""


# ----------------------------------------------------------------------------- helpers


def _resolve(comm: Any) -> CommunicatorHandle | None:
    """The handle to communicate on, or None when this rank is not a member."""
    if comm is CommMember.NON_COMM_MEMBER:
        return None
    if comm is None or comm is CommMember.WORLD:
        return get_default_group().get_global_communicator()
    if isinstance(comm, BaguaProcessGroup):
        handle = comm.get_global_communicator()
        return None if handle is CommMember.NON_COMM_MEMBER else handle
    if not isinstance(comm, CommunicatorHandle):
        raise TypeError(
            "comm must be a communicator from a BaguaProcessGroup (group.get_global_communicator()), got "
            f"{type(comm).__name__}"
        )
    return comm


def _op(op: Any) -> ReduceOp:
    """``op`` as the project's :class:`ReduceOp`: a member, its name, or Bagua's integer value of it."""
    if isinstance(op, int) and not isinstance(op, bool) and op in BAGUA_OP_VALUES:
        return BAGUA_OP_VALUES[op]
    try:
        return ReduceOp(op)
    except ValueError:
        raise ValueError(
            f"unknown reduction {op!r}; use a ReduceOp member or Bagua's value of one {sorted(BAGUA_OP_VALUES)}"
        ) from None


def _reduce_rows(rows: torch.Tensor, op: ReduceOp) -> torch.Tensor:
    """Reduce ``rows`` (one per rank) along the first axis with a reduction the communicators lack."""
    if op == ReduceOp.PRODUCT:
        return torch.prod(rows, dim=0, dtype=rows.dtype)
    if rows.dtype.is_floating_point:
        raise TypeError(f"ReduceOp.{op.name} needs an integer tensor, got {rows.dtype}")
    combine = {ReduceOp.BAND: torch.bitwise_and, ReduceOp.BOR: torch.bitwise_or, ReduceOp.BXOR: torch.bitwise_xor}[op]
    return functools.reduce(combine, rows.unbind(0))


def _allreduced(handle: CommunicatorHandle, x: torch.Tensor, op: Any) -> torch.Tensor:
    op = _op(op)
    if op in REDUCE_OPS:
        return handle.communicator.allreduce(x, op)
    return _reduce_rows(handle.communicator.allgather(x), op)


def _check_numel(what: str, tensor: torch.Tensor, expected: int) -> None:
    if tensor.numel() != expected:
        raise ValueError(f"{what} must have {expected} elements, got {tensor.numel()} (shape {list(tensor.shape)})")


def _write(target: torch.Tensor, values: torch.Tensor) -> None:
    with torch.no_grad():
        target.copy_(values.reshape(target.shape))


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(-1)


def _equal_parts(what: str, tensor: torch.Tensor, n: int) -> torch.Tensor:
    """``tensor``'s elements as ``n`` rows, one per rank; a ValueError unless they split evenly."""
    if tensor.numel() % n:
        raise ValueError(f"{what}: {tensor.numel()} elements do not split into {n} equal parts")
    return _flat(tensor).view(n, -1)


# ----------------------------------------------------------------------------- point to point


def _torch_peer(handle: CommunicatorHandle, peer: int, what: str) -> tuple[int, Any]:
    comm = handle.communicator
    if not isinstance(comm, ProcessGroupCommunicator):
        raise TypeError(
            f"{what}: point-to-point transfers need a torch.distributed group; this communicator runs on "
            f"{type(comm).__name__}"
        )
    if not 0 <= peer < comm.size:
        raise ValueError(f"{what}: rank {peer} is not in this {comm.size}-rank communicator")
    group = comm.group
    return (peer if group is None else dist.get_global_rank(group, peer)), group


def send(tensor: torch.Tensor, dst: int, comm: Any = None) -> None:
    """Send ``tensor`` to rank ``dst`` of ``comm`` (blocks until it is sent); pairs with :func:`recv`."""
    handle = _resolve(comm)
    if handle is None:
        return
    peer, group = _torch_peer(handle, dst, "send")
    dist.send(tensor.detach().contiguous(), peer, group=group)


def recv(tensor: torch.Tensor, src: int, comm: Any = None) -> None:
    """Receive into ``tensor`` what rank ``src`` of ``comm`` sent with :func:`send`."""
    handle = _resolve(comm)
    if handle is None:
        return
    peer, group = _torch_peer(handle, src, "recv")
    buffer = tensor.detach().contiguous()
    dist.recv(buffer, peer, group=group)
    if buffer.data_ptr() != tensor.data_ptr():
        _write(tensor, buffer)


# ----------------------------------------------------------------------------- collectives


def broadcast(tensor: torch.Tensor, src: int = 0, comm: Any = None) -> None:
    """Overwrite ``tensor`` on every rank with rank ``src``'s."""
    handle = _resolve(comm)
    if handle is None:
        return
    _write(tensor, handle.communicator.broadcast(tensor, src))


def allreduce(
    send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: Any = None
) -> None:
    """Reduce ``send_tensor`` over the ranks into ``recv_tensor`` on every rank (bitwise identical everywhere)."""
    handle = _resolve(comm)
    if handle is None:
        return
    _check_numel("allreduce: recv_tensor", recv_tensor, send_tensor.numel())
    _write(recv_tensor, _allreduced(handle, _flat(send_tensor), op))


def allreduce_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: Any = None) -> None:
    """The in-place version of :func:`allreduce`."""
    allreduce(tensor, tensor, op, comm)


def reduce(
    send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, comm: Any = None
) -> None:
    """Reduce ``send_tensor`` over the ranks into ``recv_tensor`` on rank ``dst`` (other ranks' stays as it was)."""
    handle = _resolve(comm)
    if handle is None:
        return
    _check_numel("reduce: recv_tensor", recv_tensor, send_tensor.numel())
    op = _op(op)
    comm_ = handle.communicator
    if op in REDUCE_OPS:
        result = comm_.reduce(_flat(send_tensor), dst, op)
    else:
        result = _reduce_rows(comm_.allgather(_flat(send_tensor)), op)
    if comm_.rank == dst:
        _write(recv_tensor, result)


def reduce_inplace(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, comm: Any = None) -> None:
    """The in-place version of :func:`reduce`: ``tensor`` holds the result on ``dst`` and is left alone elsewhere."""
    reduce(tensor, tensor, dst, op, comm)


def allgather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: Any = None) -> None:
    """Every rank's ``send_tensor``, in rank order, into ``recv_tensor`` (``nranks * send_tensor.numel()`` elements)."""
    handle = _resolve(comm)
    if handle is None:
        return
    _check_numel("allgather: recv_tensor", recv_tensor, handle.nranks() * send_tensor.numel())
    _write(recv_tensor, handle.communicator.allgather(_flat(send_tensor)))


def allgather_inplace(tensor: torch.Tensor, comm: Any = None) -> None:
    """In place: rank r's part is ``tensor``'s r-th of ``nranks`` equal slices; every rank ends with all parts."""
    handle = _resolve(comm)
    if handle is None:
        return
    part = _equal_parts("allgather_inplace", tensor, handle.nranks())[handle.rank()]
    _write(tensor, handle.communicator.allgather(part))


def gather(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, dst: int, comm: Any = None) -> None:
    """Every rank's ``send_tensor``, in rank order, into ``recv_tensor`` on rank ``dst`` (left alone elsewhere)."""
    handle = _resolve(comm)
    if handle is None:
        return
    if handle.rank() == dst:
        _check_numel("gather: recv_tensor", recv_tensor, handle.nranks() * send_tensor.numel())
    result = handle.communicator.gather(_flat(send_tensor), dst)
    if handle.rank() == dst:
        _write(recv_tensor, result)


def gather_inplace(tensor: torch.Tensor, count: int, dst: int, comm: Any = None) -> None:
    """In place: on ``dst`` ``tensor`` has ``nranks * count`` elements (its own part at slice ``dst``) and receives
    the others' parts; elsewhere ``tensor`` has ``count`` elements, which are sent."""
    handle = _resolve(comm)
    if handle is None:
        return
    n, me = handle.nranks(), handle.rank()
    _check_numel("gather_inplace: tensor", tensor, n * count if me == dst else count)
    part = _flat(tensor)[dst * count : (dst + 1) * count] if me == dst else _flat(tensor)
    result = handle.communicator.gather(part, dst)
    if me == dst:
        _write(tensor, result)


def scatter(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, src: int, comm: Any = None) -> None:
    """Rank r receives slice r of rank ``src``'s ``send_tensor`` (``nranks * recv_tensor.numel()`` elements)."""
    handle = _resolve(comm)
    if handle is None:
        return
    n = handle.nranks()
    if handle.rank() == src:
        _check_numel("scatter: send_tensor", send_tensor, n * recv_tensor.numel())
        rows = _flat(send_tensor).view(n, -1)
    else:  # only the root's rows are read; the others send a buffer of the right shape
        rows = torch.empty((n, recv_tensor.numel()), dtype=recv_tensor.dtype, device=recv_tensor.device)
    _write(recv_tensor, handle.communicator.scatter(rows, src))


def scatter_inplace(tensor: torch.Tensor, count: int, src: int, comm: Any = None) -> None:
    """In place: on ``src`` ``tensor`` holds ``nranks * count`` elements (its own slice stays); elsewhere ``tensor``
    has ``count`` elements and receives its slice."""
    handle = _resolve(comm)
    if handle is None:
        return
    n, me = handle.nranks(), handle.rank()
    _check_numel("scatter_inplace: tensor", tensor, n * count if me == src else count)
    rows = (
        _flat(tensor).view(n, count) if me == src else torch.empty((n, count), dtype=tensor.dtype, device=tensor.device)
    )
    result = handle.communicator.scatter(rows, src)
    if me != src:
        _write(tensor, result)


def reduce_scatter(
    send_tensor: torch.Tensor, recv_tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: Any = None
) -> None:
    """Rank r receives slice r of ``send_tensor`` (``nranks * recv_tensor.numel()`` elements) reduced over ranks."""
    handle = _resolve(comm)
    if handle is None:
        return
    n = handle.nranks()
    _check_numel("reduce_scatter: send_tensor", send_tensor, n * recv_tensor.numel())
    rows = _flat(send_tensor).view(n, -1)
    op = _op(op)
    if op in REDUCE_OPS:
        result = handle.communicator.reduce_scatter(rows, op)
    else:
        result = _reduce_rows(handle.communicator.allgather(rows), op)[handle.rank()]
    _write(recv_tensor, result)


def reduce_scatter_inplace(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: Any = None) -> None:
    """In place: ``tensor`` (``nranks`` equal slices) gets its slice ``rank`` reduced over the ranks; the other
    slices are left as they were (NCCL's in-place convention, which Bagua used)."""
    handle = _resolve(comm)
    if handle is None:
        return
    n = handle.nranks()
    mine = _equal_parts("reduce_scatter_inplace", tensor, n)[handle.rank()]
    part = torch.empty_like(mine)
    reduce_scatter(tensor, part, op, comm)
    with torch.no_grad():
        if tensor.is_contiguous():
            mine.copy_(part)
        else:
            flat = _flat(tensor).clone()
            flat.view(n, -1)[handle.rank()].copy_(part)
            _write(tensor, flat)


def alltoall(send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: Any = None) -> None:
    """Slice j of ``send_tensor`` (``nranks`` equal slices) goes to rank j; slice j of ``recv_tensor`` came from j."""
    handle = _resolve(comm)
    if handle is None:
        return
    rows = _equal_parts("alltoall", send_tensor, handle.nranks())
    _check_numel("alltoall: recv_tensor", recv_tensor, send_tensor.numel())
    _write(recv_tensor, handle.communicator.alltoall(rows))


def alltoall_inplace(tensor: torch.Tensor, comm: Any = None) -> None:
    """The in-place version of :func:`alltoall`."""
    alltoall(tensor, tensor, comm)


def _counts(what: str, values: Sequence[int], n: int) -> list[int]:
    values = [int(v) for v in (values.tolist() if isinstance(values, torch.Tensor) else values)]
    if len(values) < n:
        raise ValueError(f"alltoall_v: {what} needs an entry per rank ({n}), got {len(values)}")
    if any(v < 0 for v in values[:n]):
        raise ValueError(f"alltoall_v: {what} must be non-negative, got {values[:n]}")
    return values[:n]


def alltoall_v(
    send_tensor: torch.Tensor,
    send_counts: Sequence[int],
    send_displs: Sequence[int],
    recv_tensor: torch.Tensor,
    recv_counts: Sequence[int],
    recv_displs: Sequence[int],
    comm: Any = None,
) -> None:
    """Variable all-to-all with displacements (MPI's ``Alltoallv``), Bagua's argument order.

    ``send_counts[j]`` elements starting at ``send_displs[j]`` of ``send_tensor`` go to rank j;
    the ``recv_counts[j]`` elements from rank j land at ``recv_displs[j]`` of ``recv_tensor``;
    elements of ``recv_tensor`` outside the received ranges keep their values. Count and
    displacement lists may be longer than the rank count (Bagua's example passes ``nranks + 1``
    displacements); the first ``nranks`` entries are used.
    """
    handle = _resolve(comm)
    if handle is None:
        return
    n = handle.nranks()
    sc, sd = _counts("send_counts", send_counts, n), _counts("send_displs", send_displs, n)
    rc, rd = _counts("recv_counts", recv_counts, n), _counts("recv_displs", recv_displs, n)
    src, dst = _flat(send_tensor), _flat(recv_tensor)
    for what, counts, displs, size in (("send", sc, sd, src.numel()), ("recv", rc, rd, dst.numel())):
        for j in range(n):
            if displs[j] + counts[j] > size:
                raise ValueError(
                    f"alltoall_v: {what} range of rank {j} ({displs[j]}..{displs[j] + counts[j]}) exceeds the "
                    f"{what} tensor's {size} elements"
                )
    packed = torch.cat([src[sd[j] : sd[j] + sc[j]] for j in range(n)])
    received = handle.communicator.alltoall_v(packed, sc, rc, sum(rc))
    out = dst.clone()
    offset = 0
    for j in range(n):
        out[rd[j] : rd[j] + rc[j]] = received[offset : offset + rc[j]]
        offset += rc[j]
    _write(recv_tensor, out)


def alltoall_v_inplace(tensor: torch.Tensor, counts: Sequence[int], displs: Sequence[int], comm: Any = None) -> None:
    """The in-place version of :func:`alltoall_v`: the same counts and displacements for sending and receiving."""
    alltoall_v(tensor, counts, displs, tensor, counts, displs, comm)


def barrier(comm: Any = None) -> None:
    """Return once every rank of ``comm`` has called it."""
    handle = _resolve(comm)
    if handle is None:
        return
    handle.communicator.barrier()

"""Bagua's ``bagua.torch_api.communication``: process groups and collectives written into ``recv``.

Every function has Bagua's name, signature and in-place semantics, on this project's
communicators (:mod:`bagua_torch.communicator`): ``allreduce(send_tensor, recv_tensor, op,
comm)`` writes the result into ``recv_tensor``, ``allreduce_inplace(tensor, op, comm)`` into
``tensor``; ``comm`` is a communicator handle from a :class:`BaguaProcessGroup`
(``group.get_global_communicator()``), default the job's world. Tensors are flat buffers, as in
Bagua: ``allgather`` fills ``recv_tensor`` (``nranks * send_tensor.numel()`` elements, any shape)
rank by rank. A rank that is not a member of ``comm``'s group returns at once, as in Bagua.

Where this differs from Bagua, on purpose:

* CPU tensors work (gloo, or the native MPI engine), not only CUDA tensors.
* :class:`ReduceOp` is the project's own (:class:`bagua_common.comm.collectives.ReduceOp`, string
  members); Bagua's integer values (``0`` for ``SUM`` ... ``10`` for ``AVG``,
  :data:`BAGUA_OP_VALUES`) are accepted wherever a reduction is.
* Every :class:`ReduceOp` works on every collective: ``PRODUCT``, ``BAND``, ``BOR`` and
  ``BXOR`` (which the communicators lack) are computed from an allgather. Bagua passed them to
  NCCL, which has no bitwise reductions.
* :func:`init_process_group` starts no autotuning HTTP service. Bagua's listened on every
  interface (``0.0.0.0``) and waited for it to come up; nothing here listens beyond
  ``torch.distributed``'s own store.
* The groups are the project's (:class:`bagua_torch.job.BaguaProcessGroup`, the default one
  :func:`bagua_torch.init_process_group`'s); :func:`from_torch_group` reuses the torch group
  itself; :func:`new_group` builds a torch (or native MPI) group of the listed ranks.
* ``gather``/``scatter``/``alltoall``/``alltoall_v`` check the sizes and raise a ValueError;
  Bagua's engine asserted and aborted the process.

The collectives block until the result is in ``recv_tensor`` (Bagua synchronized its CUDA
stream the same way).
"""

from bagua_torch.torch_api.communication.collectives import *  # noqa: F403
from bagua_torch.torch_api.communication.collectives import __all__ as _collectives
from bagua_torch.torch_api.communication.groups import (
    BaguaProcessGroup,
    CommMember,
    CommunicatorHandle,
    from_torch_group,
    get_default_group,
    init_process_group,
    is_initialized,
    new_group,
)

_get_default_group = get_default_group
"""Bagua's private name for :func:`get_default_group`, which Bagua's examples call."""


def _rank_not_in_group(group: BaguaProcessGroup | None = None) -> bool:
    """Whether this process is not a member of ``group`` (None: the default group, of which every rank is).

    Bagua's private name, which Bagua's own tests import (``test_decentralized``,
    ``test_low_precision_decentralized``) to leave out the ranks a :func:`new_group` does not hold.
    """
    return group is not None and group.communicators is None


__all__ = [
    *_collectives,
    "BaguaProcessGroup",
    "CommMember",
    "CommunicatorHandle",
    "from_torch_group",
    "init_process_group",
    "is_initialized",
    "new_group",
]

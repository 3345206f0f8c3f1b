"""A communicator of its own for collectives issued from a background thread.

Collectives of one communicator must come in the same order on every rank. A thread that
communicates while the training thread does too (an asynchronous averaging round, a Streaming
DiLoCo exchange overlapping the next steps) interleaves with it differently on each rank, so it
gets a communicator of the same ranks that nothing else uses.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from bagua_torch.communicator.native_communicator import NativeCommunicator
from bagua_torch.communicator.process_group_communicator import ProcessGroupCommunicator
from bagua_torch.communicator.protocol import Communicator


def dedicated_communicator(world: Communicator, purpose: str) -> Communicator:
    """A communicator of the same ranks as ``world`` that nothing else uses, named ``<world's name>/<purpose>``.

    Collective over ``world``: a new ``torch.distributed`` process group of its ranks, or a split of
    the native communicator. Close a native one when done.
    """
    if isinstance(world, NativeCommunicator):
        return world.split(0, world.rank, name=f"{world.name}/{purpose}")
    if isinstance(world, ProcessGroupCommunicator) and world.dedicated is not None:
        return world.dedicated(purpose)  # a fault-tolerant job's epoch makes its own groups
    if isinstance(world, ProcessGroupCommunicator):
        group = world.group
        ranks = None if group is None else dist.get_process_group_ranks(group)
        # A group of only some of the job's ranks is created by its members alone (they are the ones
        # wrapping the model); a group of all ranks the usual way, by every rank.
        local = ranks is not None and len(ranks) < dist.get_world_size()
        seconds = max(world.timeout, 30.0)
        new = dist.new_group(
            ranks=ranks, timeout=timedelta(seconds=seconds), backend=world.backend, use_local_synchronization=local
        )
        return ProcessGroupCommunicator(new, timeout=world.timeout, name=f"{world.name}/{purpose}")
    raise TypeError(
        f"{purpose}: a background thread needs a communicator of its own, made from a ProcessGroupCommunicator or a "
        f"NativeCommunicator world; got {type(world).__name__}"
    )

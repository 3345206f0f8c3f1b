"""Bagua's ``bagua.torch_api.env``: where this process sits in the job.

Before :func:`bagua_torch.torch_api.init_process_group` the values come from the launcher's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, or an MPI
launcher's variables), as in Bagua, so ``torch.cuda.set_device(get_local_rank())`` works
before the job starts; afterwards from the job itself (which may have been given its rank as
arguments rather than variables).
"""

from __future__ import annotations

from bagua_common.job.rank_environment import environment_int
from bagua_torch.bucketing import DEFAULT_BUCKET_BYTES
from bagua_torch.job import get_process_group, is_initialized


def _from_environment(key: str, default: int) -> int:
    value = environment_int(key)
    return default if value is None else value


def get_world_size() -> int:
    """The number of processes in the job."""
    return get_process_group().size if is_initialized() else _from_environment("WORLD_SIZE", 1)


def get_rank() -> int:
    """This process's rank in the job, 0 to ``get_world_size() - 1``."""
    return get_process_group().rank if is_initialized() else _from_environment("RANK", 0)


def get_local_rank() -> int:
    """This process's rank among the processes of its node."""
    return get_process_group().local_rank if is_initialized() else _from_environment("LOCAL_RANK", 0)


def get_local_size() -> int:
    """The number of processes on this node."""
    return get_process_group().local_size if is_initialized() else _from_environment("LOCAL_WORLD_SIZE", 1)


def get_node_rank() -> int:
    """The index of this process's node (ranks are laid out node by node)."""
    return get_rank() // get_local_size()


def get_default_bucket_size() -> int:
    """The communication bucket size in bytes: ``BAGUA_DEFAULT_BUCKET_SIZE`` or 10 MiB, as in Bagua."""
    return _from_environment("BAGUA_DEFAULT_BUCKET_SIZE", DEFAULT_BUCKET_BYTES)

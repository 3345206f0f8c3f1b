"""Where this process sits in the job, read from its launcher's environment: the one reader.

``bagua-launch`` and ``torchrun`` set ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. An MPI launcher
(``mpiexec``, ``srun``) sets only its own variables (MPICH/Hydra ``PMI_RANK``, Open MPI
``OMPI_COMM_WORLD_RANK``, PMIx, Slurm ``SLURM_PROCID``); the same rank variables are derived
from them, with ``NODE_RANK = RANK // LOCAL_WORLD_SIZE`` (ranks placed on nodes in blocks, as
``mpiexec -ppn`` does; Slurm's ``SLURM_NODEID`` where given). Both front ends, the torch
compatibility API and the launcher's MPI wrapper read their rank here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# Set by ``bagua-launch --mpi``: ranks per node, when the MPI launcher does not say.
NPROC_VARIABLE = "BAGUA_LAUNCH_NPROC_PER_NODE"
RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK")

# (rank, size, local rank, local size, node rank) variables of each MPI launcher, in order of preference.
_SOURCES = (
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None),  # MPICH Hydra, Intel MPI
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", None),
    ("PMIX_RANK", None, None, None, None),
    ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None, "SLURM_NODEID"),
)


def started_by_mpi(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether an MPI launcher started this process (one of its rank variables is set)."""
    return any(source[0] in environ for source in _SOURCES)


def mpi_rank_environment(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK from an MPI launcher's variables.

    ``MASTER_ADDR`` and ``MASTER_PORT`` are kept as given (default ``127.0.0.1:29500``).
    Raises a ``RuntimeError`` when no MPI launcher started this process.
    """
    for rank_var, size_var, local_var, local_size_var, node_var in _SOURCES:
        if rank_var in environ:
            break
    else:
        raise RuntimeError(
            "no MPI rank in the environment (PMI_RANK, OMPI_COMM_WORLD_RANK, PMIX_RANK, SLURM_PROCID): "
            "run this under mpiexec"
        )

    def get(name: str | None) -> int | None:
        return int(environ[name]) if name and environ.get(name, "").strip() else None

    rank = get(rank_var)
    size = get(size_var) or int(environ.get("WORLD_SIZE") or 0) or rank + 1
    local_size = get(local_size_var) or get(NPROC_VARIABLE) or size
    local_rank = get(local_var)
    if local_rank is None:
        local_rank = rank % local_size
    node_rank = get(node_var)
    if node_rank is None:
        node_rank = rank // local_size
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(size),
        "LOCAL_WORLD_SIZE": str(local_size),
        "NODE_RANK": str(node_rank),
        "MASTER_ADDR": environ.get("MASTER_ADDR", "127.0.0.1"),
        "MASTER_PORT": environ.get("MASTER_PORT", "29500"),
    }


def threads_per_rank(ranks_on_node: int) -> int:
    """The intra-op threads each of ``ranks_on_node`` ranks gets (its ``OMP_NUM_THREADS``, as torchrun sets it):
    the cores this process may run on (its CPU affinity, which a container or ``taskset`` narrows) divided among
    the ranks, at least 1. More threads than cores only spin against each other."""
    return max(1, len(os.sched_getaffinity(0)) // ranks_on_node)


def environment_int(key: str, environ: Mapping[str, str] = os.environ) -> int | None:
    """The integer value of the environment variable ``key``, or None when it is unset or blank.

    A rank variable (:data:`RANK_VARIABLES`) that is not set comes from the MPI launcher's
    variables when one started this process; ``LOCAL_RANK`` then is ``RANK % LOCAL_WORLD_SIZE``,
    so that a ``LOCAL_WORLD_SIZE`` given to the job lays its ranks out node by node. A value that
    is not an integer raises a ``ValueError`` naming the variable.
    """
    text = environ.get(key)
    if text is None and key in RANK_VARIABLES and started_by_mpi(environ):
        if key == "LOCAL_RANK":  # node by node, with the node size the job was given if it was
            rank, local_size = environment_int("RANK", environ), environment_int("LOCAL_WORLD_SIZE", environ)
            return rank % local_size if rank is not None and local_size else None
        text = mpi_rank_environment(environ)[key]
    if text is None or not text.strip():
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"environment variable {key}={text!r} is not an integer") from None

"""A two-rank job on the MPI engine in which one rank raises: run as a script.

``python fault_workers.py FRONT_END WORKDIR`` (FRONT_END ``jax`` or ``torch``), started by
``mpiexec`` or ``bagua-launch --mpi``. Every rank writes its pid to ``WORKDIR/pid<rank>``;
after one allreduce together, rank 1 writes ``WORKDIR/raised`` (the time) and raises while
rank 0 enters a second allreduce that can never complete.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def allreduce_of_ones(front_end: str):
    """The MPI world communicator's rank and a function summing ones over it."""
    if front_end == "jax":
        import jax.numpy as jnp

        from bagua_jax.native_communicator import NativeCommunicator

        comm = NativeCommunicator.mpi_world()
        return int(comm.rank()), lambda: comm.allreduce(jnp.ones(4)).block_until_ready()
    import torch

    from bagua_torch.communicator import NativeCommunicator

    comm = NativeCommunicator.mpi_world()
    return comm.rank, lambda: comm.allreduce(torch.ones(4))


def main(front_end: str, workdir: Path) -> None:
    rank, allreduce = allreduce_of_ones(front_end)
    (workdir / f"pid{rank}").write_text(str(os.getpid()))
    allreduce()
    if rank == 1:
        (workdir / "raised").write_text(repr(time.time()))
        raise RuntimeError("rank 1 fails on purpose")
    allreduce()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))

"""A two-rank job in which rank 1 fails after one collective: run as a script.

``python fault_workers.py SETUP FAULT WORKDIR``. SETUP is ``jax-mpi`` or ``torch-mpi`` (the
MPI engine; start with ``mpiexec`` or ``bagua-launch --mpi``) or ``jax-mesh`` (JAX's own
collectives over ``jax.distributed``, joined with ``bagua_jax.distributed.initialize``;
start two plain processes or ``bagua-launch``). Every rank writes its pid to
``WORKDIR/pid<rank>``; after one allreduce together rank 1 writes ``WORKDIR/fault`` (the
time) and then FAULT: ``raise`` an exception, ``kill`` itself (SIGKILL), ``term`` itself
(SIGTERM), or ``hang`` (alive, never joining again). Rank 0 keeps running allreduces.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path


def mpi_allreduce(front_end: str) -> tuple[int, Callable[[], object]]:
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


def mesh_allreduce() -> tuple[int, Callable[[], object]]:
    """This process's index under ``jax.distributed`` and a function summing ones over the mesh."""
    from bagua_jax.distributed import initialize

    initialize()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from bagua_jax import LaxCommunicator

    mesh = Mesh(np.array(jax.devices()), ("r",))
    comm = LaxCommunicator("r", jax.process_count())
    sums = jax.jit(
        jax.shard_map(
            lambda x: comm.allreduce(x, "sum"),
            mesh=mesh,
            in_specs=P("r"),
            out_specs=P("r"),
        )
    )
    ones = jax.make_array_from_process_local_data(NamedSharding(mesh, P("r")), np.ones((1, 4), np.float32))
    return jax.process_index(), lambda: np.asarray(sums(ones).addressable_shards[0].data)


def main(setup: str, fault: str, workdir: Path) -> None:
    rank, allreduce = mesh_allreduce() if setup == "jax-mesh" else mpi_allreduce(setup.split("-")[0])
    (workdir / f"pid{rank}").write_text(str(os.getpid()))
    allreduce()
    if rank == 1:
        (workdir / "fault").write_text(repr(time.time()))
        if fault == "raise":
            raise RuntimeError("rank 1 fails on purpose")
        if fault in ("kill", "term"):
            os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGTERM)
        time.sleep(600)  # "hang", or a SIGTERM that did not end the process
    while True:  # the collective with the failed rank must raise
        allreduce()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], Path(sys.argv[3]))

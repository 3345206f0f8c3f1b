"""The variables each rank is started with, ``torchrun``'s names and arithmetic:

* ``RANK``: ``node_rank * nproc_per_node + local_rank``
* ``LOCAL_RANK``: ``0 .. nproc_per_node - 1``
* ``WORLD_SIZE``: ``nnodes * nproc_per_node``
* ``LOCAL_WORLD_SIZE``: ``nproc_per_node``
* ``NODE_RANK``: ``--node-rank``
* ``MASTER_ADDR``: ``--master-addr``
* ``MASTER_PORT``: ``--master-port``
"""

from __future__ import annotations

__all__ = ["RANK_VARIABLES", "rank_environment"]

RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")
"""The names of the environment variables every rank is started with (the module's docstring gives their values)."""


def rank_environment(
    *, local_rank: int, nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str, master_port: int
) -> dict[str, str]:
    """The variables one rank is started with (``torchrun``'s names and arithmetic)."""
    return {
        "RANK": str(node_rank * nproc_per_node + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(nnodes * nproc_per_node),
        "LOCAL_WORLD_SIZE": str(nproc_per_node),
        "NODE_RANK": str(node_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }

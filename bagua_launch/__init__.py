"""bagua-launch: start the ranks of a distributed JAX or PyTorch job (framework-neutral).

``bagua-launch --nproc-per-node N script.py args...`` (or ``python -m bagua_launch ...``)
starts N processes with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK,
MASTER_ADDR and MASTER_PORT set, prefixes their output with the rank, forwards signals
and stops the job when a rank fails; see :mod:`bagua_launch.launcher`. This package
imports neither jax nor torch.
"""

from .launcher import DEFAULT_MULTINODE_PORT, RANK_VARIABLES, Launcher, build_parser, main, rank_environment

__all__ = ["DEFAULT_MULTINODE_PORT", "RANK_VARIABLES", "Launcher", "build_parser", "main", "rank_environment"]

"""bagua-launch: start the ranks of a distributed JAX or PyTorch job (framework-neutral).

``bagua-launch --nproc-per-node N script.py args...`` (or ``python -m bagua_launch ...``)
starts N processes with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK,
MASTER_ADDR and MASTER_PORT set, prefixes their output with the rank, forwards signals
and stops the job when a rank fails. Its parts: :mod:`~bagua_launch.command_line` (the options),
:mod:`~bagua_launch.supervisor` (local and MPI ranks), :mod:`~bagua_launch.rank_variables` (what
each rank is told), :mod:`~bagua_launch.root_cause` (which failing rank a summary names),
:mod:`~bagua_launch.elastic` (torch's elastic agent), :mod:`~bagua_launch.output` (what it prints)
and :mod:`~bagua_launch.rank_env` (the wrapper of one MPI rank). This package imports neither jax nor torch.
"""

from .command_line import DEFAULT_MULTINODE_PORT, build_parser, main
from .rank_variables import RANK_VARIABLES, rank_environment
from .supervisor import Launcher

__all__ = ["DEFAULT_MULTINODE_PORT", "RANK_VARIABLES", "Launcher", "build_parser", "main", "rank_environment"]

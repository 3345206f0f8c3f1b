"""The ``bagua-launch`` command line: its options, their checks, and the mode they select.

``bagua-launch --nproc-per-node N script.py args...`` starts N processes of
``python script.py args...`` (``-m module`` and ``--no-python program`` work too) under
:class:`~bagua_launch.supervisor.Launcher`; with ``--mpi`` one ``mpiexec`` job instead, and
with ``--nnodes MIN:MAX`` (or the other elastic options) torch's elastic agent
(:mod:`bagua_launch.elastic`).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from collections.abc import Callable

from bagua_common.comm.bagua_net import bagua_net_environment
from bagua_common.data.cache_stores import ENV_CACHE_DIR, ENV_CACHE_URL, parse_capacity
from bagua_common.data.private_files import private_directory
from bagua_common.data.redis_server import checked_bind_address, find_redis_server
from bagua_common.job.local_launch import free_port
from bagua_common.job.local_launch import mpiexec as find_mpiexec
from bagua_launch import elastic
from bagua_launch.output import NAME
from bagua_launch.parsed_config import config_from_namespace
from bagua_launch.supervisor import Config, Launcher

__all__ = ["DEFAULT_MULTINODE_PORT", "build_parser", "main", "parse_args"]

#: ``--master-port`` default with ``--nnodes`` > 1 (every node must agree on it; torchrun's).
#: A single-node job gets a free port of this machine instead.
DEFAULT_MULTINODE_PORT = 29500


def _checked(
    name: str, convert: Callable[[str], float], valid: Callable[[float], bool], wording: str
) -> Callable[[str], float]:
    """An argparse ``type``: ``convert`` the text, then refuse a value that is not ``valid`` with ``wording``."""

    def parse(text: str) -> float:
        value = convert(text)
        if not valid(value):
            raise argparse.ArgumentTypeError(wording.format(value))
        return value

    parse.__name__ = name  # argparse names the type in "invalid <name> value"
    return parse


_positive_int = _checked("positive int", int, lambda v: v >= 1, "must be at least 1, got {}")
_non_negative_int = _checked("non-negative int", int, lambda v: v >= 0, "must be at least 0, got {}")
_port = _checked("port", int, lambda v: 0 < v < 65536, "not a TCP port: {}")
_seconds = _checked("seconds", float, lambda v: v >= 0, "must not be negative, got {}")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``bagua-launch``'s command line (its ``--help`` is the user's reference)."""
    parser = argparse.ArgumentParser(
        prog=NAME,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{NAME} [options] (script.py | -m module | --no-python program) [args ...]",
        description=(
            "Start the processes of a distributed JAX or PyTorch job on this node, one per rank.\n"
            "Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR and\n"
            "MASTER_PORT (the variables torchrun sets), and OMP_NUM_THREADS = cores / nproc-per-node\n"
            "unless set; its output lines are printed as '[rank N] ...'.\n"
            "If a rank fails the others are stopped, and the launcher exits with that rank's exit code\n"
            "after a summary of its last lines. SIGINT/SIGTERM are forwarded to every rank."
        ),
        epilog=(
            "examples:\n"
            f"  {NAME} --nproc-per-node 4 train.py --lr 0.1\n"
            f"  {NAME} --nproc-per-node 2 -m mypackage.train\n"
            f"  {NAME} --nproc-per-node 2 --mpi train.py          # one 'mpiexec -n 2' job\n"
            "  # two nodes, two ranks each; run on every node with its own --node-rank:\n"
            f"  {NAME} --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 10.0.0.1 train.py\n"
            "  # elastic, 1 to 4 nodes (torch's elastic agent); the same command on every node:\n"
            f"  {NAME} --nnodes 1:4 --nproc-per-node 2 --max-restarts 3 --rdzv-endpoint 10.0.0.1:29400 train.py\n"
            "\n"
            "exit status: 0 when every rank exits 0; else the first failing rank's exit code\n"
            "(128+N if it died of signal N), 128+N when the launcher got signal N, 124 at --timeout.\n"
            "The script finds its peers with, for JAX:\n"
            "  jax.distributed.initialize(f\"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}\",\n"
            "                             int(os.environ['WORLD_SIZE']), int(os.environ['RANK']))\n"
            "and for PyTorch: torch.distributed.init_process_group(backend, init_method='env://')."
        ),
    )
    job = parser.add_argument_group("job")
    job.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=_positive_int,
        default=1,
        metavar="N",
        help="processes (ranks) to start on this node (default: 1)",
    )
    job.add_argument(
        "--nnodes",
        type=elastic.node_range,
        default=(1, 1),
        metavar="N|MIN:MAX",
        help="nodes in the job (default: 1); MIN:MAX runs the job elastic (see below)",
    )
    job.add_argument(
        "--node-rank",
        "--node_rank",
        type=_non_negative_int,
        default=0,
        metavar="I",
        help="this node's index, 0 .. nnodes-1 (default: 0)",
    )
    job.add_argument(
        "--master-addr",
        "--master_addr",
        default=None,
        metavar="HOST",
        help="address of node 0, where rank 0 listens (default: 127.0.0.1; required with --nnodes > 1)",
    )
    job.add_argument(
        "--master-port",
        "--master_port",
        type=_port,
        default=None,
        metavar="PORT",
        help=f"port on node 0 for rank 0's coordinator / TCP store (default: a free port of this "
        f"machine for a one-node job, {DEFAULT_MULTINODE_PORT} with --nnodes > 1)",
    )
    what = parser.add_argument_group("what to run")
    how = what.add_mutually_exclusive_group()
    how.add_argument("-m", "--module", action="store_true", help="run the target as 'python -m module'")
    how.add_argument("--no-python", action="store_true", help="run the target as a program, not a Python script")
    what.add_argument("target", metavar="script.py", help="the script (or module, or program) each rank runs")
    what.add_argument("args", nargs=argparse.REMAINDER, metavar="args", help="arguments passed to the script")
    mpi = parser.add_argument_group("MPI")
    mpi.add_argument(
        "--mpi",
        action="store_true",
        help="start the ranks as one 'mpiexec -n NNODES*NPROC' job (for the MPI engine); run the "
        "launcher once, on node 0, and place ranks on hosts with --mpi-args. With --fault-tolerant: each rank "
        "its own 'mpiexec -n 1' job, on every node",
    )
    mpi.add_argument(
        "--mpiexec",
        default=None,
        metavar="PATH",
        help="the mpiexec to use (default: the one beside this Python, else the one on PATH)",
    )
    mpi.add_argument(
        "--mpi-args",
        default="",
        metavar="'ARGS'",
        help="extra mpiexec arguments, e.g. '-hosts a,b -ppn 2' (with --fault-tolerant, given to each rank's own "
        "mpiexec, e.g. '-bind-to none')",
    )
    cache = parser.add_argument_group("dataset cache")
    cache.add_argument(
        "--cache-server",
        choices=["redis"],
        default=None,
        help="start one redis-server per node for bagua's CachedDataset, on a private unix socket "
        f"(no TCP unless --cache-bind); ranks find it in {ENV_CACHE_URL}; it stops when the ranks exit",
    )
    cache.add_argument(
        "--cache-capacity",
        type=parse_capacity,
        default=None,
        metavar="SIZE",
        help="the cache server's memory, e.g. 8G (default: a quarter of this node's RAM)",
    )
    cache.add_argument(
        "--cache-bind",
        default=None,
        metavar="ADDR",
        help="also serve the cache on TCP at this IP address of the node, with a generated password "
        "(in a 0600 file the ranks find in BAGUA_CACHE_PASSWORD_FILE), so that the ranks can shard "
        "the cache over every node's server: bagua_common.data.cache_stores.sharded_store",
    )
    cache.add_argument(
        "--cache-dir",
        default=None,
        metavar="PATH",
        help="keep the node's LMDB dataset cache in PATH and leave it for the next job (default: "
        f"${ENV_CACHE_DIR}, else a 0700 directory made for the job and removed when it ends)",
    )
    elastic.add_arguments(parser)
    parser.add_argument_group("network").add_argument(
        "--enable-bagua-net",
        action="store_true",
        help="NCCL sends over Bagua-Net, the striped-TCP network plugin (sets NCCL_NET_PLUGIN and NCCL_NET=Bagua)",
    )
    control = parser.add_argument_group("control")
    control.add_argument(
        "--grace",
        type=_seconds,
        default=10.0,
        metavar="SECONDS",
        help="after SIGTERM (a rank failed, a signal, --timeout), seconds before SIGKILL (default: 10)",
    )
    control.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        metavar="SECONDS",
        help="stop the job after this many seconds and exit 124 (default: no limit)",
    )
    control.add_argument(
        "--tail-lines",
        type=_non_negative_int,
        default=20,
        metavar="N",
        help="lines of the failing rank's output repeated in the final summary (default: 20)",
    )
    return parser


def parse_args(argv: list[str] | None) -> Config | elastic.ElasticConfig:
    """The job a command line asks for, or a usage error (exits 2 with the message)."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    mode = "module" if ns.module else "program" if ns.no_python else "script"
    if mode == "program":
        if shutil.which(ns.target) is None:
            parser.error(f"--no-python: no program {ns.target!r} found")
        command = [ns.target, *ns.args]
    elif mode == "module":
        command = [sys.executable, "-m", ns.target, *ns.args]
    else:
        command = [sys.executable, ns.target, *ns.args]
    try:
        nccl_net = bagua_net_environment() if ns.enable_bagua_net else {}
    except FileNotFoundError as e:
        parser.error(f"--enable-bagua-net: {e}")
    if elastic.requested(ns):
        return elastic.config_from(ns, parser, command, mode, nccl_net)
    ns.nnodes = ns.nnodes[1]
    if ns.node_rank >= ns.nnodes:
        parser.error(f"--node-rank {ns.node_rank} is not below --nnodes {ns.nnodes}")
    if ns.nnodes > 1 and ns.master_addr is None:
        parser.error("--master-addr is required with --nnodes > 1 (the address of node 0)")
    if ns.mpi and ns.node_rank != 0:
        parser.error("with --mpi run the launcher once, on node 0: mpiexec starts the ranks of every node")
    master_addr = ns.master_addr or "127.0.0.1"
    master_port = ns.master_port or (free_port() if ns.nnodes == 1 else DEFAULT_MULTINODE_PORT)
    mpiexec = None
    if ns.mpi:
        try:
            mpiexec = ns.mpiexec or find_mpiexec()
        except RuntimeError:
            parser.error("--mpi: no mpiexec found beside this Python or on PATH (give one with --mpiexec)")
    if ns.cache_server is not None:
        if ns.mpi:
            parser.error("--cache-server starts a server beside the ranks of this node: not with --mpi")
        try:
            find_redis_server()
        except FileNotFoundError as e:
            parser.error(f"--cache-server redis: {e}")
        if ns.cache_bind is not None:
            try:
                checked_bind_address(ns.cache_bind)
            except ValueError as e:
                parser.error(f"--cache-bind: {e}")
    elif ns.cache_capacity is not None or ns.cache_bind is not None:
        parser.error("--cache-capacity and --cache-bind need --cache-server")
    ns.cache_dir = ns.cache_dir or os.environ.get(ENV_CACHE_DIR) or None
    if ns.cache_dir is not None:
        try:
            private_directory(ns.cache_dir)
        except (OSError, ValueError) as e:
            parser.error(f"--cache-dir: {e}")
    try:
        mpi_args = shlex.split(ns.mpi_args)
    except ValueError as e:
        parser.error(f"--mpi-args: {e}")
    return config_from_namespace(
        Config,
        ns,
        master_addr=master_addr,
        master_port=master_port,
        command=command,
        mode=mode,
        mpiexec=mpiexec,
        mpi_args=mpi_args,
        nccl_net=nccl_net,
    )


def main(argv: list[str] | None = None) -> int:
    """The ``bagua-launch`` command: returns the exit status."""
    config = parse_args(argv)
    if isinstance(config, elastic.ElasticConfig):
        return elastic.run(config)
    return Launcher(config).run()

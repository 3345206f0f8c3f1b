"""Elastic mode of ``bagua-launch``: the job is handed to torch's elastic agent.

``bagua-launch --nnodes MIN:MAX`` (or ``--max-restarts`` / ``--rdzv-endpoint``, spelled as
``torchrun`` spells them) runs ``torch.distributed.launcher.api.elastic_launch`` with the
c10d rendezvous on every node: the agents agree on the membership, start this node's
workers, restart all of them (spending one of ``--max-restarts``) when a worker or a node
fails, and restart them without spending one when a node joins. With ``--fault-tolerant`` a worker
that dies is replaced alone by a process joining the running job
(:mod:`bagua_launch.replacements`); the agent's own restarts are then for what that cannot handle. With
``--fault-tolerant --mpi`` each rank and each replacement runs as its own ``mpiexec -n 1`` job (JAX's native MPI
engine: a world built through the job's store, which shrinks and grows).
Workers get torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``, ...) plus ``BAGUA_ELASTIC=1`` (and Bagua-Net's variables with
``--enable-bagua-net``); a worker resumes from its last checkpoint.

``MASTER_PORT`` is a free port of rank 0's node, not the agents' rendezvous store
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``): JAX's coordinator and bagua_torch's store
bind it themselves. Output lines keep the ``[rank N] line`` format, and a failed run ends
with a summary naming the failed rank, its exit code and its last lines.

torch is imported only here (and by the relay of the nodes' directories, :mod:`bagua_launch.directory_relay`), and only
when elastic mode runs.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bagua_common.comm.engines import ENV_ELASTIC
from bagua_common.fault_tolerance.kv_store import KVServer, advertised_host
from bagua_common.fault_tolerance.settings import (
    ENV_DIRECTORY,
    ENV_FAULT_TOLERANCE,
    ENV_SECRET_FILE,
    ensure_job_secret,
    job_secret,
    job_secret_file,
)
from bagua_common.job.local_launch import free_port
from bagua_common.job.local_launch import mpiexec as find_mpiexec
from bagua_common.job.rank_environment import threads_per_rank
from bagua_launch.directory_relay import DirectoryRelay
from bagua_launch.output import NAME, describe_exit, exit_status, summary
from bagua_launch.parsed_config import config_from_namespace

__all__ = ["ElasticConfig", "add_arguments", "config_from", "node_range", "requested", "run"]

DEFAULT_RDZV_PORT = 29400


def node_range(text: str) -> tuple[int, int]:
    """``--nnodes``: ``N`` (a fixed number of nodes) or ``MIN:MAX`` (elastic)."""
    parts = text.split(":")
    if len(parts) > 2:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}")
    try:
        low, high = (int(parts[0]), int(parts[-1]))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or MIN:MAX, got {text!r}") from None
    if low < 1 or high < low:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return low, high


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The elastic options (``torchrun``'s names), in a group of their own."""
    group = parser.add_argument_group(
        "elastic (torch's elastic agent; needs torch)",
        "given --nnodes MIN:MAX, --max-restarts or --rdzv-endpoint, run the same command on every node",
    )
    group.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=None,
        metavar="N",
        help="restarts of the workers after a failure before the job fails (default: 0); a node joining "
        "restarts them without spending one",
    )
    group.add_argument(
        "--rdzv-endpoint",
        "--rdzv_endpoint",
        default=None,
        metavar="HOST[:PORT]",
        help=f"the rendezvous store, on one of the nodes (default: 127.0.0.1 and a free port for one "
        f"node; port {DEFAULT_RDZV_PORT} if none given)",
    )
    group.add_argument(
        "--rdzv-id",
        "--rdzv_id",
        default="bagua",
        metavar="ID",
        help="the job's id, the same on every node (default: bagua)",
    )
    group.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="a rank that dies is replaced by a process that joins the running job (BAGUA_FT_JOIN=1), instead "
        "of every worker restarting; the script must use fault tolerance (bagua_torch.init_process_group("
        "fault_tolerance=True), or bagua_jax.fault_tolerance with --mpi); see docs/guides/fault_tolerance.md",
    )
    group.add_argument(
        "--rdzv-conf",
        "--rdzv_conf",
        default="",
        metavar="K=V,...",
        help="rendezvous settings, e.g. join_timeout=60,last_call_timeout=1,close_timeout=5,"
        "keep_alive_interval=1,keep_alive_max_attempt=3",
    )


@dataclass
class ElasticConfig:
    """What :func:`run` needs: the node range, the rendezvous and the worker's command."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    max_restarts: int
    rdzv_endpoint: str
    rdzv_id: str
    rdzv_conf: dict[str, str]
    command: list[str]
    mode: str
    tail_lines: int
    grace: float
    nccl_net: dict[str, str] = field(default_factory=dict)  # --enable-bagua-net: NCCL's plugin variables
    fault_tolerant: bool = False


def requested(ns: argparse.Namespace) -> bool:
    """Whether the command line asks for elastic mode."""
    low, high = ns.nnodes
    return low != high or ns.max_restarts is not None or ns.rdzv_endpoint is not None or ns.fault_tolerant


def _rdzv_conf(text: str) -> dict[str, str]:
    conf = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--rdzv-conf: expected KEY=VALUE, got {item!r}")
        conf[key.strip()] = value.strip()
    return conf


def config_from(
    ns: argparse.Namespace,
    parser: argparse.ArgumentParser,
    command: list[str],
    mode: str,
    nccl_net: dict[str, str],
) -> ElasticConfig:
    """The elastic configuration of a parsed command line, or a usage error (``parser.error``)."""
    if ns.mpi and not ns.fault_tolerant:
        parser.error(
            "--mpi cannot be elastic: an MPI world cannot change size; add --fault-tolerant (each rank its own "
            "`mpiexec -n 1` job, in a world the job's store shrinks and grows: bagua_jax.fault_tolerance), or drop "
            "--mpi (torch's gloo/NCCL, JAX over jax.distributed and the native NCCL engine are elastic) or the "
            "elastic options"
        )
    if ns.mpi:  # each rank, and each replacement, is its own MPI job (see bagua_common.comm.mpi_rendezvous)
        try:
            mpiexec = ns.mpiexec or find_mpiexec()
        except RuntimeError:
            parser.error("--mpi: no mpiexec found beside this Python or on PATH (give one with --mpiexec)")
        try:
            command, mode = [mpiexec, "-n", "1", *shlex.split(ns.mpi_args), *command], "program"
        except ValueError as e:
            parser.error(f"--mpi-args: {e}")
    if ns.cache_server is not None:
        parser.error("--cache-server is not available in elastic mode")
    if ns.cache_dir is not None:
        parser.error("--cache-dir is not available in elastic mode (set BAGUA_CACHE_DIR: the ranks inherit it)")
    for flag, given in (
        ("--node-rank", ns.node_rank != 0),
        ("--master-addr", ns.master_addr is not None),
        ("--master-port", ns.master_port is not None),
        ("--timeout", ns.timeout is not None),
    ):
        if given:
            parser.error(
                f"{flag} is not available in elastic mode (the agents' rendezvous decides ranks and addresses)"
            )
    if ns.max_restarts is not None and ns.max_restarts < 0:
        parser.error(f"--max-restarts must be at least 0, got {ns.max_restarts}")
    try:
        conf = _rdzv_conf(ns.rdzv_conf)
    except ValueError as e:
        parser.error(str(e))
    low, high = ns.nnodes
    endpoint = ns.rdzv_endpoint
    if endpoint is None:
        if high > 1:
            parser.error("--rdzv-endpoint HOST:PORT is required with more than one node (the same on every node)")
        endpoint = f"127.0.0.1:{free_port()}"
    elif ":" not in endpoint.rsplit("]", 1)[-1]:
        endpoint = f"{endpoint}:{DEFAULT_RDZV_PORT}"
    return config_from_namespace(
        ElasticConfig,
        ns,
        min_nodes=low,
        max_nodes=high,
        max_restarts=ns.max_restarts or 0,
        rdzv_endpoint=endpoint,
        rdzv_conf=conf,
        command=command,
        mode=mode,
        nccl_net=nccl_net,
    )


def _last_lines(log_dir: str, local_rank: int, count: int) -> list[str]:
    """The failed worker's last output lines, from the agent's log files of the last attempt."""
    attempts = sorted(Path(log_dir).glob("*/attempt_*"), key=lambda p: int(p.name.split("_")[1]))
    if not attempts or not count:
        return []
    folder = attempts[-1] / str(local_rank)
    lines: list[str] = []
    for name in ("stdout.log", "stderr.log"):
        try:
            lines += (folder / name).read_text(errors="replace").splitlines()
        except OSError:
            pass
    return lines[-count:]


def _summary(error, log_dir: str, tail_lines: int) -> str:
    rank, first = error.get_first_failure()
    others = [
        f"rank {other}: {describe_exit(f.exitcode)}" for other, f in sorted(error.failures.items()) if other != rank
    ]
    tail = _last_lines(log_dir, first.local_rank, tail_lines)
    return summary(f"rank {rank} failed ({describe_exit(first.exitcode)})", others, f"rank {rank}", tail)


def run(config: ElasticConfig) -> int:
    """Run this node's agent until the job ends; returns the exit status (the failed rank's, 128+N for signal N)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Read by the agent's rendezvous handler and inherited by the workers.
    os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.environ[ENV_ELASTIC] = "1"
    os.environ.update(config.nccl_net)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_rank(config.nproc_per_node)))
    host, _, port = config.rdzv_endpoint.rpartition(":")
    host = host.strip("[]")  # an IPv6 address's brackets
    log_dir = tempfile.mkdtemp(prefix="bagua-elastic-")
    launch = LaunchConfig(
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        nproc_per_node=config.nproc_per_node,
        run_id=config.rdzv_id,
        rdzv_endpoint=config.rdzv_endpoint,
        rdzv_backend="c10d",
        rdzv_configs=dict(config.rdzv_conf),
        max_restarts=config.max_restarts,
        start_method="spawn",
        log_line_prefix_template="[rank ${rank}] ",
        logs_specs=DefaultLogsSpecs(log_dir=log_dir, tee=Std.ALL),
        # The workers' MASTER_ADDR when this node's agent is rank 0: its address toward the rendezvous, which every
        # node reaches. torch's default, this machine's FQDN, may name another address elsewhere or only here
        # ("localhost" where /etc/hosts says so).
        local_addr=advertised_host(host),
        shutdown_timeout=math.ceil(config.grace),
    )
    relay = None
    if config.fault_tolerant:  # each worker slot replaces its rank when it dies (bagua_launch.replacements)
        if config.max_nodes > 1 and job_secret_file() is None:
            sys.stderr.write(
                f"{NAME}: --fault-tolerant over several nodes needs {ENV_SECRET_FILE}: the path of a file of "
                "mode 0600 holding the job's secret (at least 16 bytes), the same on every node\n"
            )
            shutil.rmtree(log_dir, ignore_errors=True)
            return 2
        ensure_job_secret(log_dir)
        # where this node's ranks say where the job is, for the replacements
        secret = job_secret()
        directory = KVServer("127.0.0.1", secret=secret)
        os.environ.update({ENV_FAULT_TOLERANCE: "1", ENV_DIRECTORY: f"127.0.0.1:{directory.port}"})
        if config.max_nodes > 1:  # and what the other nodes' ranks said, for a node whose ranks all died
            relay = DirectoryRelay(("127.0.0.1", directory.port), (host, int(port)), config.rdzv_id, secret)
        entrypoint, args = sys.executable, ["-m", "bagua_launch.replacements", *config.command]
    elif config.mode == "program":
        entrypoint, args = config.command[0], config.command[1:]
    else:
        entrypoint, args = sys.executable, config.command[1:]
    try:
        elastic_launch(launch, entrypoint)(*args)
    except ChildFailedError as e:
        sys.stderr.write(_summary(e, log_dir, config.tail_lines))
        sys.stderr.flush()
        return exit_status(e.get_first_failure()[1].exitcode) or 1
    except RendezvousError as e:
        sys.stderr.write(f"{NAME}: the rendezvous at {config.rdzv_endpoint} failed: {e}\n")
        return 1
    finally:
        if relay is not None:
            relay.stop()
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0

"""Start the ranks of a data-parallel job on this node and watch over them.

``bagua-launch --nproc-per-node N script.py args...`` starts N processes of
``python script.py args...`` (``-m module`` and ``--no-python program`` work too),
each with the variables ``torchrun`` and Bagua's launcher set::

    RANK              node_rank * nproc_per_node + local_rank
    LOCAL_RANK        0 .. nproc_per_node - 1
    WORLD_SIZE        nnodes * nproc_per_node
    LOCAL_WORLD_SIZE  nproc_per_node
    NODE_RANK         --node-rank
    MASTER_ADDR       --master-addr
    MASTER_PORT       --master-port

so JAX (``jax.distributed.initialize`` with coordinator ``MASTER_ADDR:MASTER_PORT``)
and PyTorch (``init_process_group`` with ``env://``) scripts both find their peers.
With ``--mpi`` one ``mpiexec -n nnodes*nproc_per_node`` job is started instead and
every rank runs under :mod:`bagua_launch.rank_env`, which sets the same variables
from the MPI launcher's (``PMI_RANK``, ``OMPI_COMM_WORLD_RANK``, ...).

What the launcher does while the job runs:

* Every line a rank writes is printed as ``[rank N] line``, stdout to stdout and
  stderr to stderr. Ranks get ``PYTHONUNBUFFERED=1`` (unless set) so lines arrive
  promptly, and stdin is ``/dev/null``.
* Ranks get ``OMP_NUM_THREADS`` = this node's cores / ``nproc_per_node`` (at least 1)
  unless it is set, so the ranks' OpenMP pools (native kernels, torch) share the cores
  instead of each taking all of them.
* Each rank runs in its own process group: Ctrl-C in a terminal reaches the launcher
  only, and the launcher forwards SIGINT, SIGTERM, SIGHUP and SIGQUIT to every rank's
  group, waits up to ``--grace`` seconds, kills what is left with SIGKILL and exits
  with 128 + the signal number. A second such signal kills the ranks at once.
  SIGUSR1 and SIGUSR2 are forwarded and the job goes on (under ``--mpi`` the ranks
  ignore SIGUSR1, which Hydra uses itself). If the launcher itself is
  killed, its ranks get SIGKILL (Linux).
* When a rank exits non-zero (or is killed by a signal), the launcher sends SIGTERM to
  the others, SIGKILL after ``--grace`` seconds, and exits with that rank's exit code
  (128 + N for signal N) after a summary on stderr naming the rank, its exit code and
  its last lines of output.
* ``--timeout`` stops the job the same way after that many seconds; exit code 124.

A job where every rank exits 0 exits 0 and prints nothing of the launcher's own.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bagua_common.comm.bagua_net import bagua_net_environment
from bagua_common.data.cache_stores import ENV_CACHE_URL, parse_capacity
from bagua_common.data.redis_server import RedisServer, checked_bind_address, find_redis_server
from bagua_common.job.child_process import die_with_parent
from bagua_common.job.local_launch import free_port
from bagua_launch import elastic

__all__ = ["DEFAULT_MULTINODE_PORT", "RANK_VARIABLES", "Launcher", "build_parser", "main", "rank_environment"]

#: ``--master-port`` default with ``--nnodes`` > 1 (every node must agree on it; torchrun's).
#: A single-node job gets a free port of this machine instead.
DEFAULT_MULTINODE_PORT = 29500

RANK_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")

_STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name)
)
_PASS_SIGNALS = tuple(getattr(signal, name) for name in ("SIGUSR1", "SIGUSR2") if hasattr(signal, name))
_TIMEOUT_EXIT = 124
_POLL = 0.05
_PREFIX_RE = re.compile(rb"^\[rank (\d+)\] ")
_NAME = "bagua-launch"


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


# --------------------------------------------------------------------------- command line


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"not a TCP port: {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=_NAME,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage=f"{_NAME} [options] (script.py | -m module | --no-python program) [args ...]",
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
            f"  {_NAME} --nproc-per-node 4 train.py --lr 0.1\n"
            f"  {_NAME} --nproc-per-node 2 -m mypackage.train\n"
            f"  {_NAME} --nproc-per-node 2 --mpi train.py          # one 'mpiexec -n 2' job\n"
            "  # two nodes, two ranks each; run on every node with its own --node-rank:\n"
            f"  {_NAME} --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 10.0.0.1 train.py\n"
            "  # elastic, 1 to 4 nodes (torch's elastic agent); the same command on every node:\n"
            f"  {_NAME} --nnodes 1:4 --nproc-per-node 2 --max-restarts 3 --rdzv-endpoint 10.0.0.1:29400 train.py\n"
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
        "launcher once, on node 0, and place ranks on hosts with --mpi-args",
    )
    mpi.add_argument(
        "--mpiexec",
        default=None,
        metavar="PATH",
        help="the mpiexec to use (default: the one beside this Python, else the one on PATH)",
    )
    mpi.add_argument(
        "--mpi-args", default="", metavar="'ARGS'", help="extra mpiexec arguments, e.g. '-hosts a,b -ppn 2'"
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


@dataclass
class Config:
    nproc_per_node: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    command: list[str]  # what one rank runs (without the launcher's own wrapper)
    mode: str  # "script", "module" or "program"
    mpi: bool
    mpiexec: str | None
    mpi_args: list[str]
    grace: float
    timeout: float | None
    tail_lines: int
    cache_server: str | None = None
    cache_capacity: int | None = None
    cache_bind: str | None = None
    nccl_net: dict[str, str] = field(default_factory=dict)  # --enable-bagua-net: NCCL's plugin variables


def parse_args(argv: list[str] | None) -> Config | elastic.ElasticConfig:
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
    if elastic.requested(ns):
        return elastic.config_from(ns, parser, command, mode)
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
        mpiexec = ns.mpiexec or _find_mpiexec()
        if mpiexec is None:
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
    try:
        nccl_net = bagua_net_environment() if ns.enable_bagua_net else {}
    except FileNotFoundError as e:
        parser.error(f"--enable-bagua-net: {e}")
    try:
        mpi_args = shlex.split(ns.mpi_args)
    except ValueError as e:
        parser.error(f"--mpi-args: {e}")
    return Config(
        nproc_per_node=ns.nproc_per_node,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        master_addr=master_addr,
        master_port=master_port,
        command=command,
        mode=mode,
        mpi=ns.mpi,
        mpiexec=mpiexec,
        mpi_args=mpi_args,
        grace=ns.grace,
        timeout=ns.timeout,
        tail_lines=ns.tail_lines,
        cache_server=ns.cache_server,
        cache_capacity=ns.cache_capacity,
        cache_bind=ns.cache_bind,
        nccl_net=nccl_net,
    )


def _find_mpiexec() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def _is_hydra(mpiexec: str) -> bool:
    """Whether ``mpiexec`` is MPICH's Hydra (Intel MPI's too)."""
    try:
        probe = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return "HYDRA" in (probe.stdout + probe.stderr).upper()


# --------------------------------------------------------------------------- processes


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _describe(code: int | None) -> str:
    if code is None:
        return "gone without an exit status"
    if code < 0:
        return f"killed by {_signal_name(-code)}"
    return f"exit code {code}"


def _exit_status(code: int) -> int:
    """A rank's return code as a shell exit status (128 + N for signal N)."""
    return 128 - code if code < 0 else code


def _ranges(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ", ".join(parts)


class _Output:
    """The launcher's stdout and stderr, shared by the reader threads (whole lines, flushed)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.streams = {"stdout": sys.stdout, "stderr": sys.stderr}
        self.broken: set[str] = set()

    def write(self, which: str, data: bytes) -> None:
        stream = self.streams[which]
        with self.lock:
            if which in self.broken:
                return
            try:
                buffer = getattr(stream, "buffer", None)
                if buffer is not None:
                    buffer.write(data)
                else:
                    stream.write(data.decode(errors="replace"))
                stream.flush()
            except (BrokenPipeError, ValueError, OSError):
                self.broken.add(which)  # keep draining the ranks' pipes; nothing to print to

    def message(self, text: str) -> None:
        self.write("stderr", text.encode())


@dataclass
class _Child:
    label: str  # "rank 3" or "mpiexec"
    rank: int | None
    proc: subprocess.Popen
    readers: list[threading.Thread] = field(default_factory=list)
    returncode: int | None = None
    exited_at: float | None = None


class Launcher:
    """One job: start, watch, stop, summarize. ``run()`` returns the exit status."""

    def __init__(self, config: Config, output: _Output | None = None) -> None:
        self.config = config
        self.out = output or _Output()
        self.children: list[_Child] = []
        self.tails: dict[object, collections.deque] = {}  # rank (or "mpiexec") -> its last lines
        self.events: queue.Queue[_Child] = queue.Queue()
        self.stop_reason: str | None = None  # "failure", "signal", "timeout"
        self.stopped_at: float | None = None
        self.kill_at: float | None = None
        self.killed = False
        self.signal_received: int | None = None
        self.failure: tuple[int, int | None] | None = None  # (first failing rank, its return code)
        self.status_dir: Path | None = None
        self.statuses: dict[int, dict] = {}  # MPI: rank -> {"code": return code or None, "time": when}
        self.pids: dict[int, dict[str, int]] = {}  # MPI: rank -> its wrapper's pid and its script's group
        self.lost: list[int] = []  # MPI: ranks killed together, none known to be first
        self.cache_server: RedisServer | None = None  # --cache-server: started in run(), stopped after

    # ------------------------------------------------------------------ start

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for name in RANK_VARIABLES:
            env.pop(name, None)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # Each rank's OpenMP pool (the native kernels, torch) would otherwise take every core,
        # oversubscribing the node nproc-per-node times over; the user's setting wins.
        env.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // self.config.nproc_per_node)))
        env["MASTER_ADDR"] = self.config.master_addr
        env["MASTER_PORT"] = str(self.config.master_port)
        if self.cache_server is not None:
            env.update(self.cache_server.environment())
        env.update(self.config.nccl_net)
        return env

    def _spawn(
        self,
        label: str,
        rank: int | None,
        command: list[str],
        env: dict[str, str],
        death_signal: int,
        ignore_sigpipe: bool = False,
    ) -> _Child:
        proc = subprocess.Popen(
            command,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            process_group=0,
            preexec_fn=die_with_parent(death_signal),
            restore_signals=not ignore_sigpipe,
        )
        child = _Child(label, rank, proc)
        self.children.append(child)
        return child

    def _start_local(self) -> None:
        c = self.config
        base = self._base_env()
        for local_rank in range(c.nproc_per_node):
            if self.stop_reason is not None:  # a signal arrived while starting
                break
            env = base | rank_environment(
                local_rank=local_rank,
                nproc_per_node=c.nproc_per_node,
                nnodes=c.nnodes,
                node_rank=c.node_rank,
                master_addr=c.master_addr,
                master_port=c.master_port,
            )
            rank = int(env["RANK"])
            self._spawn(f"rank {rank}", rank, c.command, env, signal.SIGKILL)

    def _start_mpi(self) -> None:
        c = self.config
        from . import rank_env

        self.status_dir = Path(tempfile.mkdtemp(prefix="bagua-launch-"))
        env = self._base_env()
        env[rank_env.STATUS_DIR_VARIABLE] = str(self.status_dir)
        env[rank_env.NPROC_VARIABLE] = str(c.nproc_per_node)
        wrapper_flags = {"script": [], "module": ["--module"], "program": ["--no-python"]}[c.mode]
        target = c.command if c.mode == "program" else c.command[1:]  # drop the interpreter
        if c.mode == "module":
            target = target[1:]  # and "-m"
        # Hydra would SIGKILL every rank as soon as one dies of a signal, before the others could
        # report their exit status; the launcher stops the job itself (SIGTERM, --grace, SIGKILL).
        cleanup = (
            ["-disable-auto-cleanup"] if _is_hydra(c.mpiexec) and "-disable-auto-cleanup" not in c.mpi_args else []
        )
        command = [
            c.mpiexec,
            *cleanup,
            *c.mpi_args,
            "-n",
            str(c.nnodes * c.nproc_per_node),
            sys.executable,
            os.path.abspath(rank_env.__file__),
            *wrapper_flags,
            "--",
            *target,
        ]
        # Hydra may still write to the connection of a proxy whose rank has just finished; with
        # SIGPIPE ignored (inherited from this Python) that is an EPIPE it handles, not a kill
        # that turns a finished job into a failure (seen with remote proxies).
        self._spawn("mpiexec", None, command, env, signal.SIGTERM, ignore_sigpipe=True)

    def _start_readers(self) -> None:
        for child in self.children:
            prefix = None if child.rank is None else f"[rank {child.rank}] ".encode()
            for which, pipe in (("stdout", child.proc.stdout), ("stderr", child.proc.stderr)):
                t = threading.Thread(target=self._pump, args=(pipe, which, prefix, child), daemon=True)
                t.start()
                child.readers.append(t)
            waiter = threading.Thread(target=self._wait, args=(child,), daemon=True)
            waiter.start()

    def _pump(self, pipe, which: str, prefix: bytes | None, child: _Child) -> None:
        try:
            for line in iter(pipe.readline, b""):
                if not line.endswith(b"\n"):
                    line += b"\n"
                if prefix is not None:
                    line = prefix + line
                    key: object = child.rank
                else:  # mpiexec's output: the rank_env wrappers already prefixed their lines
                    match = _PREFIX_RE.match(line)
                    key = int(match.group(1)) if match else child.label
                self.out.write(which, line)
                tail = self.tails.get(key)
                if tail is None:  # setdefault: atomic, the stdout and stderr readers may race here
                    tail = self.tails.setdefault(key, collections.deque(maxlen=max(self.config.tail_lines, 1)))
                tail.append(line.decode(errors="replace").rstrip("\r\n"))
        except (OSError, ValueError):
            pass
        finally:
            try:
                pipe.close()
            except OSError:
                pass

    def _wait(self, child: _Child) -> None:
        child.proc.wait()
        self.events.put(child)

    # ------------------------------------------------------------------ stop

    def _send(self, sig: int) -> None:
        """Send ``sig`` to every rank still running, once.

        Local ranks: to each rank's process group. MPI: to each rank_env wrapper (it relays the
        signal to its script) when every rank has told its pid, else to mpiexec, which relays it
        to the wrappers' process groups (and reports that it was signalled).
        """
        for child in self.children:
            if child.proc.returncode is not None:
                continue
            try:
                if child.rank is not None:
                    os.killpg(child.proc.pid, sig)
                    continue
                wrappers = self._running_wrappers()
                if wrappers is None:
                    os.kill(child.proc.pid, sig)
                    continue
                for pid in wrappers:
                    try:
                        os.kill(pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
            except (ProcessLookupError, PermissionError):
                pass

    def _begin_stop(self, reason: str, sig: int = signal.SIGTERM) -> None:
        if self.stop_reason is not None:
            return
        self.stop_reason = reason
        self.stopped_at = time.time()
        self.kill_at = time.monotonic() + self.config.grace
        self._send(sig)

    def _kill_all(self) -> None:
        """SIGKILL every rank's process group (MPI: mpiexec's, and each wrapper and script on this node)."""
        if self.killed:
            return
        self.killed = True
        own = os.getpgrp()
        groups = {c.proc.pid for c in self.children if c.proc.returncode is None}
        pids = set()
        for rank, info in self._pid_files().items():
            if rank not in self.statuses:
                groups.add(info["child"])
                pids.add(info["pid"])
        for pgid in groups - {own}:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _pid_files(self) -> dict[int, dict[str, int]]:
        """MPI: {rank: {"pid": wrapper pid, "child": the script's process group}} of this node's ranks."""
        if self.status_dir is None:
            return {}
        world = self.config.nnodes * self.config.nproc_per_node
        if len(self.pids) < world:
            for path in self.status_dir.glob("rank*.pid"):
                try:
                    rank = int(path.stem[4:])
                    if rank not in self.pids:
                        info = json.loads(path.read_text())
                        self.pids[rank] = {"pid": int(info["pid"]), "child": int(info["child"])}
                except (OSError, ValueError, KeyError, TypeError):
                    pass
        return self.pids

    def _running_wrappers(self) -> list[int] | None:
        """The pids of the wrappers still running, or None unless every rank is known here."""
        self._poll_statuses()
        known = self._pid_files()
        if len(known) < self.config.nnodes * self.config.nproc_per_node:
            return None
        return [info["pid"] for rank, info in known.items() if rank not in self.statuses]

    def _on_signal(self, signum: int, frame) -> None:
        if signum in _PASS_SIGNALS:
            self._send(signum)
            return
        if self.signal_received is None:
            self.signal_received = signum
            if self.stop_reason is None:
                self._begin_stop("signal", signum)
            else:  # already stopping (a rank failed, --timeout): pass the signal on all the same
                self._send(signum)
        else:  # a second signal: no more waiting
            self._kill_all()

    # ------------------------------------------------------------------ watch

    def _poll_statuses(self) -> None:
        """MPI: read the exit statuses the rank_env wrappers wrote; the first non-zero is the failure."""
        if self.status_dir is None:
            return
        for path in self.status_dir.glob("rank*.json"):
            try:
                rank = int(path.stem[4:])
                if rank in self.statuses:
                    continue
                self.statuses[rank] = json.loads(path.read_text())
            except (OSError, ValueError):
                continue

    def _check_wrappers(self) -> None:
        """MPI: a wrapper of this node gone without writing its exit status (killed) is a failure too.

        Hydra then kills the other ranks at once; when several are found gone together, which
        one went first is unknown (``_mpi_failure`` says so).
        """
        now = time.time()
        for rank, info in self._pid_files().items():
            if rank in self.statuses:
                continue
            try:
                os.kill(info["pid"], 0)
                continue
            except PermissionError:
                continue
            except ProcessLookupError:
                pass
            self._poll_statuses()  # it writes its status just before it exits
            self.statuses.setdefault(rank, {"code": None, "time": now})

    def _mpi_failure(self) -> tuple[int, int] | None:
        bad = [
            (s["time"], r, s.get("code"))
            for r, s in self.statuses.items()
            if s.get("code") != 0 and (self.stopped_at is None or s["time"] <= self.stopped_at)
        ]
        if not bad:
            return None
        first, rank, code = min(bad, key=lambda b: (b[0], b[1]))
        if code is None and sum(1 for b in bad if b[0] == first) > 1:
            self.lost = sorted(b[1] for b in bad if b[0] == first)
            return None
        return rank, code

    def _watch(self) -> None:
        start = time.monotonic()
        running = len(self.children)
        while running:
            try:
                child = self.events.get(timeout=_POLL)
            except queue.Empty:
                child = None
            if child is not None:
                running -= 1
                child.returncode = child.proc.returncode
                child.exited_at = time.time()
                if child.returncode != 0 and self.stop_reason is None and child.rank is not None:
                    self.failure = (child.rank, child.returncode)
                    self._begin_stop("failure")
            if self.status_dir is not None:
                self._poll_statuses()
                self._check_wrappers()
                if self.stop_reason is None and (failed := self._mpi_failure()) is not None:
                    self.failure = failed
                    self._begin_stop("failure")
                elif self.stop_reason is None and self.lost:
                    self._begin_stop("lost")
            now = time.monotonic()
            if self.config.timeout is not None and self.stop_reason is None and now - start > self.config.timeout:
                self._begin_stop("timeout")
            if self.kill_at is not None and now > self.kill_at:
                self._kill_all()

    # ------------------------------------------------------------------ report

    def _rank_codes(self) -> dict[int, tuple[int | None, float | None]]:
        """Each rank's return code (negative: killed by that signal) and when it exited."""
        if self.status_dir is None:
            return {c.rank: (c.returncode, c.exited_at) for c in self.children if c.rank is not None}
        world = self.config.nnodes * self.config.nproc_per_node
        codes: dict[int, tuple[int | None, float | None]] = {r: (None, None) for r in range(world)}
        for r, s in self.statuses.items():
            codes[r] = (s.get("code"), s.get("time"))
        return codes

    def _summary(self, headline: str, tail_key: object | None) -> None:
        lines = ["", f"==================== {_NAME}: {headline} ===================="]
        by_status: dict[str, list[int]] = collections.defaultdict(list)
        failing = None if self.failure is None else self.failure[0]
        for rank, (code, exited) in self._rank_codes().items():
            text = _describe(code)
            stopped = self.stopped_at is not None and exited is not None and exited >= self.stopped_at
            if code != 0 and rank != failing and stopped:
                text += " (stopped by the launcher)"
            by_status[text].append(rank)
        for text, ranks in sorted(by_status.items(), key=lambda kv: min(kv[1])):
            lines.append(f"{'rank' if len(ranks) == 1 else 'ranks'} {_ranges(ranks)}: {text}")
        mpiexec = next((c for c in self.children if c.rank is None), None)
        if mpiexec is not None:
            stopped = " (stopped by the launcher)" if self.stop_reason and mpiexec.returncode else ""
            lines.append(f"mpiexec: {_describe(mpiexec.returncode)}{stopped}")
        if tail_key is not None and self.config.tail_lines and self.tails.get(tail_key):
            name = f"rank {tail_key}" if isinstance(tail_key, int) else tail_key
            lines.append(f"-------------------- last lines of {name} --------------------")
            lines.extend(list(self.tails[tail_key])[-self.config.tail_lines :])
        lines.append("=" * (len(lines[1])))
        self.out.message("\n".join(lines) + "\n")

    def _report(self) -> int:
        if self.stop_reason == "failure" and self.failure is not None:
            rank, code = self.failure
            self._summary(f"rank {rank} failed ({_describe(code)})", rank)
            return (code is not None and _exit_status(code)) or 1
        if self.signal_received is not None:
            name = _signal_name(self.signal_received)
            self._summary(f"stopped by {name}", None)
            return 128 + self.signal_received
        if self.stop_reason == "lost":
            ranks = _ranges(self.lost)
            self._summary(f"ranks {ranks} were killed together (first unknown)", "mpiexec")
            return 1
        if self.stop_reason == "timeout":
            self._summary(f"timed out after {self.config.timeout:g} s", None)
            return _TIMEOUT_EXIT
        mpiexec = next((c for c in self.children if c.rank is None), None)
        if mpiexec is not None and mpiexec.returncode:
            # mpiexec failed without a rank reporting a failure (it could not start them, a rank was killed).
            failed = self._mpi_failure()
            if failed is not None:
                self.failure = failed
                self._summary(f"rank {failed[0]} failed ({_describe(failed[1])})", failed[0])
                return (failed[1] is not None and _exit_status(failed[1])) or 1
            self._summary(f"mpiexec failed ({_describe(mpiexec.returncode)})", "mpiexec")
            return _exit_status(mpiexec.returncode) or 1
        return 0

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        handlers = {}
        for sig in _STOP_SIGNALS + _PASS_SIGNALS:
            try:
                handlers[sig] = signal.signal(sig, self._on_signal)
            except (ValueError, OSError):  # not the main thread
                pass
        try:
            if self.config.cache_server == "redis":
                try:
                    self.cache_server = RedisServer(self.config.cache_capacity, bind=self.config.cache_bind).start()
                except (OSError, RuntimeError) as e:  # TimeoutError is an OSError
                    self.out.message(f"{_NAME}: cannot start the cache server: {e}\n")
                    return 1
            try:
                self._start_mpi() if self.config.mpi else self._start_local()
            except OSError as e:
                self.out.message(f"{_NAME}: cannot start {self.config.command[0]!r}: {e}\n")
                self._begin_stop("failure")
                self._kill_all()
                for child in self.children:
                    child.proc.wait()
                return 127
            self._start_readers()
            self._watch()
            for child in self.children:
                for t in child.readers:
                    t.join(timeout=2.0)  # a grandchild may still hold a pipe open
            if self.status_dir is not None:
                self._poll_statuses()
            return self._report()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            if self.status_dir is not None:
                shutil.rmtree(self.status_dir, ignore_errors=True)
            if self.cache_server is not None:
                self.cache_server.stop()


def main(argv: list[str] | None = None) -> int:
    """The ``bagua-launch`` command: returns the exit status."""
    config = parse_args(argv)
    if isinstance(config, elastic.ElasticConfig):
        return elastic.run(config)
    return Launcher(config).run()

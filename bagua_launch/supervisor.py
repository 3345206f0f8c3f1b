"""The supervisor of one job's ranks on this node: start them, relay their output and signals, stop them.

:class:`Launcher` starts each rank with the variables ``torchrun`` and Bagua's launcher set
(:mod:`bagua_launch.rank_variables`), so JAX and PyTorch scripts both find their peers. With
``--mpi`` one ``mpiexec -n nnodes*nproc_per_node`` job is started instead, each rank under
:mod:`bagua_launch.rank_env`.

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
  ignore SIGUSR1, which Hydra uses itself). If the launcher is killed, so are its ranks.
* When a rank exits non-zero (or is killed by a signal), the launcher sends SIGTERM to
  the others, SIGKILL after ``--grace`` seconds, and exits with that rank's exit code
  (128 + N for signal N) after a summary on stderr naming the rank, its exit code and
  its last lines of output. Of several ranks failing within 0.1 s, it names the first
  killed from outside, the likely cause of the others' errors (:mod:`bagua_launch.root_cause`).
* ``--timeout`` stops the job the same way after that many seconds; exit code 124.

A job where every rank exits 0 exits 0 and prints nothing of the launcher's own.
"""

from __future__ import annotations

import collections
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from bagua_common.data.cache_stores import ENV_CACHE_DIR
from bagua_common.data.private_files import job_directory
from bagua_common.data.redis_server import RedisServer
from bagua_common.job.child_process import die_with_parent
from bagua_common.job.local_launch import is_hydra
from bagua_common.job.rank_environment import NPROC_VARIABLE, threads_per_rank
from bagua_launch.output import NAME, RankOutput, describe_exit, exit_status, rank_ranges, signal_name, summary
from bagua_launch.rank_variables import RANK_VARIABLES, rank_environment
from bagua_launch.root_cause import SETTLE_S, root_cause
from bagua_launch.wrapper_reports import WrapperReports

__all__ = ["RANK_VARIABLES", "Config", "Launcher", "rank_environment"]

_STOP_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name)
)
_PASS_SIGNALS = tuple(getattr(signal, name) for name in ("SIGUSR1", "SIGUSR2") if hasattr(signal, name))
_TIMEOUT_EXIT = 124
_POLL = 0.05


@dataclass
class Config:
    """One job of local or MPI ranks, as the command line gave it."""

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
    cache_dir: str | None = None  # named by the user: kept after the job
    nccl_net: dict[str, str] = field(default_factory=dict)  # --enable-bagua-net: NCCL's plugin variables


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

    def __init__(self, config: Config, output: RankOutput | None = None) -> None:
        self.config = config
        self.out = output or RankOutput(config.tail_lines)
        self.children: list[_Child] = []
        self.events: queue.Queue[_Child] = queue.Queue()
        self.stop_reason: str | None = None  # "failure", "signal", "timeout"
        self.stopped_at: float | None = None
        self.kill_at: float | None = None
        self.killed = False
        self.signal_received: int | None = None
        self.failure: tuple[int, int | None] | None = None  # (first failing rank, its return code)
        self.reports: WrapperReports | None = None  # MPI: what the rank_env wrappers report
        self.cache_server: RedisServer | None = None  # --cache-server: started in run(), stopped after
        self.cache_dir: str | None = None  # the node's dataset cache: made in run(), removed after unless named

    # ------------------------------------------------------------------ start

    def _base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        for name in RANK_VARIABLES:
            env.pop(name, None)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # Each rank's OpenMP pool (the native kernels, torch) would otherwise take every core,
        # oversubscribing the node nproc-per-node times over; the user's setting wins.
        env.setdefault("OMP_NUM_THREADS", str(threads_per_rank(self.config.nproc_per_node)))
        env["MASTER_ADDR"] = self.config.master_addr
        env["MASTER_PORT"] = str(self.config.master_port)
        if self.cache_server is not None:
            env.update(self.cache_server.environment())
        if self.cache_dir is not None:
            env[ENV_CACHE_DIR] = self.cache_dir
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

        self.reports = WrapperReports(c.nnodes * c.nproc_per_node)
        env = self._base_env()
        env[rank_env.STATUS_DIR_VARIABLE] = str(self.reports.folder)
        env[NPROC_VARIABLE] = str(c.nproc_per_node)
        wrapper_flags = {"script": [], "module": ["--module"], "program": ["--no-python"]}[c.mode]
        target = c.command if c.mode == "program" else c.command[1:]  # drop the interpreter
        if c.mode == "module":
            target = target[1:]  # and "-m"
        # Hydra would SIGKILL every rank as soon as one dies of a signal, before the others could
        # report their exit status; the launcher stops the job itself (SIGTERM, --grace, SIGKILL).
        cleanup = ["-disable-auto-cleanup"] if is_hydra(c.mpiexec) and "-disable-auto-cleanup" not in c.mpi_args else []
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
            for which, pipe in (("stdout", child.proc.stdout), ("stderr", child.proc.stderr)):
                t = threading.Thread(target=self.out.relay, args=(pipe, which, child.rank, child.label), daemon=True)
                t.start()
                child.readers.append(t)
            waiter = threading.Thread(target=self._wait, args=(child,), daemon=True)
            waiter.start()

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
                wrappers = self.reports.running_wrappers()
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
        if self.reports is not None:
            for rank, info in self.reports.pid_files().items():
                if rank not in self.reports.statuses:
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

    def _ended_unnoticed(self) -> bool:
        """Whether a rank has ended that the watch has not noticed yet (its waiter thread has not run)."""
        for child in self.children:
            if child.rank is None or child.returncode is not None:
                continue
            try:
                if os.waitid(os.P_PID, child.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    return True  # a zombie: its waiter is about to reap it
            except ChildProcessError:
                return True  # reaped: its waiter is about to report it
        return False

    def _stop_for_failure(self, failures: list[tuple[int, int]]) -> None:
        """Name the rank whose failure ends the job (:mod:`bagua_launch.root_cause`) and stop the others."""
        self.failure = root_cause(failures) if self.reports is None else self.reports.failure(None)
        self._begin_stop("failure" if self.failure is not None else "lost")

    def _watch(self) -> None:
        start = time.monotonic()
        running = len(self.children)
        failures: list[tuple[int, int]] = []  # (rank, return code) in the order noticed
        settle_until = None  # SETTLE_S after the first failure noticed: the failing rank is named then
        while running or (settle_until is not None and self.stop_reason is None):
            try:
                child = self.events.get(timeout=_POLL)
            except queue.Empty:
                child = None
            if child is not None:
                running -= 1
                child.returncode = child.proc.returncode
                child.exited_at = time.time()
                if child.returncode != 0 and child.rank is not None:
                    failures.append((child.rank, child.returncode))
                    settle_until = settle_until or time.monotonic() + SETTLE_S
            if self.reports is not None:
                self.reports.poll_statuses()
                self.reports.check_gone()
                failing = self.stop_reason is None and (self.reports.failure(None) is not None or self.reports.lost)
                if settle_until is None and failing:
                    settle_until = time.monotonic() + SETTLE_S
            now = time.monotonic()
            settled = settle_until is not None and (now >= settle_until or not running)
            unreported = self.reports is not None and self.reports.ended_unreported()  # MPI's _ended_unnoticed
            if settled and self.stop_reason is None and not self._ended_unnoticed() and not unreported:
                self._stop_for_failure(failures)
            if self.config.timeout is not None and self.stop_reason is None and now - start > self.config.timeout:
                self._begin_stop("timeout")
            if self.kill_at is not None and now > self.kill_at:
                self._kill_all()

    # ------------------------------------------------------------------ report

    def _rank_codes(self) -> dict[int, tuple[int | None, float | None]]:
        """Each rank's return code (negative: killed by that signal) and when it exited."""
        if self.reports is None:
            return {c.rank: (c.returncode, c.exited_at) for c in self.children if c.rank is not None}
        codes: dict[int, tuple[int | None, float | None]] = {r: (None, None) for r in range(self.reports.world)}
        for r, s in self.reports.statuses.items():
            codes[r] = (s.get("code"), s.get("time"))
        return codes

    def _summary(self, headline: str, tail_key: object | None) -> None:
        lines = []
        by_status: dict[str, list[int]] = collections.defaultdict(list)
        failing = None if self.failure is None else self.failure[0]
        for rank, (code, exited) in self._rank_codes().items():
            text = describe_exit(code)
            stopped = self.stopped_at is not None and exited is not None and exited >= self.stopped_at
            if code != 0 and rank != failing and stopped:
                text += " (stopped by the launcher)"
            by_status[text].append(rank)
        for text, ranks in sorted(by_status.items(), key=lambda kv: min(kv[1])):
            lines.append(f"{'rank' if len(ranks) == 1 else 'ranks'} {rank_ranges(ranks)}: {text}")
        mpiexec = next((c for c in self.children if c.rank is None), None)
        if mpiexec is not None:
            stopped = " (stopped by the launcher)" if self.stop_reason and mpiexec.returncode else ""
            lines.append(f"mpiexec: {describe_exit(mpiexec.returncode)}{stopped}")
        name = f"rank {tail_key}" if isinstance(tail_key, int) else str(tail_key)
        self.out.message(summary(headline, lines, name, self.out.last_lines(tail_key)))

    def _report(self) -> int:
        if self.stop_reason == "failure" and self.failure is not None:
            rank, code = self.failure
            self._summary(f"rank {rank} failed ({describe_exit(code)})", rank)
            return (code is not None and exit_status(code)) or 1
        if self.signal_received is not None:
            self._summary(f"stopped by {signal_name(self.signal_received)}", None)
            return 128 + self.signal_received
        if self.stop_reason == "lost":
            ranks = rank_ranges(self.reports.lost)
            self._summary(f"ranks {ranks} were killed together (first unknown)", "mpiexec")
            return 1
        if self.stop_reason == "timeout":
            self._summary(f"timed out after {self.config.timeout:g} s", None)
            return _TIMEOUT_EXIT
        mpiexec = next((c for c in self.children if c.rank is None), None)
        if mpiexec is not None and mpiexec.returncode:
            # mpiexec failed without a rank reporting a failure (it could not start them, a rank was killed).
            failed = self.reports.failure(self.stopped_at)
            if failed is not None:
                self.failure = failed
                self._summary(f"rank {failed[0]} failed ({describe_exit(failed[1])})", failed[0])
                return (failed[1] is not None and exit_status(failed[1])) or 1
            self._summary(f"mpiexec failed ({describe_exit(mpiexec.returncode)})", "mpiexec")
            return exit_status(mpiexec.returncode) or 1
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
            # With --mpi the ranks of other nodes could not see a directory made here.
            if self.config.cache_dir is not None or not self.config.mpi:
                self.cache_dir = self.config.cache_dir or job_directory()
            if self.config.cache_server == "redis":
                try:
                    self.cache_server = RedisServer(self.config.cache_capacity, bind=self.config.cache_bind).start()
                except (OSError, RuntimeError) as e:  # TimeoutError is an OSError
                    self.out.message(f"{NAME}: cannot start the cache server: {e}\n")
                    return 1
            try:
                self._start_mpi() if self.config.mpi else self._start_local()
            except OSError as e:
                self.out.message(f"{NAME}: cannot start {self.config.command[0]!r}: {e}\n")
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
            if self.reports is not None:
                self.reports.poll_statuses()
            return self._report()
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            if self.reports is not None:
                self.reports.remove()
            if self.cache_server is not None:
                self.cache_server.stop()
            if self.cache_dir is not None and self.config.cache_dir is None:
                shutil.rmtree(self.cache_dir, ignore_errors=True)

"""Start torch test ranks by forking a server that has imported torch already.

Importing torch costs about 2.5 s of CPU here, and every rank a test starts pays it: the quick suite's torch jobs
spend a large part of their time importing. :func:`start_rank` forks the rank from one server process per test
session instead, which has imported torch and started no thread. A forked rank is what its ``python`` command
line would be: a session of its own, exactly the environment it is given, its output in its log file (or a FIFO
the test reads), fresh random seeds, the thread count of ``OMP_NUM_THREADS``. Used by
:func:`multiprocess.run_ranks` for modules named ``*_torch`` and by the fault-tolerant torch jobs' ranks; only for
programs that import torch and not JAX (JAX reads its settings when imported, and must not find torch loaded).
"""

from __future__ import annotations

import json
import os
import queue
import random
import runpy
import select
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

_REAP_S = 0.05  # how often the server collects its ranks' exits while no request comes


class ForkedRank:
    """A rank forked by the server, as much of ``subprocess.Popen`` as :func:`multiprocess.run_ranks` uses."""

    def __init__(self, server: _Client, pid: int):
        self._server, self.pid = server, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        self.returncode = self._server.exit_code(self.pid, wait=False)
        return self.returncode

    def wait(self) -> int:
        self.returncode = self._server.exit_code(self.pid, wait=True)
        return self.returncode


class _Client:
    """The test session's side of the server: requests go down its stdin, pids and exit codes come back."""

    def __init__(self, pythonpath: str):
        code = "import fork_server; fork_server.serve()"
        self._proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent), pythonpath])},
        )
        self._lock, self._changed = threading.Lock(), threading.Condition()
        self._started: queue.Queue[int] = queue.Queue()  # each request's pid, in order; -1 once the server is gone
        self._exits: dict[int, int] = {}
        threading.Thread(target=self._read, name="fork-server-reader", daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            if "started" in message:
                self._started.put(message["started"])
                continue
            with self._changed:
                self._exits[message["exited"]] = message["code"]
                self._changed.notify_all()
        self._started.put(-1)  # the server is gone: a request waiting for its pid must not wait forever
        with self._changed:
            self._changed.notify_all()

    def start(self, argv: list[str], env: dict[str, str], log: str) -> ForkedRank:
        assert self._proc.stdin is not None
        with self._lock:  # one request at a time: its pid is the next one back
            self._proc.stdin.write((json.dumps({"argv": argv, "env": env, "log": log}) + "\n").encode())
            self._proc.stdin.flush()
            try:
                pid = self._started.get(timeout=60)
            except queue.Empty:
                pid = -1
        if pid < 0:
            raise RuntimeError("the fork server did not start the rank (it ended; see the test output)")
        return ForkedRank(self, pid)

    def exit_code(self, pid: int, wait: bool) -> int | None:
        with self._changed:
            if wait:
                self._changed.wait_for(lambda: pid in self._exits or self._proc.poll() is not None)
            return self._exits.get(pid)


_client: _Client | None = None


def start_rank(argv: list[str], env: dict[str, str], log: Path) -> ForkedRank:
    """Fork a rank that runs ``python *argv`` (``["-m", module, ...]`` or ``[script, ...]``) with exactly ``env``,
    its output appended to ``log`` (a file, or a FIFO the caller reads)."""
    global _client
    if _client is None or _client._proc.poll() is not None:
        _client = _Client(env.get("PYTHONPATH", ""))
    return _client.start(argv, env, str(log))


def serve() -> None:
    """The server: import torch, then fork a rank per request line until stdin closes, reporting each rank's pid
    and, once reaped, its exit code (negative: the signal that ended it), one JSON line each."""
    import torch  # noqa: F401  (the point of the server)

    requests = sys.stdin.buffer
    while True:
        readable, _, _ = select.select([requests], [], [], _REAP_S)
        if readable:
            line = requests.readline()
            if not line:
                return
            pid = os.fork()
            if pid == 0:
                _become_rank(json.loads(line))
            _report(started=pid)
        _reap()


def _report(**message: int) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _report(exited=pid, code=os.waitstatus_to_exitcode(status))


def _become_rank(request: dict[str, Any]) -> None:
    """In the forked child: become the ``python`` command ``request["argv"]`` gives; never returns."""
    code = 1
    try:
        os.setsid()
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        nothing = os.open(os.devnull, os.O_RDONLY)
        os.dup2(nothing, 0)
        os.close(nothing)
        env = request["env"]
        os.environ.clear()
        os.environ.update(env)
        sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
        random.seed()
        import numpy
        import torch

        numpy.random.seed()
        torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
        argv = list(request["argv"])
        if argv[0] == "-m":
            sys.argv = argv[1:]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
        code = 0
    except SystemExit as end:
        code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

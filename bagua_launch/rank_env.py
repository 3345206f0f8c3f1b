"""One rank of an MPI-started job: set the launcher's rank variables from MPI's, run the script.

``bagua-launch --mpi`` starts ``mpiexec -n N python rank_env.py [--module|--no-python] -- target
args...``; it can also be used directly, e.g. ``srun python -m bagua_launch.rank_env train.py``.
This wrapper (runnable as a file) sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE`` and ``NODE_RANK`` from the MPI launcher's variables
(:func:`bagua_common.job.rank_environment.mpi_rank_environment`), keeps ``MASTER_ADDR`` and
``MASTER_PORT`` as the launcher set them (default ``127.0.0.1:29500``), and then

* runs the script as its child process, in a process group of its own, and forwards
  SIGINT, SIGTERM, SIGHUP, SIGQUIT and SIGUSR2 to it (exactly once, however the
  wrapper got them: to itself or to its process group); SIGUSR1 is ignored, because Hydra
  (with ``-disable-auto-cleanup``) sends it to report that another rank has exited, and the
  rank must keep running to finish or report its own error; the child gets SIGKILL if the
  wrapper dies;
* prints every line of the child's output as ``[rank N] line`` (stdout and stderr kept apart);
* exits with the child's exit code (128 + N if it died of signal N), after writing it to
  ``$BAGUA_LAUNCH_STATUS_DIR/rank<N>.json`` when the launcher asked for it (that is how
  ``bagua-launch`` learns which rank failed first, and the process groups to kill).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from bagua_common.job.child_process import die_with_parent
from bagua_common.job.rank_environment import mpi_rank_environment
from bagua_launch.output import exit_status

STATUS_DIR_VARIABLE = "BAGUA_LAUNCH_STATUS_DIR"
_FORWARDED = tuple(
    getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR2") if hasattr(signal, n)
)


def _parse(argv: list[str]) -> tuple[str, list[str]]:
    mode, i = "script", 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-m", "--module"):
            mode = "module"
        elif arg == "--no-python":
            mode = "program"
        elif arg == "--":
            i += 1
            break
        else:
            break
        i += 1
    if i >= len(argv):
        raise SystemExit("usage: python -m bagua_launch.rank_env [--module | --no-python] [--] target [args ...]")
    target, args = argv[i], argv[i + 1 :]
    if mode == "program":
        return mode, [target, *args]
    if mode == "module":
        return mode, [sys.executable, "-m", target, *args]
    return mode, [sys.executable, target, *args]


def _pump(pipe, out, prefix: bytes) -> None:
    buffer = getattr(out, "buffer", out)
    try:
        for line in iter(pipe.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            try:
                buffer.write(prefix + line)
                buffer.flush()
            except (BrokenPipeError, ValueError, OSError):
                pass
    finally:
        pipe.close()


def _write_json(path: str, value: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    """Run one rank: ``argv`` is ``[--module | --no-python] [--] target [args ...]``; returns its exit code."""
    _, command = _parse(sys.argv[1:] if argv is None else argv)
    try:
        variables = mpi_rank_environment()
    except (RuntimeError, ValueError) as e:
        sys.stderr.write(f"bagua_launch.rank_env: {e}\n")
        return 2
    rank = variables["RANK"]
    env = dict(os.environ) | variables
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop(STATUS_DIR_VARIABLE, None)
    status_dir = os.environ.get(STATUS_DIR_VARIABLE)
    prefix = f"[rank {rank}] ".encode()

    child: subprocess.Popen | None = None
    pending: list[int] = []

    def forward(signum, frame):
        if child is None:  # not started yet: forwarded once it is
            pending.append(signum)
            return
        try:
            os.killpg(child.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    try:
        child = subprocess.Popen(
            command,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            process_group=0,
            preexec_fn=die_with_parent(signal.SIGKILL),
            # MPI_Init in the script talks to the MPI launcher over this inherited socket.
            pass_fds=tuple(int(env[k]) for k in ("PMI_FD",) if env.get(k, "").isdigit()),
        )
    except OSError as e:
        sys.stderr.buffer.write(prefix + f"cannot start {command[0]!r}: {e}\n".encode())
        sys.stderr.flush()
        code = 127
        _report_status(status_dir, rank, code)
    else:
        for sig in pending:
            forward(sig, None)
        if status_dir:
            try:  # the launcher's folder exists on its own node only
                _write_json(os.path.join(status_dir, f"rank{rank}.pid"), {"pid": os.getpid(), "child": child.pid})
            except OSError:
                status_dir = None
        readers = [
            threading.Thread(target=_pump, args=(child.stdout, sys.stdout, prefix), daemon=True),
            threading.Thread(target=_pump, args=(child.stderr, sys.stderr, prefix), daemon=True),
        ]
        for t in readers:
            t.start()
        code = child.wait()
        # Reported at once, before the output is drained: a process the rank started may hold that open for long,
        # and mpiexec may kill this wrapper meanwhile once a peer has failed in turn.
        _report_status(status_dir, rank, code)
        for t in readers:
            t.join(timeout=2.0)
    return exit_status(code)


def _report_status(status_dir: str | None, rank: int, code: int) -> None:
    """Write the rank's return code and the time for the launcher (``status_dir`` None: nobody listens)."""
    if status_dir:
        try:
            _write_json(os.path.join(status_dir, f"rank{rank}.json"), {"code": code, "time": time.time()})
        except OSError:
            pass


if __name__ == "__main__":
    sys.exit(main())

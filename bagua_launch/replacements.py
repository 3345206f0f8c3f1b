"""A rank slot of a fault-tolerant job: run the rank, and when it dies, start a replacement that joins the job.

``bagua-launch --fault-tolerant`` (with torch's elastic agent: ``--nnodes MIN:MAX`` or
``--max-restarts``) has the agent start ``python -m bagua_launch.replacements COMMAND...`` in each
worker slot instead of the command itself. The slot runs the command; when it exits with an error
or is killed, the slot starts it again with ``BAGUA_FT_JOIN=1``, so the new process joins the
running job (a member sends it the state) instead of the agent restarting every worker. A rank lost
before the job formed its first epoch is started again as the same rank instead (the others are still
waiting for it to register: there is no running job to join yet). A clean
exit ends the slot; so does a rank ending after the job finished (its last step committed: status 0, as
nothing is left to train), the agent's SIGTERM (passed on to the rank), the agent's end (a SIGTERM to the
slot and to its rank when their parent dies, so that nothing outlives a killed launcher), and running out
of ``BAGUA_FT_REPLACEMENTS`` replacements (default 100). A replacement that finds no member of the job left
(every rank died: ``NoJobToJoin``) ends the slot with its status, so the agent restarts the whole job (its
``--max-restarts``), whose ranks go on from their last checkpoint. So do :data:`STARTS_THAT_NEVER_JOINED` starts in a
row that ended before they took part in the job (a replacement the job never admitted, a rank started again that
ended before the job formed): the next would most likely fail alike (an error in the script, a wrong setting), and
the summary names the error once instead of after a hundred replacements. Nor is a rank replaced once the members
stopped the job on an error its replacements would meet too (``NoProgress``: a step that times out at every attempt);
the slot ends with the rank's status (and the agent's ``--max-restarts`` apply).

Replacements find the job through ``BAGUA_FT_PEERS``: the launcher on each node hosts a small
store (a directory) where the node's members write where the job's coordinator is.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import subprocess
import sys
import time

from bagua_common.fault_tolerance.errors import NO_JOB_STATUS
from bagua_common.fault_tolerance.node_directory import (
    ENV_REPLACEMENT,
    admitted,
    job_finished,
    job_formed,
    job_stopped,
)
from bagua_common.fault_tolerance.settings import ENV_JOIN
from bagua_launch.output import NAME, describe_exit, exit_status

__all__ = ["ENV_REPLACEMENTS", "STARTS_THAT_NEVER_JOINED", "main"]

ENV_REPLACEMENTS = "BAGUA_FT_REPLACEMENTS"
"""How many replacements a slot starts before it gives up (and the agent's own restart policy applies)."""
STARTS_THAT_NEVER_JOINED = 3
"""Starts in a row ending before they took part in the job that end the slot: a replacement killed once before its
admission is replaced again, one that fails the same way every time is not started forever."""


_PR_SET_PDEATHSIG = 1


def _terminated_with_parent() -> None:
    """Ask Linux for a SIGTERM when this process's parent ends (elsewhere: nothing)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def main(command: list[str]) -> int:
    """Run ``command`` (a rank) and its replacements; return the exit status the agent sees."""
    if not command:
        print(f"{NAME}: usage: python -m bagua_launch.replacements COMMAND...", file=sys.stderr)
        return 2
    left = int(os.environ.get(ENV_REPLACEMENTS, "100"))
    env = {k: v for k, v in os.environ.items() if k != ENV_REPLACEMENT}
    stopping, never_joined = False, 0
    rank: subprocess.Popen | None = None

    def stop(signum: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True
        if rank is not None and rank.poll() is None:
            rank.send_signal(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    parent = os.getppid()
    _terminated_with_parent()
    if os.getppid() != parent:  # the agent ended before the request took effect
        return 1
    while True:
        started = time.monotonic()
        rank = subprocess.Popen(command, env=env, preexec_fn=_terminated_with_parent)
        code = rank.wait()
        if code == 0 or stopping or left <= 0:
            return exit_status(code)
        if code == NO_JOB_STATUS and env.get(ENV_JOIN) == "1":
            print(
                f"{NAME}: rank {env.get('RANK', '?')}'s replacement found no member of the job left: ending the slot, "
                "so that the launcher restarts the whole job (within --max-restarts), from its last checkpoint",
                file=sys.stderr,
                flush=True,
            )
            return code
        if job_finished():
            print(
                f"{NAME}: rank {env.get('RANK', '?')} ended ({describe_exit(code)}) after the job finished: "
                "not replaced",
                file=sys.stderr,
                flush=True,
            )
            return 0
        if job_stopped():
            print(
                f"{NAME}: rank {env.get('RANK', '?')} ended ({describe_exit(code)}) after the members stopped the "
                "job on an error a replacement would meet too (NoProgress, above): not replaced",
                file=sys.stderr,
                flush=True,
            )
            return exit_status(code)
        took_part = admitted(env[ENV_REPLACEMENT]) if ENV_REPLACEMENT in env else job_formed()
        never_joined = 0 if took_part else never_joined + 1
        if never_joined >= STARTS_THAT_NEVER_JOINED:
            print(
                f"{NAME}: rank {env.get('RANK', '?')} ended ({describe_exit(code)}) before it took part in the job, "
                f"{never_joined} times in a row: ending the slot rather than starting it again to fail alike",
                file=sys.stderr,
                flush=True,
            )
            return exit_status(code)
        left -= 1
        if env.get(ENV_JOIN) != "1" and not job_formed():
            how = "starting it again: the job had not formed yet"
        else:
            how = "starting a replacement that joins the running job"
            env[ENV_JOIN], env[ENV_REPLACEMENT] = "1", secrets.token_hex(8)
        print(
            f"{NAME}: rank {env.get('RANK', '?')} ended ({describe_exit(code)}) after {time.monotonic() - started:.1f} "
            f"s; {how}",
            file=sys.stderr,
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

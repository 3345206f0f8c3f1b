"""Joining ``jax.distributed`` for the multi-process mesh mode, bounded by Bagua's timeout.

JAX's own defaults let a failed job linger: a collective with a dead or hung peer waits
without bound, the coordination service notices a lost process only after 100 s, a
process that raised waits up to 300 s for the others at shutdown, and the preemption
service turns SIGTERM into a notice a training loop never reads. :func:`initialize` sets
every one of those bounds from the collective timeout (``BAGUA_COMM_TIMEOUT``, checked
here, before anything connects), keeps SIGTERM's default action, and lets a process that
an exception ends exit at once.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import sys
from typing import TypeVar

import jax

from bagua_common.comm.engine_exit import exiting_on_uncaught_exception
from bagua_common.comm.timeout import timeout_seconds
from bagua_common.job.rank_environment import environment_int

T = TypeVar("T")

# XLA's CPU collectives (gloo): how long one collective, and its rendezvous, may wait.
_CPU_COLLECTIVE_TIMEOUT_FLAGS = (
    "xla_cpu_collective_timeout_seconds",
    "xla_cpu_collective_call_terminate_timeout_seconds",
)


def _set_xla_flags(seconds: int) -> None:
    """Add the CPU collective timeouts to ``XLA_FLAGS``, keeping any the user set."""
    flags = os.environ.get("XLA_FLAGS", "")
    given = {word.split("=", 1)[0].lstrip("-") for word in flags.split()}
    extra = [f"--{name}={seconds}" for name in _CPU_COLLECTIVE_TIMEOUT_FLAGS if name not in given]
    os.environ["XLA_FLAGS"] = " ".join([flags, *extra]).strip()


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    timeout: float | None = None,
) -> None:
    """Join the processes of a multi-process mesh job (``jax.distributed.initialize``).

    Arguments left out come from the launcher's environment (``MASTER_ADDR``:``MASTER_PORT``,
    ``WORLD_SIZE``, ``RANK``, as ``bagua-launch`` and ``torchrun`` set them). ``timeout``
    (default ``BAGUA_COMM_TIMEOUT`` or 300 s; an invalid value raises a ``ValueError``)
    bounds connecting, each CPU collective (gloo), the detection of a lost process and the
    wait for the others at shutdown. Call it first, before any JAX computation: XLA reads
    its collective timeouts when the backend starts.
    """
    seconds = math.ceil(timeout_seconds(timeout))
    if coordinator_address is None:
        address, port = os.environ.get("MASTER_ADDR") or None, environment_int("MASTER_PORT")
        coordinator_address = f"{_required('MASTER_ADDR', address)}:{_required('MASTER_PORT', port)}"
    if num_processes is None:
        num_processes = _required("WORLD_SIZE", environment_int("WORLD_SIZE"))
    if process_id is None:
        process_id = _required("RANK", environment_int("RANK"))
    _set_xla_flags(seconds)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # The preemption service replaces SIGTERM's action with a notice; a launcher stopping
    # the job (or a user's kill) must end the process.
    jax.config.update("jax_enable_preemption_service", False)
    # One timeout for joining, for a silent peer and for leaving.
    timeouts = dict.fromkeys(
        ("initialization_timeout", "heartbeat_timeout_seconds", "shutdown_timeout_seconds"), seconds
    )
    jax.distributed.initialize(coordinator_address, num_processes, process_id, **timeouts)
    atexit.register(_leave_at_once_on_uncaught_exception)


def _leave_at_once_on_uncaught_exception() -> None:
    """Exit without JAX's shutdown barrier when an exception is ending the process.

    The barrier waits for every peer to shut down too, but a peer may be blocked in a
    collective with this process (or dead): the failed process would outlive its error by
    the whole timeout, and a launcher would blame a healthy rank.
    """
    if exiting_on_uncaught_exception():
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


def _required(name: str, value: T | None) -> T:
    if value is None:
        raise ValueError(
            f"{name} is not set: start the processes with bagua-launch (or torchrun), "
            "or pass coordinator_address, num_processes and process_id"
        )
    return value

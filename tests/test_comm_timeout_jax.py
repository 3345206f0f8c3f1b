"""BAGUA_COMM_TIMEOUT in the JAX front end: checked when a communicator or the multi-process
mesh starts, with a message naming the variable and the value; importing never fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bagua_common.comm import mpi_rendezvous
from bagua_jax import native_communicator
from bagua_jax.distributed import initialize
from bagua_jax.native_communicator import NativeCommunicator

ROOT = Path(__file__).resolve().parent.parent
BAD = ["abc", "0", "-1", "inf", "nan"]


def test_import_ignores_a_bad_value():
    env = {**os.environ, "BAGUA_COMM_TIMEOUT": "abc", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import bagua_jax, bagua_jax.trainer, bagua_jax.distributed",
        ],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("bad", BAD)
def test_native_communicator_refuses_a_bad_value(monkeypatch, bad):
    monkeypatch.setenv("BAGUA_COMM_TIMEOUT", bad)
    with pytest.raises(ValueError, match=f"BAGUA_COMM_TIMEOUT must be .*, got '{bad}'"):
        NativeCommunicator.mpi_world()


@pytest.mark.parametrize("bad", BAD)
def test_distributed_initialize_refuses_a_bad_value_before_connecting(monkeypatch, bad):
    monkeypatch.setenv("BAGUA_COMM_TIMEOUT", bad)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    # No coordinator exists at this address: the check must come before any connection.
    with pytest.raises(ValueError, match=f"BAGUA_COMM_TIMEOUT must be .*, got '{bad}'"):
        initialize("127.0.0.1:1", num_processes=2, process_id=1)
    assert "XLA_FLAGS" not in os.environ


@pytest.mark.parametrize("bad", [0, -1.0, float("inf")])
def test_explicit_timeouts_are_checked_too(bad):
    with pytest.raises(ValueError, match="timeout must be a positive, finite number"):
        initialize("127.0.0.1:1", num_processes=2, process_id=1, timeout=bad)
    with pytest.raises(ValueError, match="timeout must be a positive, finite number"):
        NativeCommunicator.mpi_world(timeout=bad)


def test_xla_flags_keep_the_users_and_add_the_timeout(monkeypatch):
    from bagua_jax.distributed import _set_xla_flags

    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_collective_timeout_seconds=7 --xla_foo=1")
    _set_xla_flags(30)
    flags = os.environ["XLA_FLAGS"].split()
    assert flags == [
        "--xla_cpu_collective_timeout_seconds=7",
        "--xla_foo=1",
        "--xla_cpu_collective_call_terminate_timeout_seconds=30",
    ]


class _MpiEngine:
    """What an MPI communicator's grow and join ask of the engine, for a communicator of 2 ranks (handle 1) and a
    newcomer alone (handle 2), whose operations wait 7 s."""

    def size(self, handle: int) -> int:
        return {1: 2, 2: 1}[handle]

    def rank(self, handle: int) -> int:
        return 0

    def timeout(self, handle: int) -> float:
        return 7.0

    def share(self, handle: int) -> int:
        return 10 + handle

    def rebind(self, slot: int, handle: int) -> bool:
        return True


@pytest.mark.parametrize("timeout", [None, 2.5])
def test_an_mpi_grow_and_join_wait_for_each_other_as_long_as_the_communicators_operations(monkeypatch, timeout):
    """Unless told otherwise, both sides of an admission wait as long as their communicators' operations, so that a
    member of a job started with a short timeout does not wait BAGUA_COMM_TIMEOUT's 300 s for a newcomer that died."""
    monkeypatch.setenv("BAGUA_COMM_TIMEOUT", "300")
    monkeypatch.setattr(native_communicator, "engine", lambda kind: _MpiEngine())
    builds = []  # (rank, size, the members' communicator, the first newcomer's rank, seconds) of each build
    monkeypatch.setattr(
        mpi_rendezvous, "assemble", lambda mpi, store, prefix, *build: builds.append(build[:4] + build[5:6])
    )
    NativeCommunicator(1, "mpi").grow(None, "grow/", 3, timeout)
    NativeCommunicator(2, "mpi").join(None, "grow/", 2, 3, timeout)
    seconds = 7.0 if timeout is None else timeout
    assert builds == [(0, 3, 11, 2, seconds), (2, 3, None, 2, seconds)]

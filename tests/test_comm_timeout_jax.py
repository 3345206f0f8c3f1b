"""BAGUA_COMM_TIMEOUT in the JAX front end: checked when a communicator or the multi-process
mesh starts, with a message naming the variable and the value; importing never fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

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

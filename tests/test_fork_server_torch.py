"""A rank forked by the test fork server is what a fresh ``python -m rank_main`` would be."""

from __future__ import annotations

import os
import random
import signal
import sys

import numpy as np
import torch
from multiprocess import run_ranks


def what_a_rank_sees() -> dict:
    return {
        "pid": os.getpid(),
        "session": os.getsid(0),
        "environment": dict(os.environ),
        "draws": (random.random(), float(np.random.random())),
        "threads": torch.get_num_threads(),
        "jax_loaded": "jax" in sys.modules,
    }


def die_by_a_signal() -> None:
    if int(os.environ["RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def test_forked_ranks_have_their_own_session_environment_seeds_and_threads():
    first, second = (r.value for r in run_ranks("test_fork_server_torch:what_a_rank_sees", 2, env={"MARK": "x"}))
    for rank, seen in enumerate((first, second)):
        assert seen["session"] == seen["pid"]  # killing its process group kills it alone
        environment = seen["environment"]
        assert environment["MARK"] == "x" and environment["RANK"] == str(rank) and environment["WORLD_SIZE"] == "2"
        assert "PYTEST_CURRENT_TEST" in os.environ and environment.keys() <= {*os.environ, "RANK", "LOCAL_RANK"} | {
            "WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "BAGUA_TEST_WORKDIR",
            "PYTHONPATH",
            "PYTHONUNBUFFERED",
            "OMP_NUM_THREADS",
            "MARK",
        }
        assert seen["threads"] == int(environment["OMP_NUM_THREADS"])
        assert not seen["jax_loaded"]
    assert first["draws"][0] != second["draws"][0] and first["draws"][1] != second["draws"][1]


def test_a_rank_ended_by_a_signal_reports_it():
    results = run_ranks("test_fork_server_torch:die_by_a_signal", 2, check=False)
    assert [r.returncode for r in results] == [0, -signal.SIGKILL]

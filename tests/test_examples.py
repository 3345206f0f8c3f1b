"""The README's training jobs: examples/train_digits_{jax,torch}.py under bagua-launch, 2 MPI ranks.

This is also where AsyncModelAverage trains across processes (its averaging rounds
run on a background thread over the native engine, which simulated devices lack).
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import bagua_jax

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not bagua_jax.build_info()["mpi"], reason="built without the MPI engine")


@pytest.mark.parametrize("algorithm", ["async", "bytegrad", "onebit_adam"])
@pytest.mark.parametrize("front_end", ["jax", "torch"])
def test_training_job_reaches_good_accuracy_on_every_rank(front_end, algorithm):
    launch = [sys.executable, "-m", "bagua_launch", "--nproc-per-node", "2", "--mpi", "--timeout", "300"]
    job = [str(ROOT / "examples" / f"train_digits_{front_end}.py"), "--algorithm", algorithm, "--steps", "300"]
    env = {**os.environ, "XLA_FLAGS": ""}  # one CPU device per process
    result = subprocess.run(launch + job, capture_output=True, text=True, timeout=360, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Warning" not in result.stdout + result.stderr, result.stdout + result.stderr
    assert re.search(r"step\s+300\s+loss", result.stdout), result.stdout
    accuracies = [float(a) for a in re.search(r"test accuracy per rank: (.*)", result.stdout).group(1).split(", ")]
    assert len(accuracies) == 2 and min(accuracies) >= 0.9, result.stdout

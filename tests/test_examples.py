"""The README's training jobs: examples/train_digits_{jax,torch}.py under bagua-launch, 2 MPI ranks, and the
fault-tolerant JAX job (examples/fault_tolerant_digits_jax.py) under ``bagua-launch --fault-tolerant``.

This is also where AsyncModelAverage trains across processes (its averaging rounds
run on a background thread over the native engine, which simulated devices lack).
"""

import os
import re
import signal
import subprocess
import sys
import threading
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


def rank_process(script: Path, rank: int) -> int:
    """The pid of the process running ``script`` as rank ``rank`` (not its launcher slot, nor its mpiexec)."""
    for entry in Path("/proc").iterdir():
        try:
            command = (entry / "cmdline").read_bytes().split(b"\0")
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # not a process, or one that ended
            continue
        if len(command) > 1 and command[1] == str(script).encode() and f"RANK={rank}".encode() in environment:
            return int(entry.name)
    raise AssertionError(f"no process runs {script} as rank {rank}")


def test_a_fault_tolerant_jax_job_trains_on_through_a_kill_and_takes_a_replacement(tmp_path):
    """Three ranks under ``bagua-launch --fault-tolerant``; rank 1 is SIGKILLed at step 100. The two others go
    on, the launcher's slot starts a replacement that joins the running job, and the three end the 3000 steps with
    the same test accuracy (the example checks the replicas' hashes at the end; the job checks them after every
    change of members)."""
    script = ROOT / "examples" / "fault_tolerant_digits_jax.py"
    launch = [sys.executable, "-m", "bagua_launch", "--fault-tolerant", "--nproc-per-node", "3"]
    job = [str(script), "--steps", "3000", "--checkpoints", str(tmp_path / "checkpoints")]
    env = {**os.environ, "XLA_FLAGS": ""}  # one CPU device per process
    process = subprocess.Popen(launch + job, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    watchdog = threading.Timer(240, process.kill)
    watchdog.start()
    output, killed = [], False
    try:
        for line in process.stdout:
            output.append(line)
            if not killed and re.match(r"\[rank 0\] step\s+100\b", line):
                os.kill(rank_process(script, 1), signal.SIGKILL)
                killed = True
        code = process.wait()
    finally:
        watchdog.cancel()
    text = "".join(output)
    assert code == 0 and killed, text
    assert "rank 1 ended (killed by SIGKILL)" in text, text
    assert "starting a replacement that joins the running job" in text, text
    sizes = [int(size) for size in re.findall(r"\[rank 0\] step\s+\d+\s+loss \S+\s+ranks (\d)", text)]
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, sizes  # the survivors alone, then with the replacement
    accuracies = re.findall(r"\[rank (\d)\] test accuracy (\S+) after 3000 steps", text)
    assert sorted(rank for rank, _ in accuracies) == ["0", "1", "2"], text
    assert len({accuracy for _, accuracy in accuracies}) == 1 and float(accuracies[0][1]) >= 0.9, accuracies

"""The flax and equinox examples: data-parallel in at most five changed lines, and they train.

Each data-parallel example differs from its single-device version (both in ``examples/``) by
at most five added and five removed lines of code (module docstrings and blank lines aside),
counted with ``difflib``; both versions train, and the data-parallel one reaches the accuracy
of the single-device one.
"""

import ast
import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import bagua_jax

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PAIRS = [("flax_cnn.py", "flax_cnn_data_parallel.py"), ("equinox_mlp.py", "equinox_mlp_data_parallel.py")]
MAX_CHANGED = 5


def code_lines(path: Path) -> list[str]:
    """The file's non-blank lines without its module docstring."""
    source = path.read_text()
    docstring = ast.parse(source).body[0]
    skip = set(range(docstring.lineno, docstring.end_lineno + 1))
    return [line for n, line in enumerate(source.splitlines(), 1) if n not in skip and line.strip()]


def changed_lines(single: Path, parallel: Path) -> tuple[int, int]:
    """(added, removed) lines of code from ``single`` to ``parallel``."""
    matcher = difflib.SequenceMatcher(a=code_lines(single), b=code_lines(parallel), autojunk=False)
    added = removed = 0
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag != "equal":
            removed += i2 - i1
            added += j2 - j1
    return added, removed


@pytest.mark.parametrize("single, parallel", PAIRS, ids=[p[0] for p in PAIRS])
def test_data_parallel_version_changes_at_most_five_lines(single, parallel):
    added, removed = changed_lines(EXAMPLES / single, EXAMPLES / parallel)
    print(f"{parallel}: +{added} -{removed} lines against {single}")
    assert added <= MAX_CHANGED and removed <= MAX_CHANGED, (added, removed)


def run(command: list[str], env: dict[str, str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, **env})
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def accuracies(output: str) -> list[float]:
    return [float(a) for a in re.findall(r"test accuracy (\d\.\d+)", output)]


def test_flax_cnn_trains_data_parallel_on_four_devices():
    steps = ["--steps", "150"]
    (single,) = accuracies(run([sys.executable, str(EXAMPLES / "flax_cnn.py"), *steps], {}))
    four = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    (parallel,) = accuracies(run([sys.executable, str(EXAMPLES / "flax_cnn_data_parallel.py"), *steps], four))
    assert parallel >= 0.9 and parallel >= single - 0.03, (single, parallel)


@pytest.mark.skipif(not bagua_jax.build_info()["mpi"], reason="built without the MPI engine")
def test_equinox_mlp_trains_data_parallel_on_two_processes():
    (single,) = accuracies(run([sys.executable, str(EXAMPLES / "equinox_mlp.py")], {}))
    launch = [sys.executable, "-m", "bagua_launch", "--nproc-per-node", "2", "--mpi", "--timeout", "240"]
    output = run([*launch, str(EXAMPLES / "equinox_mlp_data_parallel.py")], {"XLA_FLAGS": ""})
    per_rank = accuracies(output)
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1], output  # identical replicas
    assert per_rank[0] >= 0.88 and per_rank[0] >= single - 0.03, (single, per_rank)

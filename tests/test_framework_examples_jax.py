"""The flax and equinox examples: data-parallel in at most five lines, and they train.

Each data-parallel example imports its single-device version (both in ``examples/``) and adds at most
five lines of code to it (module docstrings, blank lines, the import of the single-device script and
lines the two share aside); both versions train, and the data-parallel one reaches the accuracy of the
single-device one.
"""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import bagua_jax

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PAIRS = [("flax_cnn.py", "flax_cnn_data_parallel.py"), ("equinox_mlp.py", "equinox_mlp_data_parallel.py")]
MAX_ADDED = 5


def code_lines(path: Path) -> list[str]:
    """The file's non-blank lines without its module docstring."""
    source = path.read_text()
    docstring = ast.parse(source).body[0]
    skip = set(range(docstring.lineno, docstring.end_lineno + 1))
    return [line for n, line in enumerate(source.splitlines(), 1) if n not in skip and line.strip()]


def added_lines(single: Path, parallel: Path) -> list[str]:
    """The lines of code of ``parallel`` that ``single`` lacks, after checking that ``parallel`` builds on
    ``single`` (imports it) rather than copying it (defines no function or class of its own)."""
    tree = ast.parse(parallel.read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert single.stem in imported, f"{parallel.name} does not import {single.stem}"
    defined = [node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.ClassDef))]
    assert not defined, f"{parallel.name} defines {defined} instead of taking them from {single.name}"
    shared = set(code_lines(single))
    return [line for line in code_lines(parallel) if line not in shared and f"from {single.stem} import" not in line]


@pytest.mark.parametrize("single, parallel", PAIRS, ids=[p[0] for p in PAIRS])
def test_data_parallel_version_adds_at_most_five_lines(single, parallel):
    added = added_lines(EXAMPLES / single, EXAMPLES / parallel)
    print(f"{parallel}: {len(added)} lines over {single}:", *added, sep="\n  ")
    assert len(added) <= MAX_ADDED, added


def run(command: list[str], env: dict[str, str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=360, env={**os.environ, **env})
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
    launch = [sys.executable, "-m", "bagua_launch", "--nproc-per-node", "2", "--mpi", "--timeout", "300"]
    output = run([*launch, str(EXAMPLES / "equinox_mlp_data_parallel.py")], {"XLA_FLAGS": ""})
    per_rank = accuracies(output)
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1], output  # identical replicas
    assert per_rank[0] >= 0.88 and per_rank[0] >= single - 0.03, (single, per_rank)

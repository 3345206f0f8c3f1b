"""Scripts written against Bagua's API run on bagua_torch with only their import line changed.

``examples/from_bagua/`` holds a Bagua-style training script (Bagua's MNIST example on
scikit-learn's digits) and a communication-primitives script, each importing
``bagua.torch_api``. The test changes that import line to ``bagua_torch.torch_api`` (checking that
nothing else changes: the scripts reach every other name as an attribute of ``bagua``) and runs
the copies with 2 processes under ``bagua-launch``. AsyncModelAverage's ``abort``/``resume``,
which the training script also drives, are checked in test_bagua_compat_torch.py.
"""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fresh_interpreter import ROOT, source_tree_env

SCRIPTS = ROOT / "examples" / "from_bagua"


def migrated(script: str, directory: Path) -> Path:
    """Copy ``script`` into ``directory`` with its import line changed; assert nothing else changed."""
    source = (SCRIPTS / script).read_text()
    target = re.sub(r"^import bagua\.torch_api as bagua$", "import bagua_torch.torch_api as bagua", source, flags=re.M)
    changed = [
        line
        for line in difflib.unified_diff(source.splitlines(), target.splitlines(), lineterm="", n=0)
        if line.startswith("+") and not line.startswith("+++")
    ]
    assert changed == ["+import bagua_torch.torch_api as bagua"], changed
    path = directory / script
    path.write_text(target)
    return path


def launch(script: Path, *args: str) -> str:
    command = [sys.executable, "-m", "bagua_launch", "--nproc-per-node", "2"]
    command += ["--timeout", "300", str(script), *args]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=360, env=source_tree_env(), cwd=script.parent
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Warning" not in output, output
    return output


def test_communication_primitives_script_matches_torch_distributed(tmp_path):
    output = launch(migrated("communication_primitives.py", tmp_path))
    assert "all primitives match torch.distributed" in output, output
    assert output.count("alltoall_v ok") == 2, output


@pytest.mark.parametrize(
    "arguments",
    [["--algorithm", "gradient_allreduce", "--fuse-optimizer"], ["--algorithm", "qadam"]],
    ids=["gradient_allreduce-fused", "qadam"],
)
def test_digits_script_trains_on_every_rank(tmp_path, arguments):
    # Under gloo: the ranks must also exit cleanly (see test_clean_exit_torch).
    output = launch(migrated("mnist.py", tmp_path), "--epochs", "2", *arguments)
    accuracies = [float(a) for a in re.search(r"test accuracy per rank: (.*)", output).group(1).split(", ")]
    assert len(accuracies) == 2 and min(accuracies) >= 0.85, output
    assert accuracies[0] == accuracies[1], output  # both algorithms keep the replicas identical

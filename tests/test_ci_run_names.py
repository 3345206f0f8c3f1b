"""The tests .ci/run names one by one exist, and each runs there.

.ci/run runs some tests by node id in steps of their own, with ``-m extended``. A test renamed, or a parameter id
changed, would make pytest stop there with "not found"; a test that left the extended run would be deselected and
run nowhere but the quick suite. Both would show only in CI, after the quick suite.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NODE_ID = re.compile(r"tests/[\w/]+\.py::[^\s\"'\\]+")


def test_every_test_ci_names_is_collected_in_the_extended_run():
    named = sorted(set(NODE_ID.findall((ROOT / ".ci" / "run").read_text())))
    assert named, "no node ids found in .ci/run"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "extended", "-p", "no:randomly", *named],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    missing = [name for name in named if not any(line.startswith(name) for line in collected)]
    assert not missing, f".ci/run names tests the extended run does not collect: {missing}"

"""A fresh Python interpreter on this source tree, for tests that must see what importing does from scratch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def source_tree_env() -> dict[str, str]:
    """This process's environment with the repository root first on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def run_json(
    code: str, *args: str, stdin: str | None = None, timeout: float = 300, env: dict[str, str] | None = None
) -> dict:
    """Run ``python -c code *args`` in the repository root on its source tree (with ``env`` added to this process's
    environment); assert it exits 0 and return the JSON object on the last line it prints."""
    run = subprocess.run(
        [sys.executable, "-c", code, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=source_tree_env() | (env or {}),
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.strip().splitlines()[-1])

"""The import rules: bagua_torch never loads jax, bagua_jax never loads torch, bagua_common neither.

No library package loads ``bagua_launch``, the command-line package: what both need (the rank
environment, starting ranks) lives in ``bagua_common.job``.

Each package and every submodule is imported in a fresh interpreter, which then reports the
forbidden frameworks found in ``sys.modules``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "bagua_common": ("jax", "torch", "bagua_launch"),
    "bagua_jax": ("torch", "bagua_launch"),
    "bagua_torch": ("jax", "bagua_launch"),
}

PROBE = """
import importlib, json, pkgutil, sys
package = importlib.import_module(sys.argv[1])
names = [sys.argv[1]] + [
    m.name for m in pkgutil.walk_packages(package.__path__, sys.argv[1] + ".")
]
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": names, "loaded": [m for m in sys.argv[2:] if m in sys.modules]}))
"""


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_loads_no_forbidden_framework(package):
    pytest.importorskip(package)
    forbidden = FORBIDDEN[package]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", PROBE, package, *forbidden],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(report["modules"]) > 1, report
    assert report["loaded"] == [], f"importing {package} loaded {report['loaded']}"


def test_probe_reports_what_a_package_loads():
    """The probe can fail: bagua_common does load NumPy, and the probe says so."""
    run = subprocess.run(
        [sys.executable, "-c", PROBE, "bagua_common", "numpy"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout.strip().splitlines()[-1])["loaded"] == ["numpy"]

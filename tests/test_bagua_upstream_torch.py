"""Bagua's own tests of the decentralized algorithms pass with their imports changed and nothing else.

``tests/bagua_upstream`` holds Bagua's files as Bagua ships them. Each test here copies them into a scratch folder
with ``bagua.torch_api`` changed to ``bagua_torch.torch_api`` in their import lines (checked to be the only change)
and runs one of Bagua's test methods with ``unittest``, in a process of its own, as Bagua's CI did. Bagua's tests
assume CUDA: every process they start gets a ``sitecustomize`` that gives what they ask of CUDA to the CPU
(``.cuda()`` keeps a tensor where it is, ``set_device`` does nothing, two devices, torch's NCCL backend is gloo),
and the runner reports CUDA to their ``skip_if_cuda_not_available`` while it imports them, so that they run.

Bagua's reference runs meet through torch's file store at the fixed path ``/tmp/.bagua.test.filestore``. torch
removes that file only when every rank of a run ends cleanly: a run killed or failed once leaves it behind, and
every later run on the machine reads the dead run's addresses from it (gloo's ``connectFullMesh``: "Connection
refused"), as does a run sharing it with another at the same time. So each test gives Bagua's processes a
``TMPDIR`` of their own, and the ``sitecustomize`` puts a ``file:///tmp/`` store there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from fresh_interpreter import ROOT, source_tree_env
from process_group import run_group

UPSTREAM = Path(__file__).resolve().parent / "bagua_upstream"
RUN_TIMEOUT_S = 540
"""Below the 600 s pytest gives each of these tests, so that a run that does not end is reported with its ranks'
output. A test took 30-125 s at load 2.5-8 here; Bagua's harness gives each of its processes 60 s."""

CPU_FOR_CUDA = """
import tempfile

import torch
import torch.distributed

torch.cuda.device_count = lambda: 2
torch.cuda.set_device = lambda device: None
torch.Tensor.cuda = lambda self, *args, **kwargs: self
torch.nn.Module.cuda = lambda self, *args, **kwargs: self
_init_process_group = torch.distributed.init_process_group


def _on_cpu(backend=None, init_method=None, *args, **kwargs):
    if init_method is not None and init_method.startswith("file:///tmp/"):
        init_method = "file://" + tempfile.gettempdir() + init_method[len("file:///tmp") :]
    return _init_process_group("gloo" if backend == "nccl" else backend, init_method, *args, **kwargs)


torch.distributed.init_process_group = _on_cpu
"""

RUNNER = """
import importlib, multiprocessing, sys, unittest
import torch

module_name, test = sys.argv[1], sys.argv[2]
available = torch.cuda.is_available
torch.cuda.is_available = lambda: True  # for the skip decorators, evaluated as the module is imported
try:
    module = importlib.import_module(module_name)
finally:
    torch.cuda.is_available = available
result = unittest.TextTestRunner(verbosity=2).run(unittest.defaultTestLoader.loadTestsFromName(test, module))
for rank in multiprocessing.active_children():  # a rank whose peer failed waits for it forever: end it, and say so
    print(f"{rank.name} still running after the test: killed", file=sys.stderr)
    rank.kill()
sys.exit(0 if result.wasSuccessful() and not result.skipped else 1)
"""

CASES = [
    ("test_decentralized", "TestDecentralized.test_compare"),
    ("test_low_precision_decentralized", "TestLowPrecisionDecentralized.test_compare"),
    ("test_low_precision_decentralized", "TestLowPrecisionDecentralized.test_algorithm"),
]


def with_imports_changed(into: Path) -> Path:
    """Bagua's tests under ``into``, their imports of ``bagua.torch_api`` changed to ``bagua_torch.torch_api``."""
    shutil.copytree(UPSTREAM / "tests", into / "tests")
    for path in (into / "tests" / "torch_api").glob("test_*.py"):
        lines = path.read_text().split("\n")
        changed = [
            line.replace("bagua.torch_api", "bagua_torch.torch_api") if line.startswith(("import ", "from ")) else line
            for line in lines
        ]
        assert sum(a != b for a, b in zip(lines, changed)) == 3, path  # utils, communication, the module as bagua
        path.write_text("\n".join(changed))
    return into


@pytest.mark.timeout(600)
@pytest.mark.parametrize("module, test", CASES)
def test_baguas_own_test_passes_with_only_its_imports_changed(tmp_path, module, test):
    root = with_imports_changed(tmp_path / "bagua")
    shim = tmp_path / "cpu_for_cuda"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(CPU_FOR_CUDA)
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    env = source_tree_env() | {
        "PYTHONPATH": os.pathsep.join([str(shim), str(ROOT)]),
        "OMP_NUM_THREADS": "1",
        "TMPDIR": str(private_tmp),
    }
    command = [sys.executable, "-c", RUNNER, f"tests.torch_api.{module}", test]
    try:
        run = run_group(command, RUN_TIMEOUT_S, env=env, cwd=root)
    except subprocess.TimeoutExpired as timeout:
        pytest.fail(f"still running after {RUN_TIMEOUT_S} s; its ranks' output:\n{timeout.stderr[-12000:]}")
    assert run.returncode == 0, f"its ranks' output:\n{run.stdout[-2000:]}{run.stderr[-12000:]}"
    assert " ... ok" in run.stderr, run.stderr[-3000:]

"""What the build reports, and the guard against a jaxlib it was not built for."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import jaxlib.version

import bagua_jax
import bagua_torch

NATIVE_MODULES = ("_bagua_ffi", "_bagua_mpi", "_bagua_nccl")


def test_build_info_reports_what_was_compiled():
    info = bagua_jax.build_info()
    assert info["cpu"] is True
    assert info["jaxlib"] == jaxlib.version.__version__
    assert info["xla_ffi_api"].count(".") == 1
    assert isinstance(info["cuda"], bool)
    assert bool(info["cuda_architectures"]) == info["cuda"]
    assert bagua_torch.build_info() == info


def test_import_refuses_a_different_jaxlib():
    code = (
        "import jax, jaxlib.version; jaxlib.version.__version__ = '0.0.1'\n"
        "try:\n"
        "    import bagua_jax\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "else:\n"
        "    raise SystemExit('bagua_jax imported against the wrong jaxlib')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "built against jaxlib" in result.stdout and "0.0.1" in result.stdout
    assert "--no-build-isolation" in result.stdout


def test_each_native_module_exports_only_its_init_function():
    """A symbol an extension module exports (libstdc++'s template instances and their unique statics, the CUDA
    kernels) can bind a library loaded after it, the likely cause of torch's import aborting (``free(): invalid
    pointer``) after ``_bagua_nccl`` or ``_bagua_ffi`` on the GPU machine (not reproduced on a CPU machine). Each
    module keeps all but ``PyInit_<name>`` to itself."""
    modules = [spec.origin for name in NATIVE_MODULES if (spec := importlib.util.find_spec(name)) is not None]
    assert any(Path(m).name.startswith("_bagua_ffi") for m in modules), modules
    for module in modules:
        table = subprocess.run(["nm", "-D", "--defined-only", module], capture_output=True, text=True, check=True)
        exported = [line.split()[-1] for line in table.stdout.splitlines()]
        assert exported == [f"PyInit_{Path(module).name.split('.')[0]}"], (module, exported[:10], len(exported))

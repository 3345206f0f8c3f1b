"""What the build reports, and the guard against a jaxlib it was not built for."""

import subprocess
import sys

import jaxlib.version

import bagua_jax
import bagua_torch


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

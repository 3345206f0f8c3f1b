"""The import rules: bagua_torch never loads jax, bagua_jax never loads torch, bagua_common neither.

No library package loads ``bagua_launch``, the command-line package: what both need (the rank
environment, starting ranks) lives in ``bagua_common.job``.

Each package and every submodule is imported in a fresh interpreter, which then reports the
forbidden frameworks found in ``sys.modules``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from fresh_interpreter import ROOT
from package_probe import WATCHED, package_report

FORBIDDEN = {
    "bagua_common": ("jax", "torch", "bagua_launch"),
    "bagua_jax": ("torch", "bagua_launch"),
    "bagua_torch": ("jax", "bagua_launch"),
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_loads_no_forbidden_framework(package):
    pytest.importorskip(package)
    report = package_report(package)
    assert len(report["modules"]) > 1, report
    loaded = [m for m in report["loaded"] if m in FORBIDDEN[package]]
    assert loaded == [], f"importing {package} loaded {loaded}"


def test_probe_reports_what_a_package_loads():
    """The probe can fail: bagua_common does load NumPy, and the probe says so. It reports only the modules it
    watches, so every forbidden one must be among them."""
    assert "numpy" in package_report("bagua_common")["loaded"]
    assert {module for modules in FORBIDDEN.values() for module in modules} <= set(WATCHED)


# --------------------------------------------------------------------------- private names

PACKAGES = ("bagua_common", "bagua_jax", "bagua_torch", "bagua_launch")
FRAMEWORK_INTERNALS = (
    "_bagua_ffi",  # the native extension itself, which the front ends bind
    "jax._src",  # JAX's FFI effects and distributed client, which jax does not export
    "torch._foreach_",  # torch's multi-tensor kernels (one dispatch for many tensors)
    "os._exit",  # documented: leave without running cleanup handlers
    "os._Environ",  # the type of os.environ
    # DCP's loader by keys: public dcp.load cannot fill a fresh optimizer, which has no state entries yet
    "torch.distributed.checkpoint.state_dict_loader._load_state_dict_from_keys",
    # what Lightning's own strategies call to move optimizer state onto the strategy's device
    "lightning.fabric.utilities.optimizer._optimizers_to_device",
)
"""Private names the project may use although they belong to others: framework internals."""


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_names_used_across_modules(root: Path) -> list[str]:
    """``"file: name"`` for each private name a project module takes from another module.

    A private name is one with a leading underscore in an import (``from m import _x``,
    ``import m._x``) or in an attribute of an imported module (``m._x``). A private *module* may
    be used inside the package that holds it (``bagua_jax._native`` by ``bagua_jax.ops``); a
    private name inside a module, by that module only. ``FRAMEWORK_INTERNALS`` are allowed.
    """
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            relative = path.relative_to(root).with_suffix("")
            here = ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)
            tree = ast.parse(path.read_text(), str(path))
            modules: dict[str, str] = {}
            used: list[str] = []
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    for alias in node.names:
                        modules[alias.asname or alias.name.split(".")[0]] = (
                            alias.asname and alias.name or alias.name.split(".")[0]
                        )
                        used.append(alias.name)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    used.append(node.module)
                    for alias in node.names:
                        modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                        used.append(f"{node.module}.{alias.name}")
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules:
                    used.append(f"{modules[node.value.id]}.{node.attr}")
            for name in dict.fromkeys(used):
                parts = name.split(".")
                first = next((i for i, part in enumerate(parts) if _private(part)), None)
                if first is None or name.startswith(FRAMEWORK_INTERNALS):
                    continue
                owner = ".".join(parts[:first])
                private_module = (root.joinpath(*parts[: first + 1]).with_suffix(".py")).exists() or (
                    root.joinpath(*parts[: first + 1]) / "__init__.py"
                ).exists()
                allowed = here == owner or (private_module and (here + ".").startswith(owner + "."))
                if not allowed:
                    found.append(f"{relative.as_posix()}.py: {'.'.join(parts[: first + 1])}")
    return found


def test_no_module_takes_another_modules_private_names():
    assert private_names_used_across_modules(ROOT) == []


def test_the_private_name_check_finds_each_kind(tmp_path):
    """It can fail: a private name imported, a private attribute of an imported module, a private module used
    from outside its package; and it lets a package use its own private module and the listed internals."""
    (tmp_path / "bagua_common").mkdir()
    (tmp_path / "bagua_common" / "owner.py").write_text("_hidden = 1\n")
    (tmp_path / "bagua_common" / "_inner.py").write_text("x = 1\n")
    (tmp_path / "bagua_common" / "user.py").write_text(
        "from bagua_common._inner import x\nimport torch\ntorch._foreach_zero_([])\n"
    )
    (tmp_path / "bagua_jax").mkdir()
    (tmp_path / "bagua_jax" / "a.py").write_text("from bagua_common.owner import _hidden\n")
    (tmp_path / "bagua_jax" / "b.py").write_text("from bagua_common import owner\nowner._hidden\n")
    (tmp_path / "bagua_jax" / "c.py").write_text("import bagua_common._inner\n")
    for package in ("bagua_torch", "bagua_launch"):
        (tmp_path / package).mkdir()
    assert private_names_used_across_modules(tmp_path) == [
        "bagua_jax/a.py: bagua_common.owner._hidden",
        "bagua_jax/b.py: bagua_common.owner._hidden",
        "bagua_jax/c.py: bagua_common._inner",
    ]

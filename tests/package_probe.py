"""One fresh interpreter per package, shared by the import rules and the public-API test.

:func:`package_report` imports, in a fresh interpreter, first the package's lines of ``public_api.txt`` and the
:data:`CONTROLS` (recording whether each is here, moved with a ``DeprecationWarning`` or missing: a moved module
warns on its first import only, so they come first), then every submodule of the package, and reports which of
the :data:`WATCHED` modules were loaded by then. Importing all of ``bagua_torch`` pulls in torch and Lightning
(10 s); the two tests read the same report instead of paying for it twice.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from fresh_interpreter import run_json

LISTED = Path(__file__).resolve().parent / "public_api.txt"
"""The public modules and ``__all__`` names, ``module`` or ``module:name`` per line (test_public_api.py)."""

CONTROLS = ("bagua_torch:no_such_name", "bagua_common.elastic_sampler")
"""Lines the tests show the probe telling apart: a name that is not there, and a module that moved."""

WATCHED = ("jax", "torch", "bagua_launch", "numpy")
"""The modules whose loading the report states (numpy: the import rules' control)."""

PROBE = r"""
import importlib, json, pkgutil, sys, warnings
package, request = sys.argv[1], json.loads(sys.stdin.read())
found = {}
for line in request["lines"]:
    module, _, name = line.partition(":")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = importlib.import_module(module)
            if name:
                value = getattr(value, name)
        except (ImportError, AttributeError) as error:
            found[line] = ["missing", f"{type(error).__name__}: {error}"]
            continue
    moved = [
        str(w.message) for w in caught if issubclass(w.category, DeprecationWarning) and " moved to " in str(w.message)
    ]
    found[line] = ["moved", moved[0]] if moved else ["here", ""]
root = importlib.import_module(package)
modules = [package] + [m.name for m in pkgutil.walk_packages(root.__path__, package + ".")]
for name in modules:
    importlib.import_module(name)
print(json.dumps({"found": found, "modules": modules, "loaded": [m for m in request["watched"] if m in sys.modules]}))
"""


def package_of(line: str) -> str:
    """The top-level package a ``public_api.txt`` line belongs to."""
    return line.partition(":")[0].split(".")[0]


@functools.cache
def package_report(package: str) -> dict:
    """``{"found": {line: [fate, why]}, "modules": [...], "loaded": [...]}`` for ``package`` (module docstring)."""
    lines = [line for line in (*CONTROLS, *LISTED.read_text().split()) if package_of(line) == package]
    request = json.dumps({"lines": list(dict.fromkeys(lines)), "watched": WATCHED})
    return run_json(PROBE, package, stdin=request)

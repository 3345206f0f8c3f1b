"""The API reference: one page per public module of ``tests/public_api.txt``, generated at build time.

``tests/public_api.txt`` lists the public modules of the four packages and the names of their
``__all__`` (``module`` or ``module:name``). For each module that has not moved
(:data:`bagua_common.moved.MOVED_MODULES`), this extension writes ``api/_generated/<module>.md``:
the module's docstring, then every listed name (a module without listed names: every public name it
defines), each documented once, where it is first listed; later listings of the same object link to it.
Moved modules and names get one table. A listed module or name without a docstring of its own is a
warning, which ``sphinx-build -W`` makes an error.
"""

from __future__ import annotations

import importlib
import inspect
import types
import warnings
from pathlib import Path
from typing import Any

from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging

logger = logging.getLogger(__name__)

LISTED = Path(__file__).resolve().parents[2] / "tests" / "public_api.txt"
OUT = "api/_generated"
INDEX_BODY = "index_body.txt"
"""The toctrees of the reference, which ``api/index.md`` includes."""
PACKAGES = {
    "bagua_jax": "The JAX front end",
    "bagua_torch": "The PyTorch front end",
    "bagua_torch.torch_api": "Bagua's API (bagua.torch_api), for scripts written for Bagua",
    "bagua_common": "Shared by both front ends",
    "bagua_launch": "The launcher",
}


def listed_modules() -> dict[str, list[str]]:
    """Each listed module and its listed names, in the file's order."""
    modules: dict[str, list[str]] = {}
    for line in LISTED.read_text().split():
        module, _, name = line.partition(":")
        names = modules.setdefault(module, [])
        if name and name not in names:
            names.append(name)
    return modules


def package_of(module: str) -> str:
    """The section of the reference a module belongs to (the longest package prefix)."""
    return max((p for p in PACKAGES if module == p or module.startswith(p + ".")), key=len)


def own_doc(obj: Any, module: types.ModuleType, name: str) -> str | None:
    """The object's own docstring (not a class's inherited one, nor a constant's type's)."""
    if isinstance(obj, types.ModuleType) or inspect.isclass(obj):
        return obj.__dict__.get("__doc__") or None
    if inspect.isroutine(obj):
        return inspect.getdoc(obj)
    # A constant: its docstring is the string literal after its assignment, where it is defined.
    for candidate in (module, *(m for m in _defining_modules(name, obj))):
        docs = ModuleAnalyzer.for_module(candidate.__name__).find_attr_docs()
        if ("", name) in docs:
            return "\n".join(docs[("", name)])
    return None


def _defining_modules(name: str, obj: Any) -> list[types.ModuleType]:
    """Modules of the packages that bind ``name`` to ``obj`` (where a re-exported constant was written)."""
    import sys

    return [
        m
        for key, m in list(sys.modules.items())
        if key.split(".")[0] in {"bagua_jax", "bagua_torch", "bagua_common", "bagua_launch"}
        and getattr(m, name, None) is obj
    ]


def kind_of(obj: Any) -> str:
    if isinstance(obj, types.ModuleType):
        return "module"
    if inspect.isclass(obj):
        return "class"
    if inspect.isroutine(obj) or callable(obj) and hasattr(obj, "__wrapped__"):
        return "function"
    return "data"


def public_members(module: types.ModuleType) -> list[str]:
    """The public names a module without ``__all__`` defines itself (imports left out)."""
    names = []
    for name, obj in vars(module).items():
        if name.startswith("_") or isinstance(obj, types.ModuleType):
            continue
        if getattr(obj, "__module__", None) == module.__name__ and (inspect.isclass(obj) or inspect.isroutine(obj)):
            names.append(name)
    return names


class Reference:
    """The pages of the reference, written once per build."""

    def __init__(self, srcdir: Path):
        from bagua_common.moved import MOVED_MODULES, MOVED_NAMES

        self.out = srcdir / OUT
        self.modules = listed_modules()
        self.moved_modules = {m: MOVED_MODULES[m] for m in self.modules if m in MOVED_MODULES}
        listed_names = [(m, n) for m, names in self.modules.items() for n in names]
        self.moved_names = {key: MOVED_NAMES[key] for key in listed_names if key in MOVED_NAMES}
        self.deprecated: dict[str, str] = {}  # full name -> its DeprecationWarning
        self.home: dict[int, str] = {}  # id(object) -> the full name it is documented under
        self.pages: dict[str, str] = {}

    def write(self) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # a moved module's old path
            current = [m for m in self.modules if m not in self.moved_modules]
            # Names listed explicitly get their home first; members of modules without a list after.
            for module in sorted(current, key=lambda m: (not self.modules[m], m.count("."), m)):
                self.pages[module] = self.page(module)
        self.pages["moved"] = self.moved_page()
        files = {f"{name}.md": text for name, text in self.pages.items()}
        files[INDEX_BODY] = self.index()
        self.out.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            path = self.out / name
            if not path.exists() or path.read_text() != text:  # unchanged pages are not read again
                path.write_text(text)
        for stale in set(self.out.glob("*.md")) - {self.out / name for name in files}:
            stale.unlink()

    def page(self, module_name: str) -> str:
        module = importlib.import_module(module_name)
        if not module.__doc__:
            logger.warning(f"{module_name}: a listed public module without a docstring", location=str(LISTED))
        names = self.modules[module_name] or public_members(module)
        lines = [f"# {module_name}", "", "```{eval-rst}", f".. automodule:: {module_name}", "```", ""]
        aliases = []
        for name in names:
            if (module_name, name) in self.moved_names:
                continue
            full = f"{module_name}.{name}"
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                obj = getattr(module, name)
            if any(issubclass(w.category, DeprecationWarning) for w in caught):
                self.deprecated[full] = str(caught[0].message)
                continue
            kind = kind_of(obj)
            if kind == "module":
                aliases.append(f"- `{name}`: the module {{py:mod}}`{obj.__name__}`")
                continue
            scalar = isinstance(obj, (int, float, str, bool))
            if not scalar:
                if id(obj) in self.home:
                    aliases.append(f"- `{name}`: the same object as {{py:obj}}`{self.home[id(obj)]}`")
                    continue
                self.home[id(obj)] = full
            doc = own_doc(obj, module, name)
            if not doc:
                logger.warning(f"{full}: a listed public name without a docstring", location=str(LISTED))
            lines += ["```{eval-rst}", f".. currentmodule:: {module_name}", ""]
            # A function named like a listed submodule (bagua_jax.algorithms.bytegrad) is not the link target.
            no_index = ["   :no-index:"] if full in self.modules else []
            if kind == "class":
                lines += [f".. autoclass:: {name}", "   :members:", "   :undoc-members:", "   :show-inheritance:"]
            elif kind == "function":
                lines += [f".. autofunction:: {name}", *no_index]
            else:
                # The docstring of a re-exported constant lives where it was assigned: write it out here.
                lines += [f".. py:data:: {name}"]
                lines += [f"   :value: {obj!r}"] if scalar else []
                lines += ["", *(f"   {line}" for line in (doc or "").splitlines())]
            lines += ["```", ""]
        if aliases:
            lines += ["## Also here", "", *aliases, ""]
        return "\n".join(lines)

    def moved_page(self) -> str:
        lines = [
            "# Moved modules and names",
            "",
            "These old paths keep working for one release with a `DeprecationWarning` that names the new place",
            "({py:mod}`bagua_common.moved`).",
            "",
            "| old | new |",
            "|---|---|",
        ]
        lines += [f"| `{old}` | {{py:mod}}`{new}` |" for old, new in sorted(self.moved_modules.items())]
        lines += [f"| `{m}.{n}` | {{py:obj}}`{new}.{n}` |" for (m, n), new in sorted(self.moved_names.items())]
        if self.deprecated:
            lines += ["", "## Deprecated", "", "| name | warning |", "|---|---|"]
            lines += [f"| `{name}` | {message} |" for name, message in sorted(self.deprecated.items())]
        return "\n".join(lines) + "\n"

    def index(self) -> str:
        """The toctree of every page, grouped by package."""
        groups: dict[str, list[str]] = {p: [] for p in PACKAGES}
        for module in self.pages:
            if module != "moved":
                groups[package_of(module)].append(module)
        lines = []
        for package, title in PACKAGES.items():
            lines += [f"## {title}", "", "```{toctree}", ":maxdepth: 1", ""]
            lines += [f"_generated/{m}" for m in sorted(groups[package])]
            lines += ["```", ""]
        lines += ["## Moved", "", "```{toctree}", ":maxdepth: 1", "", "_generated/moved", "```", ""]
        return "\n".join(lines)


def generate(app: Sphinx) -> None:
    Reference(Path(app.srcdir)).write()


UNCHECKED: list[str] = []
"""The cross-references of docstrings that did not resolve, in this build."""


def leave_docstring_references(app: Sphinx, domain: Any, node: Any) -> bool | None:
    """Docstrings' references that do not resolve render as code, unchecked; the guides' stay errors.

    Docstrings name private helpers, type variables and methods of re-exported classes (documented
    under the re-exported name), which have no target in the reference.
    """
    if app.env.docname.startswith(OUT + "/"):
        UNCHECKED.append(f"{app.env.docname}: {node.get('reftarget')}")
        return True
    return None


def report_unchecked(app: Sphinx, exception: Exception | None) -> None:
    if UNCHECKED:
        logger.info(f"public_api: {len(UNCHECKED)} references in docstrings have no target (left as code)")


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("builder-inited", generate)
    app.connect("warn-missing-reference", leave_docstring_references)
    app.connect("build-finished", report_unchecked)
    return {"parallel_read_safe": True}

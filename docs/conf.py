"""Sphinx configuration of the user's documentation (docs/README.md: how to build it)."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

project = "Bagua for JAX and PyTorch"
author = "the bagua-jax authors"
copyright = "the bagua-jax authors"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "public_api",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "README.md"]

myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "sphinx_book_theme"
html_title = "Bagua for JAX and PyTorch"
html_theme_options = {
    "show_toc_level": 2,
}

# Every warning is an error (sphinx-build -W); cross-references to this project's names must resolve,
# references to other libraries' names cannot be checked offline (no intersphinx inventories here).
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|numpy|np|optax|flax|torch|lightning|accelerate|orbax|grain|redis|lmdb|optuna)(\..*)?"),
    (r"py:.*", r"(typing|collections|concurrent|threading|pathlib|os|subprocess|argparse|abc|enum|types)\..*"),
]

autodoc_default_options = {"member-order": "bysource"}
autodoc_typehints = "description"
autodoc_typehints_format = "fully-qualified"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
# A docstring's short name that several front ends define (``Algorithm``, ``Communicator``) links to
# the first; the ambiguity is not an error.
suppress_warnings = ["ref.python"]

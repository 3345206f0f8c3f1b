"""Every per-algorithm lookup is derived from the configurations: no library module keeps its own collection of
registered algorithm names (issue 30). What an algorithm is (its reshard rule, whether a knob is exact for it,
whether the advisor ranks it) is declared once, on its configuration class
(:class:`~bagua_common.algorithms.registry.AlgorithmConfig`), so adding an algorithm is declaring it once.
"""

from __future__ import annotations

import ast
from pathlib import Path

from bagua_common.algorithms.registry import CONFIGS, AlgorithmConfig, algorithm_facts

ROOT = Path(__file__).resolve().parent.parent
PYTHON_PACKAGES = ("bagua_common", "bagua_jax", "bagua_torch", "bagua_launch")


def _all_values(tree: ast.AST) -> set[int]:
    # The values assigned to ``__all__``: module and attribute names, which may coincide with algorithm names.
    values = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in targets
        ):
            values.add(id(node.value))
    return values


def _spellings() -> set[str]:
    # An algorithm's registry name and its class name (a front end's class, and a checkpoint's manifest, name it so).
    return {*CONFIGS, *(config_class.__name__.removesuffix("Config") for config_class in CONFIGS.values())}


def name_collections(source: str) -> list[tuple[int, list[str]]]:
    """Each set literal holding a registered algorithm name (registry or class spelling), and each list or tuple
    literal and each dict's keys holding two or more, in ``source``, as ``(line, names)``; ``__all__`` is left
    out."""
    spellings = _spellings()
    tree = ast.parse(source)
    exports = _all_values(tree)
    found = []
    for node in ast.walk(tree):
        if id(node) in exports:
            continue
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            elements = node.elts
        elif isinstance(node, ast.Dict):
            elements = node.keys
        else:
            continue
        names = [e.value for e in elements if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        registered = [name for name in names if name in spellings]
        if len(registered) >= (1 if isinstance(node, ast.Set) else 2):
            found.append((node.lineno, registered))
    return sorted(found)


def test_no_library_module_keeps_a_collection_of_algorithm_names():
    kept = {}
    for package in PYTHON_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found = name_collections(path.read_text(encoding="utf-8"))
            if found:
                kept[path.relative_to(ROOT).as_posix()] = found
    assert not kept, (
        "per-algorithm facts kept as literal lists of names (declare them on the configuration class, an "
        f"AlgorithmConfig attribute, and derive the lookup from CONFIGS): {kept}"
    )


def test_the_scan_finds_collections_of_names_and_leaves_exports_alone():
    """It can fail: a set of one name, a dict keyed by class names and a tuple of names are found; ``__all__`` and a
    pair with one name are not."""
    source = (
        'EXACT = frozenset({"gradient_allreduce"})\n'
        'RULES = {"ByteGrad": 1, "QAdam": 2, "not_an_algorithm": 3}\n'
        '__all__ = ["bytegrad", "qadam"]\n'
        'BASELINE = ("gradient_allreduce", "something_else")\n'
        'OPTIMIZERS = ("qadam", "onebit_adam")\n'
    )
    assert name_collections(source) == [
        (1, ["gradient_allreduce"]),
        (2, ["ByteGrad", "QAdam"]),
        (5, ["qadam", "onebit_adam"]),
    ]


def test_every_registered_configuration_declares_its_facts():
    for name, config_class in CONFIGS.items():
        assert issubclass(config_class, AlgorithmConfig), name
        assert algorithm_facts(name) is config_class
    assert algorithm_facts("my_own_algorithm") is AlgorithmConfig  # the cautious defaults
    assert not AlgorithmConfig.bucket_exact and not AlgorithmConfig.replicated and AlgorithmConfig.advised

"""The composition matrix (tests/composition_matrix.py): a cell for every algorithm, feature and front end, every
cited test real, and the documentation's table the one generated from it."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest
from composition_matrix import (
    ALGORITHMS,
    BEGIN,
    END,
    FEATURES,
    FRONT_ENDS,
    MATRIX,
    PAGE,
    Refuses,
    Skipped,
    Works,
    embedded_in_docs,
    markdown,
)

ROOT = Path(__file__).resolve().parent.parent


@cache
def functions_in(path: str) -> frozenset[str]:
    tree = ast.parse((ROOT / path).read_text())
    return frozenset(
        node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
    )


def test_every_registered_algorithm_has_a_row_with_every_cell_stated():
    pytest.importorskip("torch")
    from bagua_torch.algorithms import available_algorithms

    assert set(ALGORITHMS) == set(available_algorithms())
    assert list(MATRIX) == list(ALGORITHMS)
    for algorithm, row in MATRIX.items():
        assert list(row) == list(FEATURES), algorithm
        for feature, cells in row.items():
            assert tuple(cells) == FRONT_ENDS, (algorithm, feature)
            for front_end, cell in cells.items():
                assert isinstance(cell, (Works, Refuses, Skipped)), (algorithm, feature, front_end)
                if not isinstance(cell, Works):
                    assert cell.reason.strip(), (algorithm, feature, front_end)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_cited_test_exists(algorithm):
    for feature, cells in MATRIX[algorithm].items():
        for front_end, cell in cells.items():
            if isinstance(cell, (Works, Refuses)):
                path, function = cell.test.split("::")
                assert function in functions_in(path), f"{algorithm}, {feature}, {front_end}: no {cell.test}"


def test_the_docs_embed_the_generated_table():
    page = PAGE.read_text()
    assert page.count(BEGIN) == 1 and page.count(END) == 1
    assert embedded_in_docs() == markdown(), "regenerate it: python -m tests.composition_matrix --update-docs"

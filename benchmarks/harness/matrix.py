"""The fault matrices' shared frame (``fault_matrix.py``, ``fault_matrix_jax.py``): which faults lose a rank for good,
running the cases one at a time on a quiet machine under one job secret, and publishing their table."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path

from bagua_common.fault_tolerance.settings import temporary_job_secret
from harness.load import LoadGate
from harness.results import header_lines, load_lines, table, write_results

LOST_FOR_GOOD = ("kill", "stop", "raise")
"""The fault kinds that end a rank for good (a partition and a slow rank come back by themselves)."""


def lost_for_good(kind: str, where: str) -> int:
    """How many ranks a case loses for good, each replaced by a joiner: its victim, and at a ``recovery`` the rank
    killed first."""
    return int(kind in LOST_FOR_GOOD) + int(where == "recovery")


def run_matrix(
    cases: list[tuple[str, str]], run: Callable[[str, str], dict], row_of: Callable[[dict], list]
) -> tuple[list[dict], list[dict]]:
    """Run each ``(kind, where)`` case once the machine is quiet (again, up to 3 times, where other work met it),
    printing its row; return the cases, each with its load and seconds, and the loads. The members of every case
    prove one job secret, set for the matrix where ``BAGUA_FT_SECRET_FILE`` names none."""
    done, loads = [], []
    with temporary_job_secret(), contextlib.closing(LoadGate()) as gate:
        for kind, where in cases:
            started = time.monotonic()
            case, load, _ = gate.measure(lambda: run(kind, where), f"{kind}/{where}")
            done.append(case | {"load": load.as_dict(), "seconds": round(time.monotonic() - started, 1)})
            loads.append(load.as_dict())
            print(" | ".join(str(c) for c in row_of(case)), flush=True)
    return done, loads


def publish(
    out: Path,
    stem: str,
    title: str,
    meta: dict,
    loads: list[dict],
    notes: list[str],
    head: list[str],
    cases: list[dict],
    row_of: Callable[[dict], list],
) -> int:
    """Write the matrix's results (``stem``.md and .json under ``out``) and print them; the exit status: 0 when every
    case ended with its replicas bit-identical."""
    markdown = [
        f"# {title}",
        "",
        *header_lines(meta),
        *load_lines(loads),
        *notes,
        "",
        *table(head, map(row_of, cases), "llrrrl"),
    ]
    md, _ = write_results(out, stem, markdown, {**meta, "cases": cases})
    print(md.read_text())
    return 0 if all(c["ended"] and c["identical"] for c in cases) else 1

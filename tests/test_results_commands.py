"""Results files record commands that run from any checkout: no ``command`` field names the checkout it ran in.

The writer (``harness.results.command_line``, for the commands a study runs for its workers) is checked on a
command made of this checkout's absolute paths; every committed file under ``benchmarks/results/`` is checked for
``command`` fields holding an absolute path to a file of a checkout (``/any/where/benchmarks/synthetic.py``).
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from harness import results  # noqa: E402

# A path component the repository has at its top level (benchmarks/, bagua_jax/, ...), after some absolute prefix.
TOP_LEVEL = "|".join(re.escape(p.name) for p in ROOT.iterdir() if not p.name.startswith("."))
CHECKOUT_PATH = re.compile(r"(?:^|[\s=`'\"])/\S*?/(?:" + TOP_LEVEL + r")/")


def commands(value: object) -> Iterator[str]:
    """Every string under a ``command`` key of a JSON value, at any depth."""
    if isinstance(value, dict):
        for key, item in value.items():
            if key == "command" and isinstance(item, str):
                yield item
            else:
                yield from commands(item)
    elif isinstance(value, list):
        for item in value:
            yield from commands(item)


def test_a_workers_command_is_recorded_relative_to_the_repository():
    mpiexec = "/opt/somewhere/bin/mpiexec"
    argv = [mpiexec, "-n", "2", sys.executable, str(ROOT / "benchmarks" / "collectives.py"), "--sizes", "4096"]
    assert results.command_line(argv) == "mpiexec -n 2 python benchmarks/collectives.py --sizes 4096"
    argv = [sys.executable, "-m", "bagua_launch", str(ROOT / "benchmarks" / "synthetic.py"), "--out", str(ROOT)]
    recorded = results.command_line(argv)
    assert recorded == "python -m bagua_launch benchmarks/synthetic.py --out ." and not CHECKOUT_PATH.search(recorded)
    assert CHECKOUT_PATH.search(shlex.join(argv))  # the check below finds what the writer leaves out


def test_no_committed_result_names_a_checkout_in_its_command():
    found = {}
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        named = [c for c in commands(json.loads(path.read_text())) if CHECKOUT_PATH.search(c)]
        markdown = path.with_suffix(".md")
        if markdown.exists():
            named += [line for line in markdown.read_text().splitlines() if line.startswith("- command:")]
        found.update({path.name: named} if any(CHECKOUT_PATH.search(c) for c in named) else {})
    assert not found, found

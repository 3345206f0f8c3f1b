"""One result format for every study: a JSON file and a Markdown file of the same stem in ``benchmarks/results/``.

The JSON holds ``meta`` (:func:`run_meta`: the command, relative to the repository, that reproduces the run, the
date, the machine, the versions, the load average before and after) and whatever the study adds (its settings,
its rows: each measured phase with its :class:`~harness.load.PhaseLoad`). The Markdown starts with the same facts
in words (:func:`header_lines`), then the study's tables (:func:`table`), with the loads the phases met
(:func:`load_lines`).
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import statistics
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .machine import device_info, load_average, versions

ROOT = Path(__file__).resolve().parents[2]
"""The repository's root."""

RESULTS = ROOT / "benchmarks" / "results"
"""Where the studies write their results by default."""


def _relative(arg: str) -> str:
    """``arg`` relative to the repository when it names a path inside it, else unchanged."""
    if not os.path.isabs(arg):
        return arg
    path = Path(arg).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else arg


def command(argv: Sequence[str] | None = None, script: str | None = None) -> str:
    """The command that reproduces this run from the repository's root: ``python <script> <argv>``, the script
    (default ``sys.argv[0]``) and every absolute path inside the repository made relative to it, so that a results
    file never names the checkout it was measured in."""
    argv = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", _relative(os.path.abspath(script or sys.argv[0])), *map(_relative, argv)])


def command_line(argv: Sequence[str]) -> str:
    """A command a study ran (a worker's ``argv``) as a results file records it, by :func:`command`'s rules: this
    interpreter as ``python``, another program by its name, every absolute path inside the repository relative."""
    shown = ["python" if arg == sys.executable else _relative(arg) for arg in argv]
    if shown and os.path.isabs(shown[0]):
        shown[0] = os.path.basename(shown[0])
    return shlex.join(shown)


def run_meta(
    packages: Sequence[str],
    *,
    argv: Sequence[str] | None = None,
    device: dict[str, Any] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """What every results file starts with: :func:`command` of ``argv``, the date, ``device`` (default
    :func:`~harness.machine.device_info` of the CPU), the versions of ``packages`` and the load average before
    the run; then ``fields``. Call :func:`finish_meta` when the run is over."""
    return {
        "command": command(argv),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": device or device_info(),
        "versions": versions(packages),
        "load_average_before": load_average(),
        **fields,
    }


def finish_meta(meta: dict[str, Any]) -> None:
    """Add the load average after the run to ``meta``."""
    meta["load_average_after"] = load_average()


def header_lines(meta: dict[str, Any]) -> list[str]:
    """The Markdown list every results file starts with: command, date, machine, versions (the native build left to
    the JSON) and the load averages (results written before these fields existed say what they lack)."""
    device = meta.get("device") or {"kind": "cpu", "name": f"{meta.get('machine')}, {meta.get('cores')} cores"}
    return [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- device: {device['kind']}, {device['name']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if k != "bagua_build"),
        f"- load average (1, 5, 15 min) before: {meta.get('load_average_before', 'not recorded')}, "
        f"after: {meta.get('load_average_after', 'not recorded')}",
    ]


def load_lines(loads: Iterable[dict[str, Any]]) -> list[str]:
    """The Markdown list of the loads the timed phases met (each a :meth:`~harness.load.PhaseLoad.as_dict`): how
    many were published and set aside, and the range of each figure over the published ones."""
    loads = list(loads)
    if not loads:
        return ["- load per phase: not recorded"]
    published = [x for x in loads if x["published"]]
    lines = [
        f"- timed phases: {len(published)} published, {len(loads) - len(published)} set aside for load "
        f"(limit {loads[0]['limit']:g}: foreign runnable threads, 1-minute average before and mean during the phase)"
    ]
    if published:

        def span(key: str) -> str:
            values = [x[key] for x in published if x[key] is not None]
            return f"{min(values):.2f}-{max(values):.2f} (median {statistics.median(values):.2f})" if values else "-"

        lines.append(
            f"- published phases: 1-minute load before {span('load_before')}, after {span('load_after')}; "
            f"foreign threads before {span('foreign_before')}, during {span('foreign_mean')}"
        )
    return lines


def table(head: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> list[str]:
    """A Markdown table: the ``head`` cells, then each row's cells (``|`` in a cell escaped); ``align`` one letter
    per column, ``l`` or ``r`` (default: the first column left, the others right)."""
    align = align or "l" + "r" * (len(head) - 1)
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"

    def line(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [line(head), rule, *(line(r) for r in rows)]


def write_results(out_dir: Path, stem: str, markdown: Sequence[str], payload: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``<stem>.md`` (the lines of ``markdown``) and ``<stem>.json`` (``payload``) to ``out_dir``, creating
    it; return both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    md_path.write_text("\n".join(markdown).rstrip("\n") + "\n")
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    return md_path, json_path

"""What a study prints while it runs: its lines, kept for the results file (:class:`Transcript`), and its progress
on stderr (:class:`Progress`)."""

from __future__ import annotations

import sys
import time
from typing import Any

from .results import header_lines


class Transcript:
    """What a script prints as it runs (each line on stdout at once), kept for its results file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, line: str) -> None:
        """Print ``line`` and keep it."""
        print(line, flush=True)
        self.lines.append(line)

    def markdown(self, title: str, meta: dict[str, Any]) -> list[str]:
        """The results file's Markdown: ``# title``, :func:`~harness.results.header_lines` of ``meta``, then the
        lines printed, verbatim in a code block."""
        return [f"# {title}", "", *header_lines(meta), "", "```", *self.lines, "```", ""]


class Progress:
    """Progress through ``total`` units of work on stderr: a bar redrawn in place on a terminal,
    elsewhere a line for each update made with ``force`` (or :meth:`line`)."""

    def __init__(self, total: float, width: int = 30) -> None:
        self.total, self.width, self.start = total, width, time.perf_counter()
        self.done = 0
        self.tty = sys.stderr.isatty()
        self._last = ""

    def elapsed(self) -> str:
        """Time since the start, as minutes:seconds."""
        seconds = time.perf_counter() - self.start
        return f"{int(seconds // 60)}:{int(seconds % 60):02d}"

    def show(self, done: float, label: str, *, force: bool = False) -> None:
        """Show ``done`` of the total units, with ``label``."""
        frac = min(1.0, done / self.total) if self.total else 1.0
        filled = int(round(frac * self.width))
        line = f"[{'#' * filled}{'-' * (self.width - filled)}] {done:4.1f}/{self.total:g} {self.elapsed()}  {label}"
        if self.tty:
            sys.stderr.write("\r" + line[:150].ljust(len(self._last)))
            sys.stderr.flush()
            self._last = line[:150]
        elif force:
            print(line, file=sys.stderr, flush=True)

    def line(self, text: str) -> None:
        """Count one more unit done and give it a line of its own: ``[done/total] elapsed text``."""
        self.done += 1
        self.clear()
        print(f"[{self.done:3d}/{self.total:g}] {self.elapsed():>6}  {text}", file=sys.stderr, flush=True)

    def clear(self) -> None:
        """Erase the bar on a terminal."""
        if self.tty and self._last:
            sys.stderr.write("\r" + " " * len(self._last) + "\r")
            sys.stderr.flush()
            self._last = ""

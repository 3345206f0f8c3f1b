"""What every benchmark script shares: the machine and versions it ran on, the load around the run,
result files and charts, progress display, free ports and mpiexec.

The scripts run as ``python benchmarks/<script>.py``, so this folder is on ``sys.path`` and they
import this module as ``_common``. It imports neither JAX nor torch (package versions are read
from their metadata), so a parent process that only launches workers stays light.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bagua_common.job.local_launch import free_port as free_port  # for the scripts
from bagua_common.job.local_launch import mpiexec

RESULTS = Path(__file__).resolve().parent / "results"
"""Where the scripts write their results by default."""


def add_subset_option(parser: argparse.ArgumentParser, flag: str, choices: Sequence[str], help: str) -> None:
    """``flag NAME [NAME ...]``: some of ``choices`` (all by default), in the order given."""
    parser.add_argument(flag, nargs="+", choices=list(choices), default=list(choices), help=help)


def add_out_option(parser: argparse.ArgumentParser) -> None:
    """``--out DIR``: where the results are written (default :data:`RESULTS`)."""
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory (default benchmarks/results)")


def add_timeout_options(parser: argparse.ArgumentParser, comm: float, job: float) -> None:
    """``--comm-timeout`` and ``--job-timeout`` (defaults ``comm`` and ``job`` seconds): how long a collective waits
    for its peers, and how long a whole job may run before it is killed."""
    parser.add_argument("--comm-timeout", type=float, default=comm, help="seconds a collective waits for its peers")
    parser.add_argument("--job-timeout", type=float, default=job, help="seconds a job may run before it is killed")


def rotated(items: Sequence[Any], repeat: int) -> list[Any]:
    """``items`` rotated left by ``repeat``: interleaved repeats start from a different item each, so that no item
    always runs first (or right after the same neighbour)."""
    shift = repeat % len(items)
    return [*items[shift:], *items[:shift]]


def cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def device_info(kind: str, gpu: str | None = None) -> dict[str, Any]:
    """The machine a run measured: ``kind`` ("cpu" or "gpu"), the CPU model, its cores, the GPU's
    name when there is one, and ``name``, all of it in words."""
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    count = cores()
    info: dict[str, Any] = {"kind": kind, "cpu_model": model, "cores": count, "name": f"{model}, {count} cores"}
    if gpu is not None:
        info["gpu"] = gpu
        info["name"] = f"{gpu} (host: {model}, {count} cores)"
    return info


def versions(packages: Sequence[str]) -> dict[str, Any]:
    """Python's version, each of ``packages``' (from its metadata, without importing it; "not
    installed" when absent), mpiexec's when one is found, and the native library's build."""
    out: dict[str, Any] = {"python": sys.version.split()[0]}
    for package in packages:
        try:
            out[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            out[package] = "not installed"
    with contextlib.suppress(RuntimeError, OSError, subprocess.SubprocessError):
        text = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
        found = re.search(r"Version:\s*(\S+)", text)
        out["mpich (hydra)"] = found.group(1) if found else " ".join(text.split())[:80]
    with contextlib.suppress(ImportError):
        import _bagua_ffi  # the native library alone; starts neither JAX nor torch

        out["bagua_build"] = _bagua_ffi.build_info()
    return out


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages ([0.0] where unknown)."""
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):
        return [0.0]


def _sent(column: int) -> int:
    total = 0
    with open("/proc/net/dev") as f:
        for line in f.readlines()[2:]:
            interface, counters = line.split(":", 1)
            if interface.strip() != "lo":
                total += int(counters.split()[column])
    return total


def bytes_sent() -> int:
    """Bytes this network namespace sent so far on its interfaces other than loopback (from ``/proc/net/dev``): under
    ``network_harness`` each rank has its own namespace, so this is the rank's traffic."""
    return _sent(8)


def packets_sent() -> int:
    """Packets this network namespace sent so far on its interfaces other than loopback, as :func:`bytes_sent`."""
    return _sent(9)


def run_meta(argv: Sequence[str], device: dict[str, Any], packages: Sequence[str], **fields: Any) -> dict[str, Any]:
    """What every result file starts with: the command line (this script with the arguments
    ``argv``), the date, ``device``, the versions of ``packages`` and the load average before the
    run; then ``fields``. Call :func:`finish_meta` when the run is over."""
    return {
        "command": shlex.join([Path(sys.executable).name, sys.argv[0], *argv]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": device,
        "versions": versions(packages),
        "load_average_before": load_average(),
        **fields,
    }


def finish_meta(meta: dict[str, Any]) -> None:
    """Add the load average after the run to ``meta``."""
    meta["load_average_after"] = load_average()


def header_lines(meta: dict[str, Any]) -> list[str]:
    """The Markdown lines every result file starts its list with: command, date, device, versions
    (the native build left to the JSON file) and the load averages."""
    return [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- device: {meta['device']['kind']}, {meta['device']['name']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if k != "bagua_build"),
        (f"- load average (1, 5, 15 min) before: {meta['load_average_before']}, after: {meta['load_average_after']}"),
    ]


def write_results(out_dir: Path, stem: str, markdown: Sequence[str], payload: dict[str, Any]) -> tuple[Path, Path]:
    """Write ``<stem>.md`` (the lines of ``markdown``) and ``<stem>.json`` (``payload``) to
    ``out_dir``, creating it; return both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md_path, json_path = out_dir / f"{stem}.md", out_dir / f"{stem}.json"
    md_path.write_text("\n".join(markdown))
    json_path.write_text(json.dumps(payload, indent=2) + "\n")
    return md_path, json_path


def pyplot() -> Any | None:
    """matplotlib's ``pyplot`` drawing to files only (the Agg backend), or None with a note on stderr
    where matplotlib is not installed: charts are optional, the results files are written anyway."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("note: matplotlib is missing (pip install matplotlib); no chart written", file=sys.stderr)
        return None
    return plt


def save_figure(fig: Any, path: Path, dpi: int) -> Path:
    """Lay out ``fig``, write it to ``path`` at ``dpi`` and free it; return ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def retain_freed_memory() -> bool:
    """Ask glibc to keep freed memory mapped for reuse; False where that is not possible.

    By default glibc serves large blocks with ``mmap`` and unmaps them on ``free``, so every
    call's output lands on fresh pages that the kernel must fault in and zero (tens of ms for
    256 MiB), a cost that swamps what is being compared. With one arena (threads' own arenas
    fall back to ``mmap`` for large blocks whatever the settings), ``mmap`` off and trimming off,
    freed blocks stay in the heap and the next call of the same size reuses them, as a GPU
    caching allocator would. Call it before JAX or torch start their threads.
    """
    m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    settings = ((m_arena_max, 1), (m_mmap_max, 0), (m_trim_threshold, -1))  # -1: never trim
    return all(libc.mallopt(param, value) == 1 for param, value in settings)


class Transcript:
    """What a script prints as it runs (each line on stdout at once), kept for its results file."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def say(self, line: str) -> None:
        """Print ``line`` and keep it."""
        print(line, flush=True)
        self.lines.append(line)

    def markdown(self, title: str, meta: dict[str, Any]) -> list[str]:
        """The results file's Markdown: ``# title``, :func:`header_lines` of ``meta``, then the
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

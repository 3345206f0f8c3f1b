"""A study's jobs: one process per rank on an emulated network, each writing its result to a file.

:func:`run_ranks` starts a worker command once per rank inside the ranks' namespaces (:class:`~harness.links.Network`:
``torch.distributed``-style environment, or one MPI job whose ``mpiexec`` reaches every namespace), waits for it
with a timeout, and reads back what each rank wrote with :func:`write_rank_result`; :class:`JobOutcome` says whether
every rank delivered, and keeps the tail of the job's log when one did not. :func:`child_env` is the environment the
ranks run in (one CPU device and one thread per rank, this checkout's packages first); :func:`export_tree` extracts
an earlier revision of the repository, for the studies that time this tree against a baseline.
"""

from __future__ import annotations

import dataclasses
import json
import os
import site
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bagua_common.job.local_launch import free_port

from .links import Network
from .results import ROOT


def child_env(tree: Path = ROOT, **extra: str) -> dict[str, str]:
    """The environment of a study's ranks: JAX on the CPU with one device, one OpenMP/MKL thread, no CUDA, unbuffered
    output, ``tree``'s packages (default this checkout's) first on ``PYTHONPATH``; then ``extra``."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env.update(
        JAX_PLATFORMS="cpu",
        CUDA_VISIBLE_DEVICES="",
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        XLA_PYTHON_CLIENT_PREALLOCATE="false",
        PYTHONUNBUFFERED="1",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def write_rank_result(result: str | Path, rank: int, data: dict[str, Any]) -> None:
    """A worker's last act: write this rank's ``data`` (JSON) where :func:`run_ranks` reads it."""
    Path(f"{result}.rank{rank}").write_text(json.dumps(data) + "\n")


@dataclasses.dataclass
class JobOutcome:
    """What a job left: each rank's result (``ranks``, None unless every rank wrote its own), the exit codes (None:
    killed at the timeout, or after another rank failed), the last lines of its log, its wall time."""

    ranks: list[dict[str, Any]] | None
    exit_codes: list[int | None]
    log_tail: list[str]
    wall_s: float

    @property
    def status(self) -> str:
        """``ok`` when every rank wrote its result (even if a rank then failed on the way out: seen with gloo's
        "terminate called without an active exception" at exit), else ``timeout`` or ``failed``."""
        if self.ranks is not None:
            return "ok"
        return "timeout" if None in self.exit_codes else "failed"

    def row(self) -> dict[str, Any]:
        """The outcome's fields for a results row: status, wall time, exit codes, and the log's tail when a rank
        failed."""
        out: dict[str, Any] = {"status": self.status, "wall_s": round(self.wall_s, 1), "exit_codes": self.exit_codes}
        if self.status != "ok" or any(c != 0 for c in self.exit_codes):
            out["log_tail"] = self.log_tail
        return out


def run_ranks(
    net: Network,
    argv: Sequence[str],
    result: Path,
    *,
    mpi: bool = False,
    timeout: float = 600.0,
    env: dict[str, str] | None = None,
    tail_lines: int = 8,
) -> JobOutcome:
    """Run ``argv`` (a Python command: ``argv[0]`` the interpreter) as one job of ``net.ranks`` ranks and read what
    each rank wrote to ``<result>.rank<r>``; its log goes to ``<result>.log``. With ``mpi`` the job is one
    ``bagua-launch --mpi`` run (:meth:`~harness.links.Network.run_mpi`), else a process per rank with
    ``torch.distributed``'s environment (:meth:`~harness.links.Network.run_all`). ``env``: default
    :func:`child_env`."""
    paths = [Path(f"{result}.rank{r}") for r in range(net.ranks)]
    for path in paths:
        path.unlink(missing_ok=True)
    log = Path(f"{result}.log")
    start = time.perf_counter()
    with open(log, "w") as out:
        if mpi:
            codes = net.run_mpi(argv, timeout, base_env=env or child_env(), stdout=out)
        else:
            codes = net.run_all(argv, free_port(), timeout, base_env=env or child_env(), stdout=out)
    wall = time.perf_counter() - start
    tail = log.read_text(errors="replace").strip().splitlines()[-tail_lines:]
    ranks = [json.loads(p.read_text()) for p in paths] if all(p.exists() for p in paths) else None
    return JobOutcome(ranks, codes, tail, wall)


def export_tree(revision: str, into: Path) -> Path:
    """``revision`` of this repository extracted into a new folder under ``into`` (``git archive``; no worktree is
    registered). Its Python packages import from their sources when the tree is first on ``PYTHONPATH``
    (:func:`child_env`); the native library is the installed one.

    An editable install (``pip install -e``) imports the packages through a finder that takes precedence over
    ``PYTHONPATH``, started by a ``.pth`` file's ``import _editable_...``: the tree gets an empty module of each such
    name, which that import then finds first, so the finder is never installed in the tree's processes."""
    tree = into / revision.replace("/", "-")
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    for site_packages in site.getsitepackages():
        for finder in Path(site_packages).glob("_editable_*.py"):
            (tree / finder.name).write_text('"""Stands in for the editable install\'s finder: see export_tree."""\n')
    return tree

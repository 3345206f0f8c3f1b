"""The command-line options the benchmarks share: where results go, a subset of a list, the timeouts."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from .results import RESULTS


def add_out_option(parser: argparse.ArgumentParser) -> None:
    """``--out DIR``: where the results are written (default :data:`~harness.results.RESULTS`)."""
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory (default benchmarks/results)")


def add_subset_option(parser: argparse.ArgumentParser, flag: str, choices: Sequence[str], help: str) -> None:
    """``flag NAME [NAME ...]``: some of ``choices`` (all by default), in the order given."""
    parser.add_argument(flag, nargs="+", choices=list(choices), default=list(choices), help=help)


def add_timeout_options(parser: argparse.ArgumentParser, comm: float, job: float) -> None:
    """``--comm-timeout`` and ``--job-timeout`` (defaults ``comm`` and ``job`` seconds): how long a collective waits
    for its peers, and how long a whole job may run before it is killed."""
    parser.add_argument("--comm-timeout", type=float, default=comm, help="seconds a collective waits for its peers")
    parser.add_argument("--job-timeout", type=float, default=job, help="seconds a job may run before it is killed")

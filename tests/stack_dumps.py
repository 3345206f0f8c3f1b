"""Where a stuck rank waits: each test rank prints every thread's stack on SIGUSR2 (:func:`dump_on_request`), and a
harness whose job outlived its timeout asks each live rank for them (:func:`request_dump`) before it kills it, so
that the failure shows where every rank was."""

from __future__ import annotations

import faulthandler
import os
import signal
import time

DUMP_SIGNAL = signal.SIGUSR2
SETTLE_SECONDS = 0.5
"""How long a dump takes to reach a rank's output, through its pipe and the harness's reader."""


def dump_on_request() -> None:
    """In a rank: print every thread's stack to stderr whenever the process receives SIGUSR2."""
    faulthandler.register(DUMP_SIGNAL, all_threads=True)


def request_dump(pid: int) -> None:
    """Ask process ``pid`` for its stacks and wait :data:`SETTLE_SECONDS` for them to reach its output (a process
    that is gone is skipped; one that never called :func:`dump_on_request` ends, as it would have by the kill that
    follows)."""
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:
        return
    time.sleep(SETTLE_SECONDS)

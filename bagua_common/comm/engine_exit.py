"""Finalizing a native engine at interpreter exit, unless an exception is ending the process."""

from __future__ import annotations

import atexit
import sys
from types import ModuleType


def exiting_on_uncaught_exception() -> bool:
    """Whether the interpreter is exiting because an exception escaped the main program.

    Python records such an exception in ``sys.last_value`` before it runs the exit hooks.
    """
    return getattr(sys, "last_value", None) is not None


def finalize_at_exit(module: ModuleType) -> None:
    """Call ``module.finalize()`` at exit, unless an uncaught exception is ending the process.

    A rank that raised may leave its peers inside a collective; finalizing the engine (e.g.
    ``MPI_Finalize``) would then wait for them until their timeout, so the failed rank would
    outlive its error and a launcher would blame a healthy rank. Skipping the finalize lets
    the process exit at once with its non-zero status; the peers' collectives then fail
    within their timeout (or the launcher stops them first).
    """

    def finalize() -> None:
        if not exiting_on_uncaught_exception():
            module.finalize()

    atexit.register(finalize)

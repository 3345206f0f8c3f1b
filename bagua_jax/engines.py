"""Loads a native collective engine on first use and registers its FFI targets.

The engines are separate extension modules (``_bagua_mpi``, ``_bagua_nccl``) so
that the kernels never need libmpi or libnccl to import.
"""

from __future__ import annotations

import functools
from types import ModuleType

import jax

from bagua_common.comm.engines import load_engine


@functools.cache
def engine(kind: str) -> ModuleType:
    """Return the engine module ``"mpi"`` or ``"nccl"``, with its FFI collectives registered."""
    module = load_engine(kind)
    for platform, targets in module.registrations().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return module

"""Loads a native collective engine on first use and registers its FFI targets.

The engines are separate extension modules (``_bagua_mpi``, ``_bagua_nccl``) so
that the kernels never need libmpi or libnccl to import.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import jax

from bagua_common.engine_exit import finalize_at_exit
from bagua_jax.build import build_info

_MODULES = {"mpi": "_bagua_mpi", "nccl": "_bagua_nccl"}


@functools.cache
def engine(kind: str) -> ModuleType:
    """Return the engine module ``"mpi"`` or ``"nccl"``, with its FFI collectives registered."""
    if kind not in _MODULES:
        raise ValueError(f"unknown engine {kind!r}; use 'mpi' or 'nccl'")
    if not build_info()[kind]:
        raise RuntimeError(
            f"bagua was built without the {kind.upper()} engine (see bagua_jax.build_info()); "
            + ("install mpich and rebuild" if kind == "mpi" else "install nvidia-nccl-cu13 and rebuild with CUDA")
        )
    module = importlib.import_module(_MODULES[kind])
    for platform, targets in module.registrations().items():
        for name, capsule in targets.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
    finalize_at_exit(module)
    return module

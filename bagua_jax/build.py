"""What the installed native library was built with."""

from __future__ import annotations

from typing import Any

from bagua_common.comm.bagua_net import bagua_net_plugin_path
from bagua_jax._native import library


def build_info() -> dict[str, Any]:
    """Report what the native library contains.

    Returns a dict with ``cpu`` (always True), ``cuda`` and ``cuda_architectures``
    (the CUDA kernels and the GPU architectures they were compiled for), ``nccl`` and
    ``mpi`` (the communication engines), ``jaxlib`` (the jaxlib whose FFI headers it
    was built against), ``xla_ffi_api`` (the XLA FFI API version of those headers) and
    ``bagua_net_plugin`` (the absolute path of the NCCL network plugin, or None).
    """
    return dict(library.build_info(), bagua_net_plugin=bagua_net_plugin_path())

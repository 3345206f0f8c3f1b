"""Where the installed Bagua-Net plugin (NCCL's striped-TCP network plugin) lives."""

from __future__ import annotations

import importlib.util
import os

PLUGIN_FILE = "libnccl-net-bagua.so"


def bagua_net_plugin_path() -> str | None:
    """Return the absolute path of the installed ``libnccl-net-bagua.so``, or None.

    The plugin is installed beside the native module ``_bagua_ffi`` (in ``bagua_net/``
    of the same site directory), so it is found also when the Python packages are
    imported from a source tree. NCCL loads it from this path through
    ``NCCL_NET_PLUGIN``.
    """
    spec = importlib.util.find_spec("_bagua_ffi")
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(spec.origin)), "bagua_net", PLUGIN_FILE)
    return path if os.path.isfile(path) else None


def bagua_net_environment() -> dict[str, str]:
    """Return the variables that make NCCL load Bagua-Net and use it for every connection.

    ``NCCL_NET_PLUGIN`` is the plugin's absolute path (NCCL tries it verbatim before any
    ``libnccl-net-<name>.so`` search) and ``NCCL_NET=Bagua`` forces the network by name,
    so a job fails loudly instead of silently falling back to NCCL's own socket
    transport. Raises FileNotFoundError when this install has no plugin.
    """
    path = bagua_net_plugin_path()
    if path is None:
        raise FileNotFoundError(f"{PLUGIN_FILE} is not installed beside _bagua_ffi (reinstall with pip install .)")
    return {"NCCL_NET_PLUGIN": path, "NCCL_NET": "Bagua"}

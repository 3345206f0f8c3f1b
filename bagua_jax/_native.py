"""Loads the native library and registers its FFI targets with JAX, once."""

from __future__ import annotations

import _bagua_ffi
import jax
import jaxlib.version

_built_with = _bagua_ffi.build_info()["jaxlib"]
if _built_with != jaxlib.version.__version__:
    raise ImportError(
        f"bagua's native library was built against jaxlib {_built_with} but jaxlib "
        f"{jaxlib.version.__version__} is installed; the XLA FFI is only guaranteed to match "
        "for the jaxlib it was built with. Rebuild it against this jax with "
        "`pip install --no-build-isolation --force-reinstall --no-deps .` from the bagua source tree."
    )

for _platform, _targets in _bagua_ffi.registrations().items():
    for _name, _capsule in _targets.items():
        jax.ffi.register_ffi_target(_name, _capsule, platform=_platform)

library = _bagua_ffi

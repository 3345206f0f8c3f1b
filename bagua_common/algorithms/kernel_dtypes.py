"""The floating-point dtypes the native kernels take (codecs, averaging, the fused updates), once for Python.

They are the C++ kernels' list (``xla_ffi/ops.h``), by name; each front end maps the names to its
own dtypes once, in its ``ops`` module (``bagua_jax.ops.KERNEL_FLOATS``,
``bagua_torch.ops.KERNEL_FLOATS``).
"""

KERNEL_FLOAT_DTYPES = ("float32", "float16", "bfloat16")
"""The names of the floating-point dtypes every native kernel takes."""

"""The framework-neutral floor under `bagua_jax` and `bagua_torch`.

What is neither JAX nor torch lives here once, in five layers: ``algorithms`` (configurations,
option checks, the compressed allreduce and the asynchronous averaging protocol), ``comm``
(collectives, engines, timeouts, topology, bucket plans), ``job`` (signature, checkpoints,
resharding, starting ranks), ``tuning`` (advisor and autotuner) and ``data`` (the cached dataset
and the samplers). It imports only the standard library, NumPy and the native modules.
"""

from bagua_common import moved

moved.install()

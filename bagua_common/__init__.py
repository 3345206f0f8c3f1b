"""The framework-neutral floor under `bagua_jax` and `bagua_torch`.

What is neither JAX nor torch lives here once: algorithm configurations, the communication
timeout and engine loading, topology, bucket plans, the asynchronous averaging protocol and the
data pipeline. It imports only the standard library, NumPy and the native modules.
"""

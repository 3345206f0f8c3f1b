"""Models in flax NNX that the project trains in its tests and benchmarks (:mod:`bagua_jax.models.gpt`)."""

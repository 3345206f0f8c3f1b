"""The algorithms' shared parts: configurations, option checks and the pipelines both front ends run.

Importing any part registers every algorithm's configuration (:data:`~bagua_common.algorithms.registry.CONFIGS`),
so a lookup derived from the registry sees them all.
"""

from bagua_common.algorithms import configs, diloco  # noqa: F401 (each module registers its configurations)

"""Bagua's ``bagua.torch_api.algorithms.decentralized``: both decentralized algorithms, Bagua's argument order.

``LowPrecisionDecentralizedAlgorithm`` runs Bagua's update (SPEC section 3: ``z = x + L/3 + R/3
- 5w/3``, 8-bit min-max codes to both ring neighbours, ``x = w + deQ(Q(z))``) with this
project's codec (SPEC section 2), whose rounding differs from Bagua's by less than one level,
so the weights agree with Bagua's reference within the codec's error, not bit for bit. With
``hierarchical=True`` on a single node it runs the ring over all ranks; Bagua averaged the
node at full precision and compressed only the difference to the last weights, leaving no
decentralized step at all on one node (the project treats one node as flat for every
hierarchical algorithm).
"""

from __future__ import annotations

from bagua_torch.algorithms import decentralized as _decentralized
from bagua_torch.algorithms import low_precision_decentralized as _low_precision

__all__ = ["DecentralizedAlgorithm", "LowPrecisionDecentralizedAlgorithm"]


class DecentralizedAlgorithm(_decentralized.DecentralizedAlgorithm):
    """Bagua's ``DecentralizedAlgorithm(hierarchical=True, peer_selection_mode="all", communication_interval=1)``."""

    def __init__(self, hierarchical: bool = True, peer_selection_mode: str = "all", communication_interval: int = 1):
        super().__init__(
            peer_selection_mode=peer_selection_mode,
            communication_interval=communication_interval,
            hierarchical=hierarchical,
        )


class LowPrecisionDecentralizedAlgorithm(_low_precision.LowPrecisionDecentralizedAlgorithm):
    """Bagua's ``LowPrecisionDecentralizedAlgorithm(hierarchical=True, communication_interval=1)`` (module docstring)."""

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1):
        super().__init__(communication_interval=communication_interval, hierarchical=hierarchical)

"""Bagua's ``bagua.torch_api.algorithms.decentralized``: both decentralized algorithms, Bagua's argument order.

``LowPrecisionDecentralizedAlgorithm`` is Bagua's update, as its implementation, its test's
reference and SPEC section 3 all define it: after the local step, ``z = x + L/3 + R/3 - 5w/3``,
8-bit min-max codes of ``z`` to both ring neighbours, ``L += deQ(from left)``, ``R += deQ(from
right)``, ``x = w + deQ(Q(z))``, ``w = x``. What differs is the codec:

* ``codec="bagua"`` (the default: Bagua's spelling runs Bagua's algorithm) reproduces Bagua's
  (``scale = 255 / (max - min + 1e-7)``, levels counted down from ``round(max * scale)``), so a
  script that changed only its import gets Bagua's numbers: its error reaches a whole level at the
  low end. It runs as plain torch operations. Bagua's codec could produce a code of -1 (stored as
  255) for the minimum when ``round`` went below the lowest level; here codes are clamped to 0..255.
  With ``hierarchical=True`` on a single node it does what Bagua did: the node's average at full
  precision, then the round of a ring of one (each neighbour is the node itself), the same on
  every rank.
* ``codec="project"`` is the project's algorithm (:class:`bagua_torch.algorithms.LowPrecisionDecentralizedAlgorithm`)
  and codec (SPEC section 2): codes rounded to the nearest level of a grid anchored at the minimum, so
  every element errs by at most ``(max - min) / 510``; the same bytes from the CPU and CUDA kernels
  and from the JAX side. With ``hierarchical=True`` on a single node the ring runs over all ranks
  (the project treats one node as flat for every hierarchical algorithm).

Either way the weights agree with Bagua's reference within the codecs' error; with
``codec="bagua"`` to float rounding (Bagua's ``test_compare`` tolerance, 1e-5).
"""

from __future__ import annotations

import torch

from bagua_common.algorithms.configs import DecentralizedConfig, LowPrecisionDecentralizedConfig
from bagua_common.comm.topology import ring_neighbours
from bagua_torch.algorithms import decentralized as _decentralized
from bagua_torch.algorithms import low_precision_decentralized as _low_precision
from bagua_torch.algorithms.base import AlgorithmContext
from bagua_torch.communicator import Communicator
from bagua_torch.torch_api.algorithms.base import implements

CODECS = ("project", "bagua")
_LEVELS = 255.0
_EPS = 1e-7


def bagua_minmax_compress(z: torch.Tensor) -> torch.Tensor:
    """Bagua's MinMaxUInt8 of float32 ``z``: 8 bytes of (min, max), then one code per element."""
    lo, hi = z.min(), z.max()
    scale = _LEVELS / (hi - lo + _EPS)
    upper = torch.round(hi * scale)
    codes = torch.clamp(torch.round(z * scale), min=upper - _LEVELS, max=upper) - (upper - _LEVELS)
    return torch.cat([torch.stack([lo, hi]).view(torch.uint8), codes.to(torch.uint8)])


def bagua_minmax_decompress(packed: torch.Tensor) -> torch.Tensor:
    """The float32 values of :func:`bagua_minmax_compress`'s bytes."""
    lo, hi = packed[:8].view(torch.float32)
    scale = _LEVELS / (hi - lo + _EPS)
    lower = torch.round(hi * scale) - _LEVELS
    return (packed[8:].to(torch.float32) + lower) / scale


__all__ = ["DecentralizedAlgorithm", "LowPrecisionDecentralizedAlgorithm"]


@implements(DecentralizedConfig)
class DecentralizedAlgorithm(_decentralized.DecentralizedAlgorithm):
    """Bagua's ``DecentralizedAlgorithm(hierarchical=True, peer_selection_mode="all", communication_interval=1)``."""

    def __init__(self, hierarchical: bool = True, peer_selection_mode: str = "all", communication_interval: int = 1):
        super().__init__(
            peer_selection_mode=peer_selection_mode,
            communication_interval=communication_interval,
            hierarchical=hierarchical,
        )

    def reify(self, context: AlgorithmContext) -> _decentralized.DecentralizedImpl:
        return _PeerWeightsImpl(context, self.config)


class _PeerWeightsImpl(_decentralized.DecentralizedImpl):
    """Decentralized SGD keeping each bucket's weights of the last averaging, Bagua's ``bucket._peer_weight``."""

    peer_weights: list[torch.Tensor] = []

    def average(self, round_index: int) -> None:
        super().average(round_index)
        with torch.no_grad():
            self.peer_weights = [b.flatten_params()[: b.numel].clone() for b in self.buckets]


@implements(LowPrecisionDecentralizedConfig)
class LowPrecisionDecentralizedAlgorithm(_low_precision.LowPrecisionDecentralizedAlgorithm):
    """Bagua's ``LowPrecisionDecentralizedAlgorithm(hierarchical=True, communication_interval=1)``; ``codec``
    picks the project's or Bagua's 8-bit codes (see the module docstring). ``codec`` is an attribute of the
    algorithm beside its configuration, so the cross-rank check and the checkpoint manifest compare it too."""

    def __init__(self, hierarchical: bool = True, communication_interval: int = 1, *, codec: str = "bagua"):
        if codec not in CODECS:
            raise ValueError(f"LowPrecisionDecentralizedAlgorithm: codec must be one of {CODECS}, got {codec!r}")
        super().__init__(communication_interval=communication_interval, hierarchical=hierarchical)
        self.codec = codec

    def reify(self, context: AlgorithmContext) -> _low_precision.LowPrecisionDecentralizedImpl:
        if self.codec == "bagua":
            return _BaguaCodecImpl(context, self.config)
        return super().reify(context)


class _BaguaCodecImpl(_low_precision.LowPrecisionDecentralizedImpl):
    """Bagua's ring round (its codec, its order of operations), and Bagua's round on one node when hierarchical."""

    def exchange(self) -> None:
        if not (self.config.hierarchical and self.levels is None and self.world.size > 1):
            return super().exchange()
        for i, bucket in enumerate(self.buckets):
            with torch.no_grad():
                x = self.world.allreduce(bucket.flatten_params()[: bucket.numel].to(torch.float32), "avg")
            w, left, right = self.weights[i], self.left[i], self.right[i]
            change = bagua_minmax_decompress(bagua_minmax_compress(x + left * (1 / 3) + right * (1 / 3) - w * (5 / 3)))
            self.weights[i], self.left[i], self.right[i] = w + change, left + change, right + change
            bucket.unflatten_to_params(self.weights[i])

    @staticmethod
    def _ring(
        x: torch.Tensor, w: torch.Tensor, left: torch.Tensor, right: torch.Tensor, ring: Communicator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        left_peer, right_peer = ring_neighbours(ring.rank, ring.size)
        peers = [left_peer] if ring.size == 2 else [left_peer, right_peer]
        z = x + left * (1 / 3) + right * (1 / 3) - w * (5 / 3)
        packed = bagua_minmax_compress(z)
        received = ring.send_recv(packed, peers)  # row i came from peers[i]
        from_left = bagua_minmax_decompress(received[0])
        from_right = bagua_minmax_decompress(received[-1])
        return w + bagua_minmax_decompress(packed), left + from_left, right + from_right

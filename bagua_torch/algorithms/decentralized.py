"""Decentralized SGD (full precision) and LowPrecisionDecentralized SGD (8-bit ring) for PyTorch.

Both communicate *weights*, not gradients (``need_gradient_hooks = False``: ``.grad``
stays each rank's own local gradient), in the optimizer's step hooks, on the training
thread. The math, the kernels and the order of operations are those of the JAX versions
(:mod:`bagua_jax.algorithms.decentralized` and
:mod:`bagua_jax.algorithms.low_precision_decentralized`; SPEC section 3).

**Decentralized** (:class:`DecentralizedAlgorithm`): on iterations ``t`` with
``t % communication_interval == 0``, in the optimizer's step *pre*-hook, every rank
replaces its weights by an average: over all ranks (``peer_selection_mode="all"``, an
allreduce of the weights) or over a pair (``"shift_one"``: in round
``t // communication_interval`` rank ``r`` of ``n`` (even) pairs with
:func:`shift_one_peer`, the two exchange their weights with ``send_recv`` and average them
with :func:`bagua_torch.ops.average2`). The optimizer then applies the rank's own
gradient, computed at the pre-average weights: ``x_{t+1} = avg(x_t) - lr * g(x_t)``.

**LowPrecisionDecentralized** (:class:`LowPrecisionDecentralizedAlgorithm`): ring
``left = r - 1``, ``right = r + 1`` (mod n). Every rank keeps float32 copies ``w`` (its
last communicated weights) and ``L``, ``R`` (its neighbours'), all initialized to the
initial weights (identical on every rank: the wrapper broadcasts rank 0's). On
communicating iterations, in the optimizer's step *post*-hook, with ``x`` the weights
after the local step: ``z = x + L/3 + R/3 - (5/3) w``
(:func:`~bagua_torch.ops.lowprec_decentralized_diff`), ``Q(z)`` (MinMaxUInt8, one chunk
per bucket) is sent to both neighbours, then ``L += deQ(from left)``,
``R += deQ(from right)``, ``x = w + deQ(Q(z))``, ``w = x``. Every rank adds exactly the
decoded bytes its neighbours add, so ``L`` and ``R`` stay bit-identical to the
neighbours' ``w``. The copies and the step counter are the algorithm's state
(``state_dict()``).

Hierarchical (``hierarchical=True``, the default as in Bagua; effective only when the job
spans several nodes with several ranks each, ``1 < LOCAL_WORLD_SIZE < WORLD_SIZE``): the
weights are averaged inside the node at full precision (an intra-node reduce-scatter, so
local rank ``j`` owns slice ``j`` of each bucket), slice ``j`` is exchanged across nodes
with the ranks of local index ``j`` (``shift_one`` then pairs *nodes*, so the node count
must be even; the low-precision ring runs over the nodes), and an intra-node allgather
reassembles the node's weights. Without two levels all ranks of ``world`` take part.

Several optimizers: an iteration is counted by the wrapped optimizers' steps. Decentralized
averages (all buckets) in the step pre-hook of the *first* optimizer given to the wrapper;
LowPrecisionDecentralized exchanges in the step post-hook of the *last* one. Step them in
the order given to the wrapper, once per iteration each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from bagua_torch import ops
from bagua_torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    check_dtypes,
    check_flags,
    check_tensor_list,
)
from bagua_torch.communicator import SUPPORTED_DTYPES, Communicator
from bagua_torch.compressed_allreduce import hierarchical as hierarchical_exchange

__all__ = [
    "PEER_SELECTION_MODES",
    "DecentralizedAlgorithm",
    "DecentralizedImpl",
    "LowPrecisionDecentralizedAlgorithm",
    "LowPrecisionDecentralizedImpl",
    "shift_one_peer",
]

PeerSelectionMode = Literal["all", "shift_one"]
PEER_SELECTION_MODES: tuple[str, ...] = ("all", "shift_one")

_FLOATS = tuple(d for d in SUPPORTED_DTYPES if d.is_floating_point)
_KERNEL_FLOATS = (torch.float32, torch.float16, torch.bfloat16)  # what the native kernels take
COMPRESSIBLE = _KERNEL_FLOATS


# ----------------------------------------------------------------------------- checks and pairing


def _check_interval(interval: Any, algorithm: str) -> None:
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise ValueError(f"{algorithm}: communication_interval must be a positive int, got {interval!r}")


def _check_even(size: int, across_nodes: bool = False) -> None:
    if size % 2 and size != 1:
        group = "nodes (the inter-node group of a hierarchical run)" if across_nodes else "ranks"
        raise ValueError(
            f"decentralized: peer_selection_mode='shift_one' pairs {group} two by two and needs an even number of "
            f"them, got {size}; use peer_selection_mode='all', an even count, or hierarchical=False"
        )


def shift_one_peer(rank: int, round_index: int, size: int) -> int:
    """The rank that ``rank`` averages with in communication round ``round_index`` (``shift_one``).

    For an even ``size`` (``h = size / 2``): ranks below ``h`` take ``(round_index + rank) % h + h``,
    the others ``(rank - h - round_index) mod h``; every rank is paired with exactly one other, and
    over ``h`` rounds a rank meets every rank of the other half. The same function as
    :func:`bagua_jax.algorithms.decentralized.shift_one_peer`. An odd ``size`` or one below 2 raises.
    """
    if size < 2:
        raise ValueError(f"shift_one needs at least 2 ranks to pair, got {size}")
    _check_even(size)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in 0..{size - 1}")
    half = size // 2
    shift = int(round_index) % half
    return (shift + rank) % half + half if rank < half else (rank - half - shift) % half


def _check_optimizers(context: AlgorithmContext, algorithm: str) -> None:
    if not context.optimizers:
        raise ValueError(
            f"{algorithm} communicates weights in the optimizer's step hooks: pass the optimizer(s) to the wrapper, "
            "e.g. with_bagua(model, [optimizer], ...)"
        )


def _load_step(state: dict[str, Any], algorithm: str) -> int:
    if "step" not in state:
        raise ValueError(f"{algorithm}: the checkpoint has no 'step' (holds {sorted(state)})")
    step = state["step"]
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.dtype.is_floating_point:
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{algorithm}: the checkpoint's 'step' must be a non-negative int, got {step!r}")
    return step


# ----------------------------------------------------------------------------- Decentralized


@dataclass(frozen=True)
class DecentralizedAlgorithm(Algorithm):
    """Decentralized SGD: average the weights with all ranks or with one peer, then step locally.

    Every ``communication_interval`` iterations, before the optimizer's step, the weights are
    replaced by their average over all ranks (``peer_selection_mode="all"``: an allreduce of
    the weights, the bytes of an fp32 gradient allreduce) or over a pair of ranks that changes
    every round (``"shift_one"``: the weights sent once to one peer; even rank counts only);
    the optimizer then applies this rank's own gradient. ``hierarchical`` averages inside each
    node first and exchanges across nodes only. Choose it on high-latency networks, where not
    waiting for a global allreduce every step pays for slightly different replicas. Needs the
    optimizer(s) passed to the wrapper.
    """

    peer_selection_mode: PeerSelectionMode = "all"
    communication_interval: int = 1
    hierarchical: bool = True

    name: ClassVar[str] = "decentralized"

    def __post_init__(self) -> None:
        if self.peer_selection_mode not in PEER_SELECTION_MODES:
            raise ValueError(
                f"{self.name}: peer_selection_mode must be one of {PEER_SELECTION_MODES}, got "
                f"{self.peer_selection_mode!r}"
            )
        _check_interval(self.communication_interval, self.name)
        check_flags(self.name, hierarchical=self.hierarchical)

    def reify(self, context: AlgorithmContext) -> DecentralizedImpl:
        return DecentralizedImpl(context, self)


class DecentralizedImpl(AlgorithmImpl):
    """Decentralized SGD on one wrapped model; its state is ``{"step": iterations counted so far}``."""

    need_gradient_hooks = False

    def __init__(self, context: AlgorithmContext, config: DecentralizedAlgorithm):
        super().__init__(context)
        name = config.name
        _check_optimizers(context, name)
        check_dtypes(context.buckets, _FLOATS, name, "weights are averaged in")
        self.config = config
        self.levels = context.communicators.levels(config.hierarchical, name)
        self.group: Communicator = self.levels[1] if self.levels else self.world
        if config.peer_selection_mode == "shift_one":
            _check_even(self.group.size, self.levels is not None)
        self.step = 0
        self.last_peer: int | None = None
        """The peer of the last ``shift_one`` exchange (in ``group``: nodes when hierarchical), for inspection."""

    def _exchange(self, flat: torch.Tensor, comm: Communicator, peer: int | None) -> torch.Tensor:
        """``flat`` averaged over ``comm`` (``"all"``) or with ``peer`` (``"shift_one"``)."""
        if comm.size == 1:  # one rank (or one node) in the group: nothing to exchange
            return flat
        if peer is None:
            return comm.allreduce(flat, "avg")
        theirs = comm.send_recv(flat, [peer])[0]
        if flat.dtype in _KERNEL_FLOATS:
            return ops.average2(flat, theirs)
        return (flat + theirs) / 2  # float64: the kernel's (a + b) * 0.5 in the tensors' own precision

    def average(self, round_index: int) -> None:
        """Replace the weights by their average for communication round ``round_index`` (collective)."""
        peer = None
        if self.config.peer_selection_mode == "shift_one" and self.group.size > 1:
            peer = shift_one_peer(self.group.rank, round_index, self.group.size)
            self.last_peer = peer
        for bucket in self.buckets:
            flat = bucket.flatten_params()
            if self.levels is None:
                averaged = self._exchange(flat, self.world, peer)
            else:
                intra, inter = self.levels
                averaged = hierarchical_exchange(lambda mine, comm: self._exchange(mine, comm, peer), flat, intra, inter)
            bucket.unflatten_to_params(averaged)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is not self.context.optimizers[0]:
            return
        interval = self.config.communication_interval
        if self.step % interval == 0:  # the same counter on every rank: all communicate, or none
            self.average(self.step // interval)
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = _load_step(state, self.config.name)


# ----------------------------------------------------------------------------- LowPrecisionDecentralized


@dataclass(frozen=True)
class LowPrecisionDecentralizedAlgorithm(Algorithm):
    """Low-precision decentralized SGD: after each local step, mix the weights with the ring neighbours'.

    Every ``communication_interval`` iterations, after the optimizer's step, each rank sends
    8-bit min-max codes of a weight difference to its two ring neighbours (``B / 2`` bytes
    per ``B`` fp32 bytes of weights, about a quarter of a ring allreduce) and mixes its
    weights with theirs. ``hierarchical`` averages inside each node at full precision first
    and runs the ring across nodes. Parameters must be float32, float16 or bfloat16; the
    optimizer(s) must be passed to the wrapper. Choose it on the slowest networks.
    """

    communication_interval: int = 1
    hierarchical: bool = True

    name: ClassVar[str] = "low_precision_decentralized"

    def __post_init__(self) -> None:
        _check_interval(self.communication_interval, self.name)
        check_flags(self.name, hierarchical=self.hierarchical)

    def reify(self, context: AlgorithmContext) -> LowPrecisionDecentralizedImpl:
        return LowPrecisionDecentralizedImpl(context, self)


def _padded_rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` (1-D) zero-padded to a multiple of ``k`` elements, as ``k`` rows (a new tensor)."""
    out = torch.zeros(-(-t.numel() // k) * k, dtype=t.dtype, device=t.device)
    out[: t.numel()] = t
    return out.view(k, -1)


class LowPrecisionDecentralizedImpl(AlgorithmImpl):
    """LowPrecisionDecentralized on one wrapped model.

    State: ``step`` (iterations counted) and, per bucket, float32 tensors of the bucket's
    ``numel`` elements (no padding): ``weights`` (``w``), ``left`` (``L``), ``right`` (``R``).
    When hierarchical, each rank's copies stay full-sized but only its own slice is read and
    written (as in the JAX version).
    """

    need_gradient_hooks = False

    def __init__(self, context: AlgorithmContext, config: LowPrecisionDecentralizedAlgorithm):
        super().__init__(context)
        name = config.name
        _check_optimizers(context, name)
        check_dtypes(context.buckets, COMPRESSIBLE, name, "the 8-bit codes compress")
        self.config = config
        self.levels = context.communicators.levels(config.hierarchical, name)
        self.sizes = [bucket.numel for bucket in context.buckets]
        # The wrapper broadcast rank 0's parameters before building the algorithm: the same copies everywhere.
        with torch.no_grad():
            initial = [b.flatten_params()[: b.numel].to(torch.float32) for b in context.buckets]
        self.weights = [t.clone() for t in initial]
        self.left = [t.clone() for t in initial]
        self.right = [t.clone() for t in initial]
        self.step = 0

    @staticmethod
    def _ring(
        x: torch.Tensor, w: torch.Tensor, left: torch.Tensor, right: torch.Tensor, ring: Communicator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One ring round on one float32 buffer (``ring.size >= 2``): the new ``x`` (= new ``w``), ``L``, ``R``."""
        n, r, m = ring.size, ring.rank, x.numel()
        left_peer, right_peer = (r - 1) % n, (r + 1) % n
        # With two ranks both neighbours are the same rank and get the same Q(z): one message serves both.
        peers = [left_peer] if n == 2 else [left_peer, right_peer]
        packed = ops.minmax_uint8_compress(ops.lowprec_decentralized_diff(x, w, left, right), 1)
        received = ring.send_recv(packed, peers)  # row i came from peers[i]
        from_left = ops.minmax_uint8_decompress(received[0], m, 1)
        from_right = ops.minmax_uint8_decompress(received[-1], m, 1) if n > 2 else from_left
        new_x = w + ops.minmax_uint8_decompress(packed, m, 1)
        return new_x, left + from_left, right + from_right

    def exchange(self) -> None:
        """One communication round on every bucket (collective): mix the weights, update the copies."""
        for i, bucket in enumerate(self.buckets):
            with torch.no_grad():
                x = bucket.flatten_params()[: bucket.numel].to(torch.float32)
            w, left, right = self.weights[i], self.left[i], self.right[i]
            if self.levels is not None:
                new_x = self._hierarchical(i, x)
            elif self.world.size == 1:  # a ring of one has no neighbours; the copies are never read
                new_x = x
            else:
                new_x, self.left[i], self.right[i] = self._ring(x, w, left, right, self.world)
                self.weights[i] = new_x
            bucket.unflatten_to_params(new_x)

    def _hierarchical(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Node average (reduce-scatter), the ring across nodes on this rank's slice, allgather inside the node."""
        intra, inter = self.levels
        k, me = intra.size, intra.rank
        mine = intra.reduce_scatter(_padded_rows(x, k), "avg")
        if inter.size > 1:
            own = [_padded_rows(c[i], k) for c in (self.weights, self.left, self.right)]
            mine, new_left, new_right = self._ring(mine, own[0][me], own[1][me], own[2][me], inter)
            for rows, row, copies in zip(own, (mine, new_left, new_right), (self.weights, self.left, self.right)):
                rows[me] = row
                copies[i] = rows.view(-1)[: x.numel()].clone()
        return intra.allgather(mine).view(-1)[: x.numel()]

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is not self.context.optimizers[-1]:
            return
        if self.step % self.config.communication_interval == 0:  # the same counter on every rank
            self.exchange()
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "weights": [t.detach().clone() for t in self.weights],
            "left": [t.detach().clone() for t in self.left],
            "right": [t.detach().clone() for t in self.right],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        name = self.config.name
        step = _load_step(state, name)
        loaded = {key: check_tensor_list(state, key, self.sizes, name) for key in ("weights", "left", "right")}
        device = self.context.device
        self.step = step
        self.weights, self.left, self.right = (
            [t.detach().to(device).clone() for t in loaded[key]] for key in ("weights", "left", "right")
        )

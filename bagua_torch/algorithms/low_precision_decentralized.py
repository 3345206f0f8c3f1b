"""LowPrecisionDecentralized SGD (8-bit ring) for PyTorch.

Like :mod:`bagua_torch.algorithms.decentralized` it communicates *weights*, in the
optimizer's step hooks, on the training thread; the math, the kernels and the order of
operations are those of :mod:`bagua_jax.algorithms.low_precision_decentralized` (SPEC
section 3).

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

Hierarchical (``hierarchical=True``, effective only when ``1 < LOCAL_WORLD_SIZE <
WORLD_SIZE``): the weights are averaged inside the node at full precision (an intra-node
reduce-scatter, so local rank ``j`` owns slice ``j`` of each bucket), the ring runs over the
nodes on slice ``j``, and an intra-node allgather reassembles the node's weights.

Several optimizers: an iteration is counted by the wrapped optimizers' steps; the exchange
runs in the step post-hook of the *last* optimizer given to the wrapper.
"""

from __future__ import annotations

from typing import Any

import torch

from bagua_common.algorithms.configs import LowPrecisionDecentralizedConfig
from bagua_common.comm.topology import ring_peers
from bagua_torch import ops
from bagua_torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    check_tensor_list,
    implements,
)
from bagua_torch.algorithms.decentralized import load_step, weight_averaging_levels
from bagua_torch.algorithms.joiner_sits_out import JoinerSitsOutOneStep
from bagua_torch.communicator import Communicator

__all__ = ["LowPrecisionDecentralizedAlgorithm", "LowPrecisionDecentralizedImpl"]


@implements(LowPrecisionDecentralizedConfig)
class LowPrecisionDecentralizedAlgorithm(Algorithm):
    """Low-precision decentralized SGD: after each local step, mix the weights with the ring neighbours'.

    Every ``communication_interval`` iterations, after the optimizer's step, each rank sends
    8-bit min-max codes of a weight difference to its two ring neighbours (``B / 2`` bytes
    per ``B`` fp32 bytes of weights, about a quarter of a ring allreduce) and mixes its
    weights with theirs. ``hierarchical`` averages inside each node at full precision first
    and runs the ring across nodes. Parameters must be float32, float16 or bfloat16; the
    optimizer(s) must be passed to the wrapper. Choose it on the slowest networks. In a fault-tolerant job each rank
    keeps its own weights when the members change, and the copies start again from them
    (:meth:`LowPrecisionDecentralizedImpl.resume`); a joiner sits out the step after its admission, which the
    members train without the ring's exchange.
    """

    fault_tolerant = True

    def reify(self, context: AlgorithmContext) -> LowPrecisionDecentralizedImpl:
        return LowPrecisionDecentralizedImpl(context, self.config)


def _padded_rows(t: torch.Tensor, k: int) -> torch.Tensor:
    """``t`` (1-D) zero-padded to a multiple of ``k`` elements, as ``k`` rows (a new tensor)."""
    out = torch.zeros(-(-t.numel() // k) * k, dtype=t.dtype, device=t.device)
    out[: t.numel()] = t
    return out.view(k, -1)


class LowPrecisionDecentralizedImpl(JoinerSitsOutOneStep):
    """LowPrecisionDecentralized on one wrapped model.

    State: ``step`` (iterations counted) and, per bucket, float32 tensors of the bucket's
    ``numel`` elements (no padding): ``weights`` (``w``), ``left`` (``L``), ``right`` (``R``).
    When hierarchical, each rank's copies stay full-sized but only its own slice is read and
    written (as in the JAX version).
    """

    need_gradient_hooks = False

    def __init__(self, context: AlgorithmContext, config: LowPrecisionDecentralizedConfig):
        super().__init__(context)
        self.config = config
        self.levels = weight_averaging_levels(context, config, ops.KERNEL_FLOATS, "the 8-bit codes compress")
        self.sizes = [bucket.numel for bucket in context.buckets]
        # The wrapper broadcast rank 0's parameters before building the algorithm: the same copies everywhere.
        with torch.no_grad():
            initial = [b.flatten_params()[: b.numel].to(torch.float32) for b in context.buckets]
        self.weights = [t.clone() for t in initial]
        self.left = [t.clone() for t in initial]
        self.right = [t.clone() for t in initial]
        self.step = self._step_in_flight = self._committed_step = 0
        self._copies_due = False  # restart the copies at the next step's start: after a joiner's sit-out

    @staticmethod
    def _ring(
        x: torch.Tensor, w: torch.Tensor, left: torch.Tensor, right: torch.Tensor, ring: Communicator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One ring round on one float32 buffer (``ring.size >= 2``): the new ``x`` (= new ``w``), ``L``, ``R``."""
        n, m = ring.size, x.numel()
        packed = ops.minmax_uint8_compress(ops.lowprec_decentralized_diff(x, w, left, right), 1)
        received = ring.send_recv(packed, ring_peers(ring.rank, ring.size))  # row i came from peers[i]
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

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is not self.context.optimizers[0]:
            return
        self._step_in_flight = self.step
        if self._copies_due and self.step >= self._exchanges_from:  # before any optimizer moves the weights
            self._copies_due = False
            self._restart_copies()

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is not self.context.optimizers[-1]:
            return
        if self.exchanges_now():
            self.exchange()
        self.step += 1

    # --- fault tolerance: the step carries; the copies restart from the weights, the neighbours' exchanged once

    def after_change(self) -> None:
        """After a change of members (collective over the new ones): restart the copies
        (:meth:`_restart_copies`). Where ranks given the state sit out the next step while it travels, every rank
        restarts them at the start of the step after it instead (in :meth:`before_step`, the optimizers not having
        moved the weights yet), once those ranks have weights: the members there, the ranks given the state too
        (:meth:`sit_out`), since the replica check at the step boundary before it is collective."""
        if self._copies_due or self.step < self._exchanges_from:
            self._copies_due = True
        else:
            self._restart_copies()

    def sit_out(self, steps: int) -> None:
        """Count ``steps`` steps this rank did not train, and restart the copies at the start of the next one, with
        the members'."""
        super().sit_out(steps)
        self._copies_due = True

    def _restart_copies(self) -> None:
        """``w`` becomes this rank's weights and ``L``, ``R`` its neighbours', sent once in full precision, so that
        each copy is again the bits its neighbour holds (the weights drift apart between exchanges, and the
        neighbours are others). When hierarchical, on this rank's slice of the node's average, over the ring of
        nodes. Collective over the members."""
        for i, bucket in enumerate(self.buckets):
            with torch.no_grad():
                x = bucket.flatten_params()[: bucket.numel].to(torch.float32)
            if self.levels is None:
                self.weights[i], self.left[i], self.right[i] = (x.clone(), *self._neighbours(x, self.world))
                continue
            intra, inter = self.levels
            mine = intra.reduce_scatter(_padded_rows(x, intra.size), "avg")
            for copies, row in zip((self.weights, self.left, self.right), (mine, *self._neighbours(mine, inter))):
                rows = _padded_rows(copies[i], intra.size)
                rows[intra.rank] = row
                copies[i] = rows.view(-1)[: x.numel()].clone()

    @staticmethod
    def _neighbours(x: torch.Tensor, ring: Communicator) -> tuple[torch.Tensor, torch.Tensor]:
        """The left and the right neighbour's ``x`` on ``ring`` (``x`` itself on a ring of one)."""
        if ring.size == 1:
            return x.clone(), x.clone()
        received = ring.send_recv(x, ring_peers(ring.rank, ring.size))
        return received[0].clone(), received[-1].clone()

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "weights": [t.detach().clone() for t in self.weights],
            "left": [t.detach().clone() for t in self.left],
            "right": [t.detach().clone() for t in self.right],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        name = self.config.name
        step = load_step(state, name)
        loaded = {key: check_tensor_list(state, key, self.sizes, name) for key in ("weights", "left", "right")}
        device = self.context.device
        self.step = self._committed_step = step  # committed: a change before the next commit carries it
        self.weights, self.left, self.right = (
            [t.detach().to(device).clone() for t in loaded[key]] for key in ("weights", "left", "right")
        )

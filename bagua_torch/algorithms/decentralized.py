"""Decentralized SGD (full precision) for PyTorch.

It communicates *weights*, not gradients (``need_gradient_hooks = False``: ``.grad``
stays each rank's own local gradient), in the optimizer's step hooks, on the training
thread. The math, the kernels and the order of operations are those of the JAX versions
(:mod:`bagua_jax.algorithms.decentralized`; SPEC section 3).

**Decentralized** (:class:`DecentralizedAlgorithm`): on iterations ``t`` with
``t % communication_interval == 0``, in the optimizer's step *pre*-hook, every rank
replaces its weights by an average: over all ranks (``peer_selection_mode="all"``, an
allreduce of the weights) or over a pair (``"shift_one"``: in round
``t // communication_interval`` rank ``r`` of ``n`` (even) pairs with
:func:`shift_one_peer`, the two exchange their weights with ``send_recv`` and average them
with :func:`bagua_torch.ops.average2`). The optimizer then applies the rank's own
gradient, computed at the pre-average weights: ``x_{t+1} = avg(x_t) - lr * g(x_t)``.

Hierarchical (``hierarchical=True``, the default as in Bagua; effective only when the job
spans several nodes with several ranks each, ``1 < LOCAL_WORLD_SIZE < WORLD_SIZE``): the
weights are averaged inside the node at full precision (an intra-node reduce-scatter, so
local rank ``j`` owns slice ``j`` of each bucket), slice ``j`` is exchanged across nodes
with the ranks of local index ``j`` (``shift_one`` then pairs *nodes*, so the node count
must be even), and an intra-node allgather
reassembles the node's weights. Without two levels all ranks of ``world`` take part.

Several optimizers: an iteration is counted by the wrapped optimizers' steps. Decentralized
averages (all buckets) in the step pre-hook of the *first* optimizer given to the wrapper;
LowPrecisionDecentralized exchanges in the step post-hook of the *last* one. Step them in
the order given to the wrapper, once per iteration each.
"""

from __future__ import annotations

from typing import Any

import torch

from bagua_common.algorithms.compressed_allreduce import hierarchical as hierarchical_exchange
from bagua_common.algorithms.configs import DecentralizedConfig
from bagua_common.comm.topology import (
    check_pairable,
    shift_one_schedule,
)
from bagua_torch import ops
from bagua_torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    check_dtypes,
    implements,
)
from bagua_torch.algorithms.joiner_sits_out import JoinerSitsOutOneStep
from bagua_torch.communicator import SUPPORTED_FLOATS, Communicator

__all__ = ["DecentralizedAlgorithm", "DecentralizedImpl", "shift_one_peer"]

"""The float dtypes the native kernels take (the others are averaged in torch)."""


# ----------------------------------------------------------------------------- checks and pairing


def shift_one_peer(rank: int, round_index: int, size: int) -> int:
    """The rank that ``rank`` averages with in communication round ``round_index`` (``shift_one``).

    A lookup in :func:`bagua_common.comm.topology.shift_one_schedule`, the table
    :func:`bagua_jax.algorithms.decentralized.shift_one_peer` reads too. An odd ``size``, one
    below 2 or a ``rank`` outside ``0..size-1`` raises a ValueError.
    """
    schedule = shift_one_schedule(size)
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in 0..{size - 1}")
    return int(schedule[int(round_index) % schedule.shape[0], rank])


def weight_averaging_levels(
    context: AlgorithmContext, config: Any, dtypes: tuple[torch.dtype, ...], what: str
) -> tuple[Communicator, Communicator] | None:
    """Check what a weight-averaging algorithm needs (the optimizers, whose step hooks it works in, and parameters
    of ``dtypes``: "``what`` <dtypes> only" otherwise) and return its two levels, or None when flat."""
    if not context.optimizers:
        raise ValueError(
            f"{config.name} communicates weights in the optimizer's step hooks: pass the optimizer(s) to the "
            "wrapper, e.g. with_bagua(model, [optimizer], ...)"
        )
    check_dtypes(context.buckets, dtypes, config.name, what)
    return context.communicators.levels(config.hierarchical, config.name)


def load_step(state: dict[str, Any], algorithm: str) -> int:
    if "step" not in state:
        raise ValueError(f"{algorithm}: the checkpoint has no 'step' (holds {sorted(state)})")
    step = state["step"]
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.dtype.is_floating_point:
        step = int(step)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"{algorithm}: the checkpoint's 'step' must be a non-negative int, got {step!r}")
    return step


# ----------------------------------------------------------------------------- Decentralized


@implements(DecentralizedConfig)
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

    fault_tolerant = True

    def reify(self, context: AlgorithmContext) -> DecentralizedImpl:
        return DecentralizedImpl(context, self.config)


class DecentralizedImpl(JoinerSitsOutOneStep):
    """Decentralized SGD on one wrapped model; its state is ``{"step": iterations counted so far}``."""

    need_gradient_hooks = False

    def __init__(self, context: AlgorithmContext, config: DecentralizedConfig):
        super().__init__(context)
        name = config.name
        self.config = config
        self.levels = weight_averaging_levels(context, config, SUPPORTED_FLOATS, "weights are averaged in")
        self.group: Communicator = self.levels[1] if self.levels else self.world
        # A fault-tolerant job may be left with an odd number of ranks: those rounds average over all instead.
        if config.peer_selection_mode == "shift_one" and context.fault_tolerance is None:
            check_pairable(self.group.size, name, self.levels is not None)
        self.step = self._step_in_flight = self._committed_step = 0
        self.last_peer: int | None = None
        """The peer of the last ``shift_one`` exchange (in ``group``: nodes when hierarchical), for inspection."""

    def _exchange(self, flat: torch.Tensor, comm: Communicator, peer: int | None) -> torch.Tensor:
        """``flat`` averaged over ``comm`` (``"all"``) or with ``peer`` (``"shift_one"``)."""
        if comm.size == 1:  # one rank (or one node) in the group: nothing to exchange
            return flat
        if peer is None:
            return comm.allreduce(flat, "avg")
        theirs = comm.send_recv(flat, [peer])[0]
        if flat.dtype in ops.KERNEL_FLOATS:
            return ops.average2(flat, theirs)
        return (flat + theirs) / 2  # float64: the kernel's (a + b) * 0.5 in the tensors' own precision

    def average(self, round_index: int) -> None:
        """Replace the weights by their average for communication round ``round_index`` (collective)."""
        peer = None
        if self.config.peer_selection_mode == "shift_one" and self.group.size > 1 and self.group.size % 2 == 0:
            peer = shift_one_peer(self.group.rank, round_index, self.group.size)
            self.last_peer = peer
        averages = []
        for bucket in self.buckets:
            flat = bucket.flatten_params()
            if self.levels is None:
                averages.append(self._exchange(flat, self.world, peer))
            else:
                intra, inter = self.levels
                averages.append(
                    hierarchical_exchange(lambda mine, comm: self._exchange(mine, comm, peer), flat, intra, inter)
                )
        self.commit()  # fault tolerance: every rank writes its average, or none does
        for bucket, averaged in zip(self.buckets, averages):
            bucket.unflatten_to_params(averaged)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is not self.context.optimizers[0]:
            return
        self._step_in_flight = self.step
        if self.exchanges_now():
            self.average(self.step // self.config.communication_interval)
        self.step += 1

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = self._committed_step = load_step(state, self.config.name)  # committed: a change carries it

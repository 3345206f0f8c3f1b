"""DiLoCo and Streaming DiLoCo for PyTorch: local steps with the user's optimizer, an outer step every H steps.

The schedule, the fragments and the options are :mod:`bagua_common.algorithms.diloco`'s and the exchange
is :mod:`bagua_common.algorithms.outer_exchange`'s, so the bytes on the wire are those of
:mod:`bagua_jax.algorithms.diloco`. Nothing is communicated in the backward pass
(``need_gradient_hooks = False``). In the step post-hook of the last wrapped optimizer, after
inner step ``t``:

1. each fragment due for an exchange computes its pseudo-gradient ``round_start - x`` (float32)
   and averages it over the ranks: at once when ``fragment_sync_delay`` is 0, else on the
   impl's ordered worker thread, over a communicator of its own, overlapping the next tau
   inner steps;
2. each fragment due for its outer step (tau steps after its exchange) hands the average to its
   outer optimizer, which steps on the round-start parameters, and the parameters become
   ``alpha * x + (1 - alpha) * round_start`` (a copy of the round start when alpha is 0: every
   rank then holds the same bits).

The round-start parameters live in host memory unless ``round_start_memory="device"``.
``outer_optimizer`` is a callable making a ``torch.optim.Optimizer`` from a list of tensors
(one per fragment); None is Nesterov SGD with lr 0.7 and momentum 0.9.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bagua_common.algorithms.diloco import (
    DiLoCoConfig,
    fragment_plan,
)
from bagua_common.algorithms.outer_exchange import OuterExchange
from bagua_common.fault_tolerance.errors import ExchangeInterrupted, MembershipChanged
from bagua_torch import ops
from bagua_torch.algorithms.base import Algorithm, AlgorithmContext, AlgorithmImpl, check_tensor_list, implements
from bagua_torch.algorithms.decentralized import load_step
from bagua_torch.communicator import (
    SUPPORTED_FLOATS,
    CommunicationError,
    NativeCommunicator,
    Work,
    dedicated_communicator,
)

EXCHANGE = OuterExchange(ops, lambda x, dtype: x.to(getattr(torch, dtype)))
"""The pseudo-gradient averages on torch tensors."""


def default_outer_optimizer(config: DiLoCoConfig) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer]:
    """Nesterov SGD with ``config``'s outer learning rate and momentum
    (:attr:`~bagua_common.algorithms.diloco.DiLoCoConfig.outer_settings`), as a callable of the tensors it steps."""
    learning_rate, momentum = config.outer_settings
    return lambda params: torch.optim.SGD(params, lr=learning_rate, momentum=momentum, nesterov=momentum > 0)


@implements(DiLoCoConfig)
class DiLoCoAlgorithm(Algorithm):
    """DiLoCo / Streaming DiLoCo (see :mod:`bagua_common.algorithms.diloco` and the module docstring).

    The wrapped optimizer is the inner one; every ``sync_every`` steps the ranks average their
    pseudo-gradients (``outer_exchange``: fp32, bf16, 8-bit or 4-bit min-max codes) and the
    outer optimizer steps on the round-start parameters. Choose it on slow links: it sends
    ``sync_every`` times fewer bytes than an allreduce per step (times the codec's saving), at
    the price of replicas that drift apart inside a round. Needs the optimizer(s) passed to the
    wrapper.
    """

    fault_tolerant = True

    def reify(self, context: AlgorithmContext) -> DiLoCoImpl:
        return DiLoCoImpl(context, self.config)


class DiLoCoImpl(AlgorithmImpl):
    """DiLoCo on one wrapped model. Its state: ``step``, ``round_start`` (one tensor per parameter),
    ``outer`` (each fragment's outer optimizer state), ``pending`` (averages not yet applied) and
    ``residuals`` (error feedback), empty tensors where unused."""

    need_gradient_hooks = False
    transaction_per_step = False  # fault tolerance: each outer exchange is a transaction, not each inner step

    def __init__(self, context: AlgorithmContext, config: DiLoCoConfig):
        super().__init__(context)
        name = config.name
        if not context.optimizers:
            raise ValueError(f"{name} steps in the optimizer's step hooks: pass the optimizer(s) to the wrapper")
        self.params = [p for _, p in context.named_parameters]
        for param_name, p in context.named_parameters:
            if p.dtype not in SUPPORTED_FLOATS:
                raise TypeError(f"{name}: parameter {param_name} has dtype {p.dtype}; floating point only")
        self.config = config
        self.plan = fragment_plan([p.numel() for p in self.params], config.fragments)
        self.sizes = [sum(self.params[i].numel() for i in part) for part in self.plan]
        memory = torch.device("cpu") if config.round_start_memory == "host" else context.device
        self.round_start = [p.detach().to(memory, copy=True) for p in self.params]
        make: Callable[[list[torch.Tensor]], torch.optim.Optimizer] = config.outer_optimizer or default_outer_optimizer(
            config
        )
        self.outer = [make([self.round_start[i] for i in part]) for part in self.plan]
        # Exchanges overlapping the next steps run on the worker thread: a communicator nothing else uses.
        self.comm = dedicated_communicator(self.world, name) if config.fragment_sync_delay else self.world
        n = self.world.size
        self.padded = [-(-size // n) * n for size in self.sizes]
        self.residuals = [
            torch.zeros(padded if config.error_feedback else 0, device=context.device) for padded in self.padded
        ]
        self.pending: list[Work | torch.Tensor | None] = [None] * config.fragments
        self.own: dict[int, torch.Tensor] = {}
        """Fault tolerance: each exchange not yet applied, by fragment: this rank's pseudo-gradient (float32, not
        padded), retried among the survivors if the members change before it is applied."""
        self.silent: set[int] = set()
        """Fault tolerance: the fragments whose next exchange this rank sits out (it was given the state and has
        not trained: its pseudo-gradient is zero and the average divides by the ranks that trained)."""
        self.step = 0
        self._ticker = context.optimizers[-1]

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is not self._ticker:
            return
        self.step += 1
        delay = self.config.fragment_sync_delay
        try:
            for p in self.config.exchanges_after(self.step):
                flat = self._pseudo_gradient(p)
                if self.fault_tolerance is not None:
                    self.own[p] = flat[: self.sizes[p]]
                if delay:
                    self.pending[p] = self.run_async(lambda p=p, flat=flat: self._average(p, flat))
                else:
                    self._commit_and_apply(p, self._average(p, flat))
            for p in self.config.applies_after(self.step) if delay else ():
                self._commit_and_apply(p, self._result(p))
        except (MembershipChanged, CommunicationError) as error:
            if self.fault_tolerance is None:
                raise
            raise ExchangeInterrupted(f"{self.config.name}: an outer exchange was interrupted ({error})") from error

    def _commit_and_apply(self, p: int, mean: torch.Tensor) -> None:
        """Apply fragment ``p``'s average; in a fault-tolerant job once every member agreed (a transaction)."""
        if self.fault_tolerance is not None:
            if not self.fault_tolerance.commit():
                raise MembershipChanged(f"{self.config.name}: fragment {p}'s exchange did not commit")
            self.own.pop(p, None)
            self.silent.discard(p)
        self._apply(p, mean)

    def after_change(self) -> None:
        """After a change of members: exchange again, among the survivors, every pseudo-gradient not yet applied
        (the step's inner work is kept), then apply each once all agree."""
        for p, own in sorted(self.own.items()):
            flat = torch.nn.functional.pad(own.to(self.context.device), (0, self.padded[p] - self.sizes[p]))
            if self.config.fragment_sync_delay and p not in self.config.applies_after(self.step):
                self.pending[p] = self.run_async(lambda p=p, flat=flat: self._average(p, flat))  # still overlapping
            else:
                self._commit_and_apply(p, self._average(p, flat))

    def steps_to_next_exchange(self) -> int | None:
        """The steps before the exchange a rank given the state now can join without having trained: none when an
        exchange is pending (retried after a change), else the rest of the round. None for Streaming DiLoCo (its
        fragments' rounds overlap: a joiner receives the state while its peers wait)."""
        if self.config.fragments != 1 or self.config.fragment_sync_delay:
            return None
        if self.own:
            return 0
        return self.config.steps_to_exchange(self.step)

    def sit_out(self, steps: int) -> None:
        """Skip ``steps`` inner steps and join the exchange after them without having trained, as INTELLECT-1's
        joiners do: a zero pseudo-gradient the average does not count. Applying that exchange gives this rank the
        replicas' round start."""
        self.step += steps
        self.own = {0: torch.zeros(self.sizes[0], device=self.context.device)}
        self.silent = {0}

    def _pseudo_gradient(self, p: int) -> torch.Tensor:
        device = self.context.device
        with torch.no_grad():
            parts = [
                (self.round_start[i].to(device, torch.float32) - self.params[i].to(torch.float32)).reshape(-1)
                for i in self.plan[p]
            ]
            flat = torch.cat(parts)
            return torch.nn.functional.pad(flat, (0, self.padded[p] - self.sizes[p]))

    def _average(self, p: int, flat: torch.Tensor) -> torch.Tensor:
        residual = self.residuals[p] if self.config.error_feedback else None
        mean, residual = EXCHANGE.average(flat, self.comm, self.config.outer_exchange, residual)
        if residual is not None:
            self.residuals[p] = residual
        if self.fault_tolerance is not None:  # a rank sitting out its first round sent zeros: not counted
            trained = float(self.comm.allreduce(torch.tensor([float(p not in self.silent)], device=flat.device)))
            if trained != self.comm.size:  # none trained (those that did were lost): zero, the same on every rank
                mean = mean * (self.comm.size / max(trained, 1.0))
        return mean[: self.sizes[p]]

    def _result(self, p: int) -> torch.Tensor:
        """Fragment ``p``'s average, waiting for its exchange if it is still on the wire."""
        pending = self.pending[p]
        if isinstance(pending, Work):
            pending = pending.wait()
        self.pending[p] = None
        return pending

    @torch.no_grad()
    def _apply(self, p: int, mean: torch.Tensor) -> None:
        outer, alpha, offset = self.outer[p], float(self.config.fragment_update_alpha), 0
        for i in self.plan[p]:
            anchor = self.round_start[i]
            anchor.grad = mean[offset : offset + anchor.numel()].reshape(anchor.shape).to(anchor.device, anchor.dtype)
            offset += anchor.numel()
        outer.step()
        for i in self.plan[p]:
            anchor, param = self.round_start[i], self.params[i]
            anchor.grad = None
            if alpha == 0.0:
                param.copy_(anchor)
            else:
                param.copy_(alpha * param + (1.0 - alpha) * anchor.to(param.device))

    # --- fault tolerance: what a change of members keeps ------------------------------------

    def carried_state(self) -> dict[str, Any]:
        """The step, the round start, the outer optimizers' state (all the same on every rank) and this rank's
        pseudo-gradients not yet applied (retried after the change; the fragments among them it sits out);
        error-feedback residuals restart at zero."""
        return {
            "step": self.step,
            "round_start": list(self.round_start),
            "outer": [o.state_dict() for o in self.outer],
            "own": {str(p): t for p, t in self.own.items()},
            "silent": sorted(self.silent),
        }

    def load_carried_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        with torch.no_grad():
            for anchor, value in zip(self.round_start, state["round_start"]):
                anchor.copy_(value)
        for optimizer, saved in zip(self.outer, state["outer"]):
            optimizer.load_state_dict(saved)
        self.own = {int(p): t for p, t in state["own"].items()}
        self.silent = {int(p) for p in state["silent"]}

    def received(self) -> None:
        """The pseudo-gradients not yet applied that came with the state are the sender's: their exchanges (retried
        after the change) get zeros from this rank, uncounted, as from one that sat the round out."""
        self.own = {p: torch.zeros_like(own) for p, own in self.own.items()}
        self.silent |= set(self.own)

    def replicated_tensors(self) -> list[torch.Tensor]:
        return list(self.round_start)

    # --- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        pending = [self._result(p) if self.pending[p] is not None else None for p in range(self.config.fragments)]
        self.pending = list(pending)
        return {
            "step": self.step,
            "round_start": [t.detach().clone() for t in self.round_start],
            "outer": [o.state_dict() for o in self.outer],
            "pending": [t.clone() if t is not None else torch.zeros(0) for t in pending],
            "residuals": [t.clone() for t in self.residuals],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        name = self.config.name
        self.step = load_step(state, name)
        saved = state.get("round_start")
        expected = [(tuple(t.shape), t.dtype) for t in self.round_start]
        if not isinstance(saved, (list, tuple)) or [(tuple(t.shape), t.dtype) for t in saved] != expected:
            raise ValueError(f"{name}: the checkpoint's round_start does not match this model's parameters")
        outer, pending = state.get("outer"), state.get("pending")
        fragments = self.config.fragments
        if (
            not isinstance(outer, (list, tuple))
            or not isinstance(pending, (list, tuple))
            or (len(outer) != fragments or len(pending) != fragments)
        ):
            raise ValueError(
                f"{name}: the checkpoint needs 'outer' and 'pending' for each of the {fragments} fragments"
            )
        with torch.no_grad():
            for anchor, value in zip(self.round_start, saved):
                anchor.copy_(value)
        for optimizer, saved_outer in zip(self.outer, outer):
            optimizer.load_state_dict(saved_outer)
        residuals = check_tensor_list(state, "residuals", [t.numel() for t in self.residuals], name)
        self.residuals = [t.to(self.context.device) for t in residuals]
        self.pending = [t.to(self.context.device) if t.numel() else None for t in pending]

    def close(self) -> None:
        try:
            super().close()
        finally:
            if self.comm is not self.world and isinstance(self.comm, NativeCommunicator):
                self.comm.close()

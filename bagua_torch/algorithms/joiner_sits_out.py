"""A fault-tolerant job's rules for the algorithms whose replicas differ between averagings
(:class:`JoinerSitsOutOneStep`): a joiner sits out one step while its state travels, and a rank one step behind the
others at a change takes that step by itself."""

from __future__ import annotations

from typing import Any

from bagua_torch.algorithms.base import AlgorithmImpl

__all__ = ["JoinerSitsOutOneStep"]


class JoinerSitsOutOneStep(AlgorithmImpl):
    """What the algorithms whose replicas differ between averagings (decentralized, low-precision decentralized,
    asynchronous averaging) do when a fault-tolerant job admits a rank: it sits out the step after its admission
    while its state (the first member's weights and optimizer state) travels, and the members train that step
    without exchanging (the joiner has no weights to exchange yet), so that none waits for the transfer; and when a
    rank's step failed where the others' completed, it takes that step by itself (:meth:`step_alone`). Counts
    ``step`` (iterations), ``_step_in_flight`` (the one its vote is for) and ``_committed_step`` (what a change
    carries)."""

    step: int
    _step_in_flight: int
    _committed_step: int
    _exchanges_from: int = 0

    def steps_to_next_exchange(self) -> int:
        """One: a rank given the state sits out the next step, and exchanges from the step after with the weights it
        was given."""
        return 1

    def sit_out(self, steps: int) -> None:
        """Count ``steps`` steps this rank did not train (it votes for them: each is a transaction)."""
        self._step_in_flight = self.step + steps - 1
        self.step += steps

    def others_sit_out(self, steps: int) -> None:
        """Exchange nothing in the next ``steps`` steps: a rank sitting them out has no weights to exchange yet."""
        self._exchanges_from = self.step + steps

    def step_alone(self) -> None:
        """Make the next iteration the one after the last committed, exchanging nothing: the step this rank takes by
        itself, its optimizer stepping the gradients it holds (:class:`bagua_torch.fault_tolerance.FaultTolerance`; an
        attempt that failed may have counted it already)."""
        self.step = self._committed_step
        self._exchanges_from = self.step + 1

    def exchanges_now(self) -> bool:
        """Whether this iteration exchanges weights: a communicating one (the same counter on every rank) that no
        member given the state sits out."""
        return self.step % self.config.communication_interval == 0 and self.step >= self._exchanges_from

    def on_commit(self) -> None:
        self._committed_step = self._step_in_flight + 1

    def carried_state(self) -> dict[str, Any]:
        return {"step": self._committed_step}

    def load_carried_state(self, state: dict[str, Any]) -> None:
        self.step = self._committed_step = int(state["step"])

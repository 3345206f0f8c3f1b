"""AsyncModelAverage: local steps, with the weights averaged in the background.

During the first ``warmup_steps`` steps the gradients are allreduce-averaged exactly as
by :mod:`~bagua_torch.algorithms.gradient_allreduce`, so every rank starts from the same
model. After warm-up every rank steps on its own gradients (``need_gradient_hooks`` is
False: nothing is communicated in the backward pass), and a background thread averages
the weights with all ranks without ever making the training loop wait (SPEC section 3).
A round:

1. after an optimizer step, the training thread hands the thread a copy ``s`` of the
   weights (one float32 flat tensor per bucket), when the thread asks for one;
2. the thread allreduces a stop flag (one int32, MAX), so that every rank agrees whether
   this round happens (see :meth:`AsyncModelAverageImpl.abort`), then allreduce-sums
   ``s`` bucket by bucket, on a communicator of its own;
3. after a later optimizer step (the first one after the round finished), the training
   thread applies ``x += sum / n - s`` (:func:`bagua_torch.ops.async_average`, in
   float32, rounded once to the parameters' dtype), which moves ``x`` by exactly the
   correction that would have turned ``s`` into the average: the local progress made
   while the round was on the wire is kept.

The next round starts no sooner than ``sync_interval_ms`` after the previous one finished
and only once its correction has been applied (a snapshot taken before the correction
would count it twice). This is the design of
:class:`bagua_jax.algorithms.async_model_average.AsyncModelAverager`, with the same
update kernel; in PyTorch it is driven by the wrapper's step hooks, so the optimizers must
be given to the wrapper::

    model = bagua_torch.with_bagua(model, [optimizer], AsyncModelAverageAlgorithm(sync_interval_ms=100,
                                                                                  warmup_steps=50))
    for x, y in data:
        optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()
    model.algorithm_impl.abort()  # on every rank, before the process exits (close() does it too)

The rounds run on a dedicated communicator created collectively when the model is wrapped:
a new ``torch.distributed`` process group of the world's ranks when ``world`` is a
:class:`~bagua_torch.ProcessGroupCommunicator`, or ``world.split(...)`` (a duplicate of
the same ranks) when it is a :class:`~bagua_torch.NativeCommunicator`. Its collectives thus
never interleave with the wrapper's, whose order on each rank differs from the thread's.

Rounds need every rank: a rank's thread enters round ``k`` only once that rank's loop has
stepped (or aborted), and the communicator's timeout bounds each wait of the thread, so
ranks that stop stepping for longer (a long evaluation) make the others' rounds fail, and
their next step raises the error. Call ``abort()``/``resume()`` the same number of times on
every rank.

In a fault-tolerant job a change of members stops the rounds and drops one not yet applied;
the model rebuilt for the new members starts them again over those. Its steps vote one
ahead, and after the warm-up a joiner sits out one step while its state travels
(:class:`~bagua_torch.algorithms.joiner_sits_out.JoinerSitsOutOneStep`;
``docs/guides/fault_tolerance.md``, "Asynchronous averaging").
"""

from __future__ import annotations

from typing import Any

import torch

from bagua_common.algorithms.averaging_rounds import AveragingRounds, RoundsControl
from bagua_common.algorithms.configs import AsyncModelAverageConfig
from bagua_torch import ops
from bagua_torch.algorithms.base import Algorithm, AlgorithmContext, Bucket, check_dtypes, implements
from bagua_torch.algorithms.joiner_sits_out import JoinerSitsOutOneStep
from bagua_torch.communicator import NativeCommunicator, Work, dedicated_communicator


@implements(AsyncModelAverageConfig)
class AsyncModelAverageAlgorithm(Algorithm):
    """Gradient allreduce for ``warmup_steps`` steps, then local steps while a background thread averages
    the weights with all ranks every ``sync_interval_ms`` milliseconds (see the module docstring).

    Per round: one float32 allreduce of the model (for float16/bfloat16 weights twice their
    bytes) plus a 4-byte flag, none of it inside the training step. Choose it when ranks run
    at uneven speeds or the network is slow enough that any per-step synchronization stalls
    training, and slightly diverging replicas are acceptable. Parameters must be float32,
    float16 or bfloat16, and the optimizers must be passed to the wrapper (the rounds are
    applied in their step hooks). Stop the rounds with ``model.algorithm_impl.abort()`` (or
    ``model.close()``) on every rank; ``resume()`` restarts them.
    """

    fault_tolerant = True

    def reify(self, context: AlgorithmContext) -> AsyncModelAverageImpl:
        return AsyncModelAverageImpl(context, self.config)


class AsyncModelAverageImpl(RoundsControl, JoinerSitsOutOneStep):
    """AsyncModelAverage on one wrapped model; its state is ``{"steps": int}`` (optimizer steps done).

    Public beyond the hooks: :meth:`abort`, :meth:`resume`, :attr:`rounds` (rounds completed),
    :attr:`running` (whether the thread is alive), :attr:`steps`, :attr:`comm` (the rounds'
    communicator).
    """

    def __init__(self, context: AlgorithmContext, config: AsyncModelAverageConfig):
        super().__init__(context)
        name = config.name
        check_dtypes(context.buckets, ops.KERNEL_FLOATS, name, "asynchronous averaging takes")
        if not context.optimizers:
            raise ValueError(
                f"{name}: pass the optimizers to the wrapper (with_bagua(model, [optimizer], 'async')); the weights "
                "are averaged in their step hooks"
            )
        self.config = config
        self._ticker = context.optimizers[-1]  # a step ends when the last wrapped optimizer has stepped
        self.comm = dedicated_communicator(self.world, "async")
        self._size = self.world.size
        self._protocol = AveragingRounds(
            name,
            config.sync_interval_ms / 1000.0,
            config.warmup_steps,
            0,
            take_snapshot=self._take_snapshot,
            agree_to_stop=self._agree_to_stop,
            allreduce_sum=self._allreduce_sum,
            apply=self._apply_round,
        )
        self._step_in_flight = self._committed_step = 0

    # --- what the wrapper reads ---------------------------------------------------------

    @property
    def need_gradient_hooks(self) -> bool:  # type: ignore[override]
        """Gradient allreduce while in warm-up (same step counter on every rank), local gradients after."""
        return self._protocol.in_warmup

    def reduce_bucket(self, bucket: Bucket) -> Work:
        return self.world.allreduce_async(bucket.grad, "avg")

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is self._ticker:
            self._step_in_flight = self._protocol.steps

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is self._ticker:
            self._protocol.after_step()

    # --- the four parts of a round --------------------------------------------------------

    def _take_snapshot(self) -> list[torch.Tensor] | tuple[list[torch.Tensor], torch.cuda.Event]:
        """The weights as fresh float32 flat tensors, one per bucket (training thread)."""
        snapshot = [bucket.flatten_params().to(torch.float32) for bucket in self.buckets]
        if snapshot and snapshot[0].is_cuda:  # the thread waits for the copies (not this thread)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(snapshot[0].device))
            return snapshot, event
        return snapshot

    def _apply_round(self, sums: list[torch.Tensor], snapshot: list[torch.Tensor]) -> None:
        for bucket, total, s in zip(self.buckets, sums, snapshot):
            x = bucket.flatten_params().to(torch.float32)
            bucket.unflatten_to_params(ops.async_average(x, total, s, self._size))

    def _agree_to_stop(self, stop: bool) -> bool:
        device = self.context.device
        if device.type == "cuda":
            torch.cuda.set_device(device)  # the rounds' thread works on the model's device
        flag = torch.full((1,), int(stop), dtype=torch.int32, device=device)
        return bool(self.comm.allreduce(flag, "max").item())

    def _allreduce_sum(
        self, snapshot: list[torch.Tensor] | tuple[list[torch.Tensor], torch.cuda.Event]
    ) -> list[torch.Tensor]:
        if isinstance(snapshot, tuple):
            snapshot, event = snapshot
            event.synchronize()
        sums = [self.comm.allreduce(s, "sum") for s in snapshot]
        if self.context.device.type == "cuda":
            torch.cuda.current_stream(self.context.device).synchronize()  # sums complete before handed over
        return sums

    # --- fault tolerance: the step count carries; the rounds start again on the new members' communicator

    @property
    def step(self) -> int:
        """The steps counted (:class:`JoinerSitsOutOneStep`'s counter: the rounds' own)."""
        return self._protocol.steps

    @step.setter
    def step(self, steps: int) -> None:
        self._protocol.restore_steps(steps)

    def steps_to_next_exchange(self) -> int | None:
        """During warm-up None (a joiner's state arrives before its first gradient allreduce, its peers waiting),
        after it one: a rank given the state sits out the next step while it travels, its peers stepping on as
        always, and averages from the step after."""
        return None if self._protocol.in_warmup else 1

    def step_alone(self) -> None:
        """Stop the rounds of the members that changed (a round finished but not yet applied is dropped), then count
        the step this rank takes by itself."""
        self.abandon()
        super().step_alone()

    # --- checkpoints and lifetime ---------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self._protocol.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        steps = state.get("steps") if isinstance(state, dict) else None
        valid = isinstance(state, dict) and set(state) == {"steps"}
        if not valid or isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"async: the checkpoint must hold {{'steps': int >= 0}}, got {state!r}")
        self._protocol.restore_steps(steps)

    def close(self) -> None:
        try:
            self.abort()
        finally:
            if isinstance(self.comm, NativeCommunicator):
                self.comm.close()
            super().close()

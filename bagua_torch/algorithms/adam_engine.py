"""The Adam engine shared by QAdam and 1-bit Adam: Adam whose momentum, not its gradients, is averaged after a
warm-up.

Two objects work together, as in Bagua: an optimizer (:class:`AdamWithAveragedMomentum`: Adam's
state and the parameter update) and an algorithm (:class:`AdamWithAveragedMomentumAlgorithm`:
the communication), built on it. What a step does (``t`` = the optimizer's ``step_id``, the
number of steps taken so far, identical on every rank, decides the phase):

* warm-up, ``t < warmup_steps``: the wrapper averages the gradients in full precision in the
  backward pass (:meth:`AdamWithAveragedMomentumImpl.reduce_bucket`, an average allreduce per
  bucket; with ``hierarchical`` and two levels the same reduce-scatter / allreduce / allgather
  as :class:`~bagua_torch.algorithms.GradientAllReduceAlgorithm`), and the optimizer is plain
  Adam on them with exactly the arithmetic of ``torch.optim.Adam(foreach=False)``
  (``_single_tensor_adam``: ``exp_avg.lerp_(g, 1-b1)``,
  ``exp_avg_sq.mul_(b2).addcmul_(g, g, value=1-b2)``, ``bc_i = 1 - b_i**t``,
  ``denom = (exp_avg_sq.sqrt() / sqrt(bc2)).add_(eps)``,
  ``p.addcdiv_(exp_avg, denom, value=-lr/bc1)``), so its results are bit-identical to
  ``torch.optim.Adam`` fed the same averaged gradients.
* after it: the second moment ``v`` (``exp_avg_sq``) is frozen and the backward pass does
  not communicate (``need_gradient_hooks`` is False, ``.grad`` stays local). In the step's
  pre-hook (:meth:`AdamWithAveragedMomentumImpl.before_step`) each rank folds its local
  gradient into the momentum, ``exp_avg.lerp_(g_local, 1-b1)`` (``m = b1 m + (1-b1) g``, with
  torch Adam's operation), then bucket by bucket (in launch order) the momentum is flattened,
  padded to a multiple of the world size, averaged by the algorithm's exchange
  (:meth:`~AdamWithAveragedMomentumImpl.average_momentum`: QAdam's 8-bit codes, 1-bit Adam's
  signs) and written back: every rank ends with the same momentum bits. The optimizer then
  applies ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)`` with torch Adam's operations and the
  frozen ``v`` floored per parameter,
  ``v = exp_avg_sq.clamp(min=VARIANCE_FLOOR * exp_avg_sq.mean())``
  (:mod:`bagua_common.algorithms.frozen_variance`): a coordinate whose ``v`` froze at zero (a
  dead unit, an embedding row unseen in the warm-up) but whose averaged momentum is not zero
  would otherwise step by ``m / eps`` and diverge. Unless ``step_bound`` is None (Bagua's
  formula), ``bc2`` is that of the warm-up's last step, ``1 - b2**warmup_steps``, the count ``v``
  stopped at (:attr:`~bagua_common.algorithms.configs.QAdamConfig.frozen_variance_count`), and the direction
  ``(m/bc1) / denom`` is clipped per coordinate to ``[-step_bound, step_bound]``
  (:data:`~bagua_common.algorithms.frozen_variance.STEP_BOUND`).

Each front end matches its own framework's Adam: this one ``torch.optim.Adam``'s
arithmetic, :mod:`bagua_jax.algorithms.adam_engine` ``optax.adam``'s (whose formula shape,
``(m/bc1) / (sqrt(v/bc2) + eps)``, is equal in exact arithmetic and may differ by a
rounding in float32). The schedule, buckets and compression pipelines are the same.

State: ``optimizer.state_dict()`` holds ``exp_avg``, ``exp_avg_sq`` and ``step`` per
parameter (torch Adam's layout) and ``step_id``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, ClassVar

import torch

from bagua_common.algorithms.configs import QAdamConfig
from bagua_common.algorithms.frozen_variance import NEGLIGIBLE_VARIANCE, STEP_BOUND, VARIANCE_FLOOR
from bagua_torch import ops
from bagua_torch.algorithms.base import Algorithm, AlgorithmContext, AlgorithmImpl, Bucket, check_dtypes
from bagua_torch.communicator import Work


class AdamWithAveragedMomentum(torch.optim.Optimizer):
    """Adam for ``warmup_steps`` steps, then Adam with a frozen second moment and a momentum that the
    algorithm averages across ranks before each step (shared by QAdam and 1-bit Adam)."""

    _algorithm_name: ClassVar[str] = ""
    _config_class: ClassVar[type[QAdamConfig]] = QAdamConfig
    local_momentum_fallback: ClassVar[bool] = False
    """After the warm-up, a step whose momentum no algorithm averaged folds the local gradient into it (Bagua's
    spelling, for a model switched to another algorithm) instead of raising."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        warmup_steps: int = 100,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        step_bound: float | None = STEP_BOUND,
    ):
        name = self._config_class.name
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{name}: betas must be a pair of floats, got {betas!r}")
        self.config = self._config_class(lr, warmup_steps, betas[0], betas[1], eps, step_bound=step_bound)
        """The hyperparameters as the shared configuration (validated there, as in bagua_jax)."""
        self.warmup_steps = warmup_steps
        self.step_id = 0
        """Steps taken so far; identical on every rank, it selects the phase (warm-up while < warmup_steps)."""
        self._momentum_ready = False
        defaults = {"lr": float(lr), "betas": (float(betas[0]), float(betas[1])), "eps": float(eps)}
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if not p.dtype.is_floating_point or p.is_complex():
                    raise TypeError(
                        f"{type(self).__name__}: parameters must be real floating-point tensors, got {p.dtype}"
                    )

    @property
    def in_warmup(self) -> bool:
        """Whether the next step is a warm-up step (plain Adam on averaged gradients)."""
        return self.step_id < self.warmup_steps

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if len(state) == 0:  # as torch.optim.Adam (a float32 step tensor, zeros of the parameter's layout)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def local_momentum(self) -> None:
        """After the warm-up: fold each parameter's local gradient (zeros where None) into its momentum,
        ``exp_avg.lerp_(grad, 1 - b1)``. Called by the algorithm before it averages the momentum."""
        for group in self.param_groups:
            beta1 = group["betas"][0]
            for p in group["params"]:
                exp_avg = self._state(p)["exp_avg"]
                exp_avg.lerp_(self._gradient(p, group), 1 - beta1)

    def _gradient(self, p: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """The gradient the moments take in: ``p.grad`` (zeros where None)."""
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def momentum(self, p: torch.Tensor) -> torch.Tensor:
        """The live momentum (``exp_avg``) of parameter ``p``."""
        return self._state(p)["exp_avg"]

    def unused(self) -> dict[torch.Tensor, torch.Tensor]:
        """Per parameter, whether its second moment is negligible (0-d bool tensors, so no step waits on the device):
        its mean below ``NEGLIGIBLE_VARIANCE`` times the whole model's (zero throughout included). After the warm-up,
        a parameter that had no gradient in it, or only rounding (see
        :data:`~bagua_common.algorithms.frozen_variance.NEGLIGIBLE_VARIANCE`)."""
        params = [p for group in self.param_groups for p in group["params"]]
        sums = {p: self._state(p)["exp_avg_sq"].sum(dtype=torch.float32) for p in params}
        device = params[0].device
        overall = sum(total.to(device) for total in sums.values()) / max(sum(p.numel() for p in params), 1)
        return {p: total <= NEGLIGIBLE_VARIANCE * overall.to(total.device) * p.numel() for p, total in sums.items()}

    def mark_momentum_averaged(self) -> None:
        """Called by the algorithm once the momentum of every parameter holds this step's average."""
        self._momentum_ready = True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step: torch Adam's (``foreach=False``) during the warm-up, the frozen-``v`` update after it."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        warmup = self.in_warmup
        if not warmup and not self._momentum_ready and self.local_momentum_fallback:
            self.local_momentum()
        elif not warmup and not self._momentum_ready:
            name = type(self).__name__
            raise RuntimeError(
                f"{name}: after its {self.warmup_steps} warm-up steps the momentum must be averaged across ranks "
                f"before each step; wrap the model with bagua_torch.with_bagua(model, [optimizer], "
                f"{self._algorithm_name}(optimizer)) and step this optimizer after each backward pass"
            )
        floors = None if warmup else self._variance_floors()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps = group["lr"], group["eps"]
            for p in group["params"]:
                if warmup and p.grad is None:
                    continue  # as torch.optim.Adam
                state = self._state(p)
                exp_avg, exp_avg_sq, step_t = state["exp_avg"], state["exp_avg_sq"], state["step"]
                step_t += 1
                if warmup:
                    if p.grad.is_sparse:
                        raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                    grad = self._gradient(p, group)
                    exp_avg.lerp_(grad, 1 - beta1)
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                # else: exp_avg is the averaged momentum the algorithm wrote, exp_avg_sq is frozen.
                step = step_t.item()
                bias_correction1 = 1 - beta1**step
                # The warm-up is torch Adam's; after it the frozen v is corrected by its own count and the step bounded
                # (bagua_common.algorithms.frozen_variance), both unless this is Bagua's formula (step_bound=None).
                frozen = None if warmup else self.config.frozen_variance_count
                variance_count = step if frozen is None else frozen
                step_bound = None if warmup else self.config.step_bound
                bias_correction2 = 1 - beta2**variance_count
                step_size = lr / bias_correction1
                bias_correction2_sqrt = bias_correction2**0.5
                # After the warm-up the frozen v is floored (bagua_common.algorithms.frozen_variance).
                variance = exp_avg_sq if warmup else exp_avg_sq.clamp(min=floors[p])
                denom = (variance.sqrt() / bias_correction2_sqrt).add_(eps)
                if step_bound is None:
                    p.addcdiv_(exp_avg, denom, value=-step_size)
                else:  # the direction (exp_avg / bc1) / denom clipped to the bound (frozen_variance.STEP_BOUND)
                    bound = step_bound * bias_correction1
                    p.add_((exp_avg / denom).clamp_(-bound, bound), alpha=-step_size)
        self.step_id += 1
        self._momentum_ready = False
        return loss

    def _variance_floors(self) -> dict[torch.Tensor, torch.Tensor]:
        """Per parameter, the floor under its frozen second moment (see
        :mod:`bagua_common.algorithms.frozen_variance`): ``VARIANCE_FLOOR`` times the mean of its
        ``exp_avg_sq``, or of the whole model's where its own is zero (float32 scalars on the
        parameter's device, so that no step waits on the device)."""
        params = [p for group in self.param_groups for p in group["params"]]
        # sum / numel, not mean(): an empty parameter's mean would be NaN.
        means = {p: self._state(p)["exp_avg_sq"].sum(dtype=torch.float32) / max(p.numel(), 1) for p in params}
        total = max(sum(p.numel() for p in params), 1)
        device = params[0].device
        overall = sum((means[p] * p.numel()).to(device) for p in params) / total
        return {p: VARIANCE_FLOOR * torch.where(mean > 0, mean, overall.to(mean.device)) for p, mean in means.items()}

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict (per parameter ``step``, ``exp_avg``, ``exp_avg_sq``) plus ``step_id``
        and ``warmup_steps``."""
        state = super().state_dict()
        state["step_id"] = self.step_id
        state["warmup_steps"] = self.warmup_steps
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        name = type(self).__name__
        if not isinstance(state_dict, dict) or "step_id" not in state_dict:
            raise ValueError(f"{name}.load_state_dict: the state dict has no 'step_id'; was it saved by a {name}?")
        state_dict = dict(state_dict)
        step_id = state_dict.pop("step_id")
        warmup_steps = state_dict.pop("warmup_steps", self.warmup_steps)
        if isinstance(step_id, bool) or not isinstance(step_id, int) or step_id < 0:
            raise ValueError(f"{name}.load_state_dict: step_id must be an int >= 0, got {step_id!r}")
        if warmup_steps != self.warmup_steps:
            raise ValueError(
                f"{name}.load_state_dict: the checkpoint was saved with warmup_steps={warmup_steps}, this optimizer "
                f"has warmup_steps={self.warmup_steps}"
            )
        super().load_state_dict(state_dict)
        self.step_id = step_id
        self._momentum_ready = False

    def __repr__(self) -> str:
        return (
            super()
            .__repr__()
            .replace(type(self).__name__ + " (", f"{type(self).__name__} (warmup_steps={self.warmup_steps},", 1)
        )


def check_optimizer(optimizer: Any, cls: type, name: str, algorithm: str) -> None:
    """Raise a clear TypeError unless ``optimizer`` is a ``cls`` (the algorithm's own optimizer)."""
    if optimizer is None:
        raise TypeError(
            f"{name} needs its {cls.__name__}: {algorithm}(optimizer) or get_algorithm({name!r}, optimizer=optimizer) "
            f"(the optimizer is both the algorithm's Adam state and the one passed to with_bagua)"
        )
    if not isinstance(optimizer, cls):
        raise TypeError(f"{name}: the optimizer must be a bagua_torch {cls.__name__}, got {type(optimizer).__name__}")


class AdamWithAveragedMomentumAlgorithm(Algorithm):
    """The algorithm of an :class:`AdamWithAveragedMomentum` optimizer: it holds the optimizer and the shared
    configuration, the optimizer's hyperparameters with this algorithm's ``hierarchical``."""

    optimizer_class: ClassVar[type[AdamWithAveragedMomentum]]
    impl_class: ClassVar[type[AdamWithAveragedMomentumImpl]]

    def __init__(self, optimizer: AdamWithAveragedMomentum | None = None, hierarchical: bool = True):
        check_optimizer(optimizer, self.optimizer_class, self.name, type(self).__name__)
        self.optimizer = optimizer
        super().__init__(replace(optimizer.config, hierarchical=hierarchical))

    def reify(self, context: AlgorithmContext) -> AdamWithAveragedMomentumImpl:
        return self.impl_class(context, self)


class AdamWithAveragedMomentumImpl(AlgorithmImpl):
    """An Adam-engine algorithm on one wrapped model: gradient allreduce during the warm-up, momentum averaged by
    :meth:`average_momentum` in :meth:`before_step` after it. The phase is the optimizer's ``step_id``."""

    def __init__(self, context: AlgorithmContext, algorithm: AdamWithAveragedMomentumAlgorithm):
        super().__init__(context)
        config = algorithm.config
        name = config.name
        self.config = config
        self.optimizer = algorithm.optimizer
        check_dtypes(context.buckets, ops.KERNEL_FLOATS, name, "the momentum is compressed in")
        if not any(opt is self.optimizer for opt in context.optimizers):
            raise ValueError(
                f"{name}: its optimizer is not among the optimizers given to the wrapper; pass it too: "
                f"with_bagua(model, [optimizer], algorithm), so that its steps are hooked"
            )
        ours = {id(p) for bucket in context.buckets for p in bucket.params}
        theirs = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        if ours != theirs:
            raise ValueError(
                f"{name}: the optimizer must hold exactly the wrapped model's trainable parameters "
                f"({len(ours)} tensors; the optimizer holds {len(theirs)}, {len(theirs & ours)} of them the model's)"
            )
        self.levels = context.communicators.levels(config.hierarchical, name)
        for bucket in context.buckets:
            if bucket.size % self.world.size:
                raise ValueError(
                    f"{name}: bucket {bucket.index} has {bucket.size} elements, not a multiple of the "
                    f"world size {self.world.size}"
                )

    # --- fault tolerance: the optimizer keeps the moments; a joiner is given the phase (the step count) before its
    # first step, whose gradients (in the warm-up) or momentum (after it) it is weighed out of where the exchange
    # carries its zeros exactly (weighed_out_scale)

    def carried_state(self) -> dict[str, Any]:
        return {"step_id": self.optimizer.step_id}

    def load_carried_state(self, state: dict[str, Any]) -> None:
        self.optimizer.step_id = int(state["step_id"])

    @property
    def need_gradient_hooks(self) -> bool:  # type: ignore[override]
        """Gradients are averaged in the backward pass during the warm-up only."""
        return self.optimizer.in_warmup

    # --- warm-up: full-precision average of the gradients, as GradientAllReduce ----------

    def reduce_bucket(self, bucket: Bucket) -> Work:
        return self.allreduce_async(bucket.grad, self.levels, "avg")

    # --- after the warm-up: average the momentum before the step ------------------------

    hold_unused: ClassVar[bool] = False
    """Whether the momentum is held at zero, before and after the exchange, for every parameter whose frozen second
    moment is negligible (no gradient in the whole warm-up, or only rounding: :meth:`AdamWithAveragedMomentum.unused`):
    for an exchange that cannot send a zero (1-bit signs), so that those parameters never move."""

    def average_momentum(self, bucket: Bucket, flat: torch.Tensor, scale: float) -> torch.Tensor:
        """Average one bucket of momentum (padded, this rank's) over all ranks, times ``scale`` (1, or a fault-tolerant
        step's weighing: :meth:`weighed_out_scale`); returns a new tensor."""
        raise NotImplementedError(f"{type(self).__name__} must implement average_momentum()")

    def weighed_out_scale(self, trainers: int) -> float:
        # A joiner's zeros cross the exchange exactly, in either phase: the warm-up's gradients in full precision, and
        # after it the momentum, whose chunks of zeros have lo = hi = 0 (8-bit codes) or a scale of 0 (1-bit signs).
        return self.mean_over(trainers)

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is not self.optimizer or self.optimizer.in_warmup:
            return
        # A step joiners are weighed out of: the reducer, which does not run after the warm-up, leaves it to this.
        weighed_out, self.weighed_out = self.weighed_out, None
        # Fault tolerance: the momentum of the last commit, restored if this step does not commit.
        committed = None
        if self.fault_tolerance is not None:
            committed = [m.clone() for bucket in self.buckets for m in map(self.optimizer.momentum, bucket.params)]
        try:
            self.optimizer.local_momentum()
            with torch.no_grad():
                still = self.optimizer.unused() if self.hold_unused else {}
                averages = []
                for bucket in self.buckets:  # launch order, identical on every rank
                    flat = torch.zeros(bucket.size, dtype=bucket.dtype, device=bucket.device)
                    momenta = [self.optimizer.momentum(p) for p in bucket.params]
                    held = [still[p] for p in bucket.params] if self.hold_unused else []
                    for m, unused in zip(momenta, held):
                        m.masked_fill_(unused, 0)
                    if weighed_out is None or weighed_out.contributes:
                        for view, m in zip(bucket.views(flat), momenta):
                            view.copy_(m)
                    averages.append(
                        self.average_momentum(bucket, flat, 1.0 if weighed_out is None else weighed_out.scale)
                    )
                self.commit()
                if self.hold_unused and weighed_out is not None and not weighed_out.contributes:
                    still = self.optimizer.unused()  # a joiner's: of the second moment that arrived in the commit
        except BaseException:
            if committed is not None:
                with torch.no_grad():
                    momenta = [self.optimizer.momentum(p) for bucket in self.buckets for p in bucket.params]
                    for m, saved in zip(momenta, committed):
                        m.copy_(saved)
            raise
        with torch.no_grad():
            for bucket, averaged in zip(self.buckets, averages):
                momenta = [self.optimizer.momentum(p) for p in bucket.params]
                for view, m in zip(bucket.views(averaged), momenta):
                    m.copy_(view)
                if self.hold_unused:
                    for m, p in zip(momenta, bucket.params):
                        m.masked_fill_(still[p], 0)
        self.optimizer.mark_momentum_averaged()

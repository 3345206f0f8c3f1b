"""QAdam: Adam whose momentum, not its gradients, is averaged with 8-bit codes after a warm-up.

Two objects work together, as in Bagua: the optimizer :class:`QAdamOptimizer` (holds
Adam's state and does the parameter update) and the algorithm :class:`QAdamAlgorithm`
(communicates), built on it: ``QAdamAlgorithm(optimizer)`` or, by name,
``get_algorithm("qadam", optimizer=optimizer)``. Wrap the model with both::

    opt = QAdamOptimizer(model.parameters(), lr=1e-3, warmup_steps=100)
    model = bagua_torch.with_bagua(model, [opt], QAdamAlgorithm(opt))

What a step does (``t`` = the optimizer's :attr:`~QAdamOptimizer.step_id`, the number
of steps taken so far, identical on every rank, decides the phase):

* warm-up, ``t < warmup_steps``: the wrapper averages the gradients in full precision
  in the backward pass (:meth:`QAdamImpl.reduce_bucket`, an average allreduce per bucket;
  with ``hierarchical`` and two levels the same reduce-scatter / allreduce / allgather as
  :class:`~bagua_torch.algorithms.GradientAllReduceAlgorithm`), and the optimizer is plain
  Adam on them with exactly the arithmetic of ``torch.optim.Adam(foreach=False)``
  (``_single_tensor_adam``: ``exp_avg.lerp_(g, 1-b1)``,
  ``exp_avg_sq.mul_(b2).addcmul_(g, g, value=1-b2)``, ``bc_i = 1 - b_i**t``,
  ``denom = (exp_avg_sq.sqrt() / sqrt(bc2)).add_(eps)``,
  ``p.addcdiv_(exp_avg, denom, value=-lr/bc1)``), so its results are bit-identical to
  ``torch.optim.Adam`` fed the same averaged gradients.
* after it: the second moment ``v`` (``exp_avg_sq``) is frozen and the backward pass does
  not communicate (``need_gradient_hooks`` is False, ``.grad`` stays local). In the step's
  pre-hook (:meth:`QAdamImpl.before_step`) each rank folds its local gradient into the
  momentum, ``exp_avg.lerp_(g_local, 1-b1)`` (``m = b1 m + (1-b1) g``, with torch
  Adam's operation), then bucket by bucket (in launch order) the momentum is flattened,
  padded to a multiple of the world size, averaged through the ByteGrad pipeline
  (:func:`bagua_common.algorithms.compressed_allreduce.CompressedAllreduce.minmax_allreduce`; hierarchical: full precision
  inside the node, compressed between nodes) and written back: every rank ends with the
  same momentum bits. The optimizer then applies ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``
  with torch Adam's operations and the frozen ``v`` floored per parameter,
  ``v = exp_avg_sq.clamp(min=VARIANCE_FLOOR * exp_avg_sq.mean())``
  (:mod:`bagua_common.algorithms.frozen_variance`): a coordinate whose ``v`` froze at zero (a dead
  unit, an embedding row unseen in the warm-up) but whose averaged momentum is not zero
  would otherwise step by ``m / eps`` and diverge.

Each front end matches its own framework's Adam: this one ``torch.optim.Adam``'s
arithmetic, :mod:`bagua_jax.algorithms.qadam` ``optax.adam``'s (whose formula shape,
``(m/bc1) / (sqrt(v/bc2) + eps)``, is equal in exact arithmetic and may differ by a
rounding in float32). The schedule, buckets and compression pipeline are the same.

State: ``optimizer.state_dict()`` holds ``exp_avg``, ``exp_avg_sq`` and ``step`` per
parameter (torch Adam's layout) and ``step_id``; QAdam's algorithm state is empty.
1-bit Adam (:mod:`bagua_torch.algorithms.onebit_adam`) shares this machinery and differs
only in how the momentum is averaged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch

from bagua_common.algorithms.configs import QAdamConfig
from bagua_common.algorithms.frozen_variance import VARIANCE_FLOOR
from bagua_torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    Bucket,
    check_dtypes,
    check_flags,
)
from bagua_torch.communicator import Work
from bagua_torch.compressed_allreduce import PIPELINES

COMPRESSIBLE = (torch.float32, torch.float16, torch.bfloat16)

__all__ = ["QAdamAlgorithm", "QAdamImpl", "QAdamOptimizer"]


# ============================================================================ the optimizer


class _AdamWithAveragedMomentum(torch.optim.Optimizer):
    """Adam for ``warmup_steps`` steps, then Adam with a frozen second moment and a momentum that the
    algorithm averages across ranks before each step (shared by QAdam and 1-bit Adam)."""

    _algorithm_name: ClassVar[str] = ""
    _config_class: ClassVar[type[QAdamConfig]] = QAdamConfig

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        warmup_steps: int = 100,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ):
        name = self._config_class.name
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{name}: betas must be a pair of floats, got {betas!r}")
        self.config = self._config_class(lr, warmup_steps, betas[0], betas[1], eps)
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
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                exp_avg.lerp_(grad, 1 - beta1)

    def momentum(self, p: torch.Tensor) -> torch.Tensor:
        """The live momentum (``exp_avg``) of parameter ``p``."""
        return self._state(p)["exp_avg"]

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
        if not warmup and not self._momentum_ready:
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
                    grad = p.grad
                    if grad.is_sparse:
                        raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                    exp_avg.lerp_(grad, 1 - beta1)
                    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                # else: exp_avg is the averaged momentum the algorithm wrote, exp_avg_sq is frozen.
                step = step_t.item()
                bias_correction1 = 1 - beta1**step
                bias_correction2 = 1 - beta2**step
                step_size = lr / bias_correction1
                bias_correction2_sqrt = bias_correction2**0.5
                # After the warm-up the frozen v is floored (bagua_common.algorithms.frozen_variance).
                variance = exp_avg_sq if warmup else exp_avg_sq.clamp(min=floors[p])
                denom = (variance.sqrt() / bias_correction2_sqrt).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)
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


class QAdamOptimizer(_AdamWithAveragedMomentum):
    """QAdam's optimizer: ``torch.optim.Adam`` (bit for bit, ``foreach=False``) for ``warmup_steps`` steps, then
    Adam with the second moment frozen and the momentum averaged across ranks by :class:`QAdamAlgorithm`.

    ``QAdamOptimizer(params, lr=1e-3, warmup_steps=100, betas=(0.9, 0.999), eps=1e-8)``. It must be given to the
    wrapper together with ``QAdamAlgorithm(optimizer)``; after the warm-up, stepping it without the algorithm
    raises a RuntimeError (the momentum would not be averaged). No weight decay, amsgrad or sparse gradients.
    """

    _algorithm_name = "QAdamAlgorithm"


# ============================================================================ the algorithm


def check_optimizer(optimizer: Any, cls: type, name: str, algorithm: str) -> None:
    """Raise a clear TypeError unless ``optimizer`` is a ``cls`` (the algorithm's own optimizer)."""
    if optimizer is None:
        raise TypeError(
            f"{name} needs its {cls.__name__}: {algorithm}(optimizer) or get_algorithm({name!r}, optimizer=optimizer) "
            f"(the optimizer is both the algorithm's Adam state and the one passed to with_bagua)"
        )
    if not isinstance(optimizer, cls):
        raise TypeError(f"{name}: the optimizer must be a bagua_torch {cls.__name__}, got {type(optimizer).__name__}")


@dataclass(frozen=True)
class QAdamAlgorithm(Algorithm):
    """QAdam (Bagua's ``QAdamAlgorithm``): Adam with gradients averaged in full precision during the warm-up
    (1x an fp32 allreduce per step), then with the second moment frozen and the momentum averaged through 8-bit
    min-max compression (~1/4 of an fp32 allreduce; with ``hierarchical`` and a job spanning several nodes, full
    precision inside the node and compressed only between nodes). Parameters must be float32, float16 or bfloat16.
    Choose it for Adam training whose gradient exchange is bandwidth-bound; keep the warm-up long enough for
    ``v`` to settle.
    """

    optimizer: QAdamOptimizer | None = None
    hierarchical: bool = True

    name: ClassVar[str] = QAdamConfig.name
    _optimizer_class: ClassVar[type] = QAdamOptimizer

    def __post_init__(self) -> None:
        check_optimizer(self.optimizer, self._optimizer_class, self.name, type(self).__name__)
        check_flags(self.name, hierarchical=self.hierarchical)

    @property
    def config(self) -> QAdamConfig:
        """The shared configuration: the optimizer's hyperparameters with this algorithm's ``hierarchical``."""
        return replace(self.optimizer.config, hierarchical=self.hierarchical)

    def reify(self, context: AlgorithmContext) -> QAdamImpl:
        return QAdamImpl(context, self)


class QAdamImpl(AlgorithmImpl):
    """QAdam on one wrapped model: gradient allreduce during the warm-up, compressed momentum averaging in
    :meth:`before_step` after it. Stateless (the phase is the optimizer's ``step_id``)."""

    def __init__(self, context: AlgorithmContext, config: QAdamAlgorithm):
        super().__init__(context)
        name = config.name
        self.config = config
        self.optimizer: _AdamWithAveragedMomentum = config.optimizer  # type: ignore[assignment]
        check_dtypes(context.buckets, COMPRESSIBLE, name, "the momentum is compressed in")
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

    @property
    def need_gradient_hooks(self) -> bool:  # type: ignore[override]
        """Gradients are averaged in the backward pass during the warm-up only."""
        return self.optimizer.in_warmup

    # --- warm-up: full-precision average of the gradients, as GradientAllReduce ----------

    def reduce_bucket(self, bucket: Bucket) -> Work:
        if self.levels is None:
            return self.world.allreduce_async(bucket.grad, "avg")
        intra, inter = self.levels
        flat = bucket.grad

        def two_level():
            mine = intra.reduce_scatter(flat.view(intra.size, -1), "avg")
            return intra.allgather(inter.allreduce(mine, "avg")).view(-1)

        return self.run_async(two_level)

    # --- after the warm-up: average the momentum before the step ------------------------

    def average_momentum(self, bucket: Bucket, flat: torch.Tensor) -> torch.Tensor:
        """Average one bucket of momentum (padded, this rank's) over all ranks; returns a new tensor."""
        return PIPELINES.minmax_over(flat, self.world, self.levels)[0]

    def before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer is not self.optimizer or self.optimizer.in_warmup:
            return
        self.optimizer.local_momentum()
        with torch.no_grad():
            for bucket in self.buckets:  # launch order, identical on every rank
                flat = torch.zeros(bucket.size, dtype=bucket.dtype, device=bucket.device)
                momenta = [self.optimizer.momentum(p) for p in bucket.params]
                for view, m in zip(bucket.views(flat), momenta):
                    view.copy_(m)
                averaged = self.average_momentum(bucket, flat)
                for view, m in zip(bucket.views(averaged), momenta):
                    m.copy_(view)
        self.optimizer.mark_momentum_averaged()

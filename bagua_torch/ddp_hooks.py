"""Bagua's gradient algorithms as communication hooks of torch's ``DistributedDataParallel``.

``ddp.register_comm_hook(state, bytegrad_hook)`` makes torch's own DDP (also as prepared by HF
Accelerate or Lightning's DDP strategy) average its buckets with ByteGrad, on the same kernels and
communicators as :func:`bagua_torch.with_bagua`; likewise :func:`gradient_allreduce_hook` (flat or
hierarchical) and :func:`powersgd_hook`. As in :mod:`torch.distributed.algorithms.ddp_comm_hooks`
there is one function per hook and a state object for what persists between steps::

    state = CommHookState("bytegrad", model, error_feedback=True)
    ddp.register_comm_hook(state, bytegrad_hook)
    ...
    torch.save({"model": ddp.state_dict(), "hook": state.state_dict()}, path)

The state lays each DDP bucket out as the wrapper lays out its buckets (parameters in reverse
registration order, zero-padded to a multiple of the world size) and runs the algorithm's own
implementation (:mod:`bagua_torch.algorithms`) on it, one implementation per DDP bucket; so a DDP
model whose parameters all fit in one bucket gets, bit for bit, the gradients of the wrapper with
one bucket. The buckets' jobs run on one thread, in DDP's launch order, so the collectives keep
one order on every rank while the backward pass goes on. Per-bucket state (ByteGrad's residuals,
PowerSGD's ``Q`` and residuals) is keyed by the bucket's parameter names: DDP's rebuild of its
buckets after the first step starts the state of a bucket whose members changed afresh, as
torch's PowerSGD hook does.

The weight-averaging algorithms (decentralized, async, QAdam, ...) do not transform gradients, so
they have no hook: use :func:`bagua_torch.with_bagua` or the Lightning strategy
(:mod:`bagua_torch.lightning`) for them.
"""

# No ``from __future__ import annotations``: DDP compares the hooks' annotations to the real classes.
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bagua_torch.algorithms import get_algorithm
from bagua_torch.algorithms.base import Algorithm, AlgorithmContext, AlgorithmImpl
from bagua_torch.bucketing import Bucket
from bagua_torch.job import communicators_from
from bagua_torch.ordered_worker import OrderedWorker

__all__ = ["HOOKS", "CommHookState", "bytegrad_hook", "gradient_allreduce_hook", "powersgd_hook"]

Hook = Callable[["CommHookState", dist.GradBucket], torch.futures.Future[torch.Tensor]]


class CommHookState:
    """What a Bagua communication hook keeps between steps: the algorithm, its communicators and per-bucket state.

    ``algorithm`` is a name (with keyword ``options``) or an :class:`~bagua_torch.algorithms.Algorithm`;
    ``module`` is the model DDP wraps (its parameter names and order lay the buckets out);
    ``process_group`` is what :func:`bagua_torch.with_bagua` accepts (None: the job's default, from
    :func:`bagua_torch.init_process_group` or ``torch.distributed``), so a hook runs over gloo, NCCL or the
    native MPI engine. :meth:`state_dict` / :meth:`load_state_dict` checkpoint the algorithm's state.
    """

    def __init__(self, algorithm: "str | Algorithm", module: nn.Module, process_group: Any = None, **options: Any):
        if not isinstance(module, nn.Module):
            raise TypeError(f"CommHookState: module must be the torch.nn.Module DDP wraps, got {type(module).__name__}")
        self.algorithm = get_algorithm(algorithm, **options)
        if self.algorithm.name not in HOOKS:
            raise ValueError(
                f"CommHookState: {self.algorithm.name!r} does not transform gradients, so it has no DDP hook "
                f"(hooks: {', '.join(HOOKS)}); train it with bagua_torch.with_bagua or bagua_torch.lightning"
            )
        self.module = module
        self.communicators = communicators_from(process_group)
        self._order = {id(p): (index, name) for index, (name, p) in enumerate(module.named_parameters())}
        device = next(module.parameters()).device
        world = self.communicators.world
        shared = getattr(world, "ordered_worker", None)  # a native communicator's own thread
        self._owns_worker = shared is None
        self.ordered_worker: OrderedWorker = shared or OrderedWorker("ddp-hook", device)
        self._impls: dict[tuple[str, ...], tuple[Bucket, AlgorithmImpl]] = {}
        self._pending: dict[str, dict[str, Any]] = {}

    def _impl_for(self, grad_bucket: dist.GradBucket) -> tuple[Bucket, AlgorithmImpl]:
        """The wrapper-style bucket and the algorithm's implementation for ``grad_bucket`` (built on first use)."""
        members = []
        for p in grad_bucket.parameters():
            if id(p) not in self._order:
                raise ValueError("CommHookState: DDP's bucket holds a parameter that is not the state's module's")
            members.append((self._order[id(p)], p))
        named = [(name, p) for (_, name), p in sorted(members, key=lambda m: -m[0][0])]
        key = tuple(name for name, _ in named)
        if key not in self._impls:
            bucket = Bucket(0, named, pad_to=self.communicators.world.size)
            context = AlgorithmContext(
                module=self.module,
                optimizers=(),
                communicators=self.communicators,
                buckets=(bucket,),
                named_parameters=tuple(named),
                device=bucket.device,
                bucket_bytes=bucket.nbytes,
                ordered_worker=self.ordered_worker,
            )
            impl = self.algorithm.reify(context)
            self._restore(key, impl)
            self._impls[key] = (bucket, impl)
        return self._impls[key]

    def _restore(self, key: tuple[str, ...], impl: AlgorithmImpl) -> None:
        saved = self._pending.pop(",".join(key), None)
        if saved is not None:
            impl.load_state_dict(saved)

    def state_dict(self) -> dict[str, Any]:
        """The algorithm's name and each bucket's state, keyed by its parameter names joined with commas."""
        self.ordered_worker.submit(lambda stream: None).wait()  # the last step's jobs have finished
        buckets = {",".join(key): impl.state_dict() for key, (_, impl) in self._impls.items()}
        return {"algorithm": self.algorithm.name, "buckets": {**self._pending, **buckets}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s result; each bucket's state is checked when DDP first hands that bucket."""
        if state.get("algorithm") != self.algorithm.name or not isinstance(state.get("buckets"), dict):
            raise ValueError(
                f"CommHookState: the checkpoint is of algorithm {state.get('algorithm')!r}, this state runs "
                f"{self.algorithm.name!r}"
            )
        self._pending = dict(state["buckets"])
        for key, (_, impl) in self._impls.items():
            self._restore(key, impl)

    def close(self) -> None:
        """Stop the implementations' threads (idempotent)."""
        for _, impl in self._impls.values():
            impl.close()
        if self._owns_worker:
            self.ordered_worker.close()


def _run(state: CommHookState, grad_bucket: dist.GradBucket, name: str) -> torch.futures.Future[torch.Tensor]:
    """Hand ``grad_bucket`` to the state's algorithm; the future holds DDP's buffer with the reduced gradients."""
    if not isinstance(state, CommHookState) or state.algorithm.name != name:
        got = state.algorithm.name if isinstance(state, CommHookState) else type(state).__name__
        raise TypeError(f"{name}_hook needs a CommHookState of algorithm {name!r}, got {got!r}")
    bucket, impl = state._impl_for(grad_bucket)
    grads = dict(zip(map(id, grad_bucket.parameters()), grad_bucket.gradients()))
    flat = bucket.grad
    for view, p in zip(bucket.views(flat), bucket.params):
        view.copy_(grads[id(p)])
    flat[bucket.numel :].zero_()
    work = impl.reduce_bucket(bucket)
    reduced: torch.futures.Future = torch.futures.Future()

    def finish(stream: int) -> None:
        # Queued behind the bucket's own jobs on the same thread, so ``wait`` does not block the pipeline.
        try:
            reduced.set_result(work.wait())
        except Exception as error:  # the training thread re-raises it from DDP's wait
            reduced.set_exception(error)

    state.ordered_worker.submit(finish)

    def scatter(done: torch.futures.Future) -> torch.Tensor:
        result = bucket.grad if done.value() is None else done.value()
        for view, p in zip(bucket.views(result), bucket.params):
            grads[id(p)].copy_(view)
        return grad_bucket.buffer()

    return reduced.then(scatter)


def gradient_allreduce_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average (or sum) the bucket over the ranks in full precision, flat or hierarchical
    (:class:`~bagua_torch.algorithms.GradientAllReduceAlgorithm`)."""
    return _run(state, bucket, "gradient_allreduce")


def bytegrad_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket through 8-bit min-max codes, with or without error feedback
    (:class:`~bagua_torch.algorithms.ByteGradAlgorithm`)."""
    return _run(state, bucket, "bytegrad")


def powersgd_hook(state: CommHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket's matrices through rank-``r`` approximations, the rest exactly
    (:class:`~bagua_torch.algorithms.PowerSGDAlgorithm`)."""
    return _run(state, bucket, "powersgd")


HOOKS: dict[str, Hook] = {
    hook.__name__.removesuffix("_hook"): hook for hook in (gradient_allreduce_hook, bytegrad_hook, powersgd_hook)
}
"""Each algorithm that has a DDP hook, by registry name: ``ddp.register_comm_hook(state, HOOKS[name])``."""

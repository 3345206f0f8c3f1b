"""Bagua's algorithm interface (``bagua.torch_api.algorithms.base``), for algorithms written as its tutorial shows.

A custom algorithm is two classes, as in Bagua's "How to create a new algorithm": an
:class:`Algorithm` holding the options, whose ``reify(process_group)`` returns an
:class:`AlgorithmImpl` bound to the process group. The implementation describes, per bucket of
gradients, a pipeline of operations in ``init_operations(bagua_ddp, bucket)``:

* ``bucket.append_python_op(fn)``: ``fn(bucket_name)`` runs on the bucket's tensors
  (``bucket.tensors``: one view per parameter of the bucket's gradients, change them in place);
* ``bucket.append_centralized_synchronous_op(hierarchical=False, average=True,
  scattergather=False, compression=None)``: an allreduce of the bucket over the group, in full
  precision or, with ``compression="MinMaxUInt8"``, through ByteGrad's 8-bit pipeline;
* ``bucket.clear_ops()``.

The operations run while the backward pass goes on (as soon as a bucket's gradients are all
there, buckets in a fixed order), and their result becomes the parameters' ``.grad``. The
hooks ``init_forward_pre_hook(bagua_ddp)`` (called with the model's inputs),
``init_post_backward_hook(bagua_ddp)`` and ``init_post_optimizer_step_hook(bagua_ddp)``
(called with the optimizer) work as in Bagua, and ``need_reset()`` returning True before a
forward pass rebuilds the pipelines (``init_operations`` runs again on every bucket).

What Bagua let an algorithm change and this interface does not: which tensors are communicated
(``init_tensors``: always the gradients here), how they are grouped (``tensors_to_buckets``)
and the per-parameter backward hook (``init_backward_hook``); an implementation overriding one
of them is refused with a TypeError when the model is wrapped. Algorithms that need more
(weights, optimizer state) implement the project's own interface,
:mod:`bagua_torch.algorithms.base`, which every built-in algorithm uses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from bagua_common.algorithms.registry import AlgorithmRegistry, build_algorithm
from bagua_torch import compressed_allreduce
from bagua_torch.algorithms import base as project
from bagua_torch.algorithms import get_algorithm
from bagua_torch.bucketing import Bucket
from bagua_torch.communicator import Work
from bagua_torch.torch_api.communication.groups import group_of

__all__ = ["REGISTRY", "Algorithm", "AlgorithmImpl", "BaguaBucket", "as_project_algorithm", "implements"]

REGISTRY = AlgorithmRegistry("bagua_torch.torch_api")
"""The classes of Bagua's spelling (``bagua.torch_api.algorithms``), by configuration class and by name."""

implements = REGISTRY.implements
"""The class decorator that registers a class of Bagua's spelling against its shared configuration (see
:mod:`bagua_common.algorithms.registry`)."""

_FIXED_HOOKS = ("init_tensors", "tensors_to_buckets", "init_backward_hook")


class AlgorithmImpl:
    """A Bagua-style algorithm implementation (see the module docstring); subclasses call ``super().__init__``."""

    def __init__(self, process_group: Any):
        self.process_group = process_group

    def need_reset(self) -> bool:
        """Whether to run ``init_operations`` again on every bucket before the next forward pass."""
        return False

    def init_tensors(self, bagua_ddp: Any) -> Any:
        raise NotImplementedError("the communicated tensors are the gradients (see the module docstring)")

    def tensors_to_buckets(self, tensors: Any, do_flatten: bool) -> Any:
        raise NotImplementedError("buckets are built by the wrapper (see the module docstring)")

    def init_backward_hook(self, bagua_ddp: Any) -> Any:
        raise NotImplementedError("buckets are launched by the wrapper (see the module docstring)")

    def init_forward_pre_hook(self, bagua_ddp: Any) -> Callable[[Any], None]:
        """A function called with the model's inputs before each training forward pass."""
        return lambda inputs: None

    def init_post_backward_hook(self, bagua_ddp: Any) -> Callable[[], None]:
        """A function called once the buckets' operations have finished (gradients written)."""
        return lambda: None

    def init_post_optimizer_step_hook(self, bagua_ddp: Any) -> Callable[[torch.optim.Optimizer], None]:
        """A function called with each optimizer after its ``step()``."""
        return lambda optimizer: None

    def init_operations(self, bagua_ddp: Any, bucket: BaguaBucket) -> None:
        """Register the bucket's operations (default: an averaging allreduce, as gradient allreduce)."""
        bucket.append_centralized_synchronous_op(average=True)


class Algorithm:
    """A Bagua-style algorithm declaration: its options, and ``reify(process_group)`` returning its implementation."""

    @staticmethod
    def init(name: str, **kwargs: Any) -> Any:
        """Bagua's ``Algorithm.init(name, **kwargs)``: the registered algorithm ``name`` built with ``kwargs``."""
        if name not in REGISTRY.names():
            known = ", ".join(sorted(REGISTRY.names()))
            raise KeyError(f"'{name}' not found in registry. Available names: {known}")
        return build_algorithm(REGISTRY.by_name(name), kwargs)

    def reify(self, process_group: Any) -> AlgorithmImpl:
        raise NotImplementedError(f"{type(self).__name__} must implement reify(process_group)")


class BaguaBucket:
    """One bucket as a Bagua algorithm sees it: ``name``, ``tensors`` (gradient views) and its operation list."""

    def __init__(self, bucket: Bucket, group: Any):
        self.name = str(bucket.index)
        self._bucket = bucket
        self._group = group
        self._ops: list[Callable[[torch.Tensor], torch.Tensor]] = []
        self.tensors = bucket.views(bucket.grad)

    def clear_ops(self) -> BaguaBucket:
        """Remove every registered operation."""
        self._ops = []
        return self

    def append_python_op(self, python_function: Callable[[str], None], group: Any = None) -> BaguaBucket:
        """Run ``python_function(bucket_name)``; it changes ``self.tensors`` in place."""

        def run(flat: torch.Tensor) -> torch.Tensor:
            python_function(self.name)
            return flat

        self._ops.append(run)
        return self

    def append_centralized_synchronous_op(
        self,
        hierarchical: bool = False,
        average: bool = True,
        scattergather: bool = False,
        compression: str | None = None,
        group: Any = None,
    ) -> BaguaBucket:
        """Allreduce the bucket over the group (mean if ``average``), full precision or ``compression="MinMaxUInt8"``.

        ``hierarchical`` and ``scattergather`` select how Bagua's engine communicated; the result
        is the same, so they are accepted and the flat pipeline runs.
        """
        if compression not in (None, "MinMaxUInt8"):
            raise ValueError(
                f"append_centralized_synchronous_op: compression must be None or 'MinMaxUInt8', got {compression!r}"
            )
        comm = self._group.communicators.world

        def run(flat: torch.Tensor) -> torch.Tensor:
            if compression is None:
                return comm.allreduce(flat, "avg" if average else "sum")
            return compressed_allreduce.PIPELINES.minmax_allreduce(flat, comm, average=average)[0]

        self._ops.append(run)
        return self

    def run(self) -> torch.Tensor:
        """Run the operations on the bucket's gradients (in place) and return them."""
        grad = self._bucket.grad
        for op in self._ops:
            result = op(grad)
            if result is not grad:
                with torch.no_grad():
                    grad.copy_(result)
        return grad


class _BaguaStyleImpl(project.AlgorithmImpl):
    """Runs a Bagua-style :class:`AlgorithmImpl` inside the project's wrapper."""

    def __init__(self, context: project.AlgorithmContext, impl: AlgorithmImpl, group: Any):
        super().__init__(context)
        self.bagua_impl = impl
        self._group = group
        self._buckets = [BaguaBucket(bucket, group) for bucket in context.buckets]
        self._build()

    def _build(self) -> None:
        self._forward_hook = self.bagua_impl.init_forward_pre_hook(self.context.module)
        self._post_backward_hook = self.bagua_impl.init_post_backward_hook(self.context.module)
        self._post_step_hook = self.bagua_impl.init_post_optimizer_step_hook(self.context.module)
        for bucket in self._buckets:
            bucket.clear_ops()
            self.bagua_impl.init_operations(self.context.module, bucket)

    def before_forward(self, module: torch.nn.Module) -> None:
        if self.bagua_impl.need_reset():
            self._build()
        self._forward_hook(None)

    def reduce_bucket(self, bucket: Bucket) -> Work:
        bagua_bucket = self._buckets[bucket.index]
        last = bucket.index == len(self._buckets) - 1

        def run() -> torch.Tensor:
            result = bagua_bucket.run().clone()
            if last:
                self._post_backward_hook()
            return result

        return self.run_async(run)

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._post_step_hook(optimizer)


class _ProjectAlgorithm(project.Algorithm):
    """The project's Algorithm for a Bagua-style one: reify builds the Bagua impl over the wrapper's group."""

    name = "bagua_style"

    def __init__(self, algorithm: Algorithm):
        self.algorithm = algorithm

    def reify(self, context: project.AlgorithmContext) -> project.AlgorithmImpl:
        group = group_of(context.communicators, context.device)
        impl = self.algorithm.reify(group)
        if not isinstance(impl, AlgorithmImpl):
            raise TypeError(
                f"{type(self.algorithm).__name__}.reify() must return an AlgorithmImpl, got {type(impl).__name__}"
            )
        for hook in _FIXED_HOOKS:
            if getattr(type(impl), hook) is not getattr(AlgorithmImpl, hook):
                raise TypeError(
                    f"{type(impl).__name__} overrides {hook}(), which this compatibility layer does not support: the "
                    "communicated tensors are the gradients, bucketed by the wrapper (see bagua_torch.torch_api."
                    "algorithms.base)"
                )
        return _BaguaStyleImpl(context, impl, group)


def as_project_algorithm(algorithm: Any, **options: Any) -> project.Algorithm:
    """The project's :class:`bagua_torch.algorithms.Algorithm` for ``algorithm``: a built-in or a Bagua-style one,
    or a name with its ``options``, built as every entry point builds it (:func:`bagua_torch.algorithms.get_algorithm`);
    a name that Bagua's spelling registers gets that class, as ``Algorithm.init(name, **options)`` does."""
    if isinstance(algorithm, str) and algorithm in REGISTRY.names():  # Bagua's spelling of it, as Algorithm.init
        algorithm, options = build_algorithm(REGISTRY.by_name(algorithm), options), {}
    if isinstance(algorithm, Algorithm):
        if options:
            raise TypeError(f"options {sorted(options)} can only be given with an algorithm's name")
        return _ProjectAlgorithm(algorithm)
    if isinstance(algorithm, (str, project.Algorithm)):
        return get_algorithm(algorithm, **options)
    raise TypeError(
        "algorithm must be a bagua_torch.torch_api.algorithms algorithm or a subclass of its Algorithm, got "
        f"{type(algorithm).__name__}"
    )

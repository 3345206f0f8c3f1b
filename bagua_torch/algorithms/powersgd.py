"""PowerSGD: low-rank gradient compression with error feedback (see :class:`bagua_common.algorithms.configs.PowerSGDConfig`).

As buckets become ready in the backward pass, the impl's worker thread adds each matrix's
residual and computes its ``P = M Q`` (overlapping the rest of the backward pass). When the
last bucket is ready it runs the exchange for all buckets at once: one allreduce carries every
``P`` and the uncompressed gradients, one every ``Q``, where torch's own PowerSGD hook spends
two per bucket. The approximations ``P Q^T`` are written into the buckets, so every rank
applies the same gradients and the replicas stay identical. The first ``start_iter`` steps are
exact allreduces, bucket by bucket.
"""

from __future__ import annotations

from typing import Any

import torch

from bagua_common.algorithms.configs import PowerSGDConfig, matrix_view
from bagua_common.algorithms.orthogonalization_batches import orthogonalization_batches
from bagua_torch.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    AlgorithmImpl,
    check_dtypes,
    check_tensor_list,
    implements,
)
from bagua_torch.bucketing import Bucket
from bagua_torch.communicator import Work

FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@implements(PowerSGDConfig)
class PowerSGDAlgorithm(Algorithm):
    """Average the gradients through rank-``rank`` approximations (PowerSGD), then the user's optimizer steps.

    Pick it for SGD-style training on a slow network when most of the gradient is in large
    matrices; the fields are :class:`bagua_common.algorithms.configs.PowerSGDConfig`'s.
    """

    def reify(self, context: AlgorithmContext) -> PowerSGDImpl:
        return PowerSGDImpl(context, self.config)


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Modified Gram-Schmidt on the columns of ``p`` (in place), batched over any leading dimensions.

    A zero column stays zero (a zero gradient). One vectorized operation per column pair serves
    every matrix of the batch at once; it runs fastest where each column is contiguous.
    """
    for i in range(p.shape[-1]):
        column = p[..., i]
        for j in range(i):
            done = p[..., j]
            column -= (done * column).sum(-1, keepdim=True) * done
        norm = torch.linalg.vector_norm(column, dim=-1, keepdim=True)
        column /= norm.masked_fill_(norm == 0, 1)
    return p


def orthogonalize_all(ps: list[torch.Tensor]) -> list[torch.Tensor]:
    """:func:`orthogonalize` every ``n x r`` matrix of ``ps``, a few zero-padded batches at a time (``ps`` is kept).

    Zero rows change no inner product, so each result is its own matrix's orthogonalization;
    :func:`orthogonalization_batches` says which share a batch. The results are views into the
    batches.
    """
    out: list[torch.Tensor] = [None] * len(ps)
    for indices in orthogonalization_batches([p.shape for p in ps]):
        padded = torch.nn.utils.rnn.pad_sequence([ps[i] for i in indices], batch_first=True)
        # Stored column by column, so that each column of the batch is contiguous.
        batch = orthogonalize(padded.transpose(1, 2).contiguous().transpose(1, 2))
        for b, i in zip(batch.unbind(0), indices):
            out[i] = b[: ps[i].shape[0]]
    return out


class _AfterExchange:
    """A bucket's handle: complete once the exchange of all buckets (launched with the last one) is."""

    def __init__(self, impl: PowerSGDImpl, bucket: Bucket, prepared: Work):
        self._impl, self._bucket, self._prepared = impl, bucket, prepared

    def wait(self) -> torch.Tensor:
        self._prepared.wait()
        self._impl._exchange.wait()
        return self._bucket.grad

    def is_completed(self) -> bool:
        exchange = self._impl._exchange
        return self._prepared.is_completed() and exchange is not None and exchange.is_completed()


class PowerSGDImpl(AlgorithmImpl):
    """PowerSGD on one wrapped model; its state is the step, each matrix's ``Q`` and residual."""

    def __init__(self, context: AlgorithmContext, config: PowerSGDConfig):
        super().__init__(context)
        check_dtypes(context.buckets, FLOATS, config.name, "PowerSGD averages")
        config.check_compressible([p.shape for bucket in context.buckets for p in bucket.params])
        self.config = config
        # float32 arithmetic (half-precision gradients are widened), float64 if a parameter is.
        self.dtype = torch.float64 if any(b.dtype == torch.float64 for b in context.buckets) else torch.float32
        # Per bucket: (index in the bucket, (n, m), rank) of each compressed parameter; the rest go plain.
        self.layout = [
            [
                (i, matrix_view(p.shape), config.compressed_rank(p.shape))
                for i, p in enumerate(bucket.params)
                if config.compressed_rank(p.shape) is not None
            ]
            for bucket in context.buckets
        ]
        shapes = [(view, rank) for bucket in self.layout for _, view, rank in bucket]
        self.qs = self._random_qs(shapes, 0)
        self.residuals = [torch.zeros(view, dtype=self.dtype, device=context.device) for view, _ in shapes]
        self.step = 0
        self._prepared: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._exchange: Work | None = None

    def _random_qs(self, shapes: list[tuple[tuple[int, int], int]], step: int) -> list[torch.Tensor]:
        """The same random ``Q`` on every rank, seeded by the configuration (and the step, for cold starts)."""
        generator = torch.Generator().manual_seed(self.config.seed * 1_000_003 + step)
        return [
            torch.randn(m, rank, generator=generator, dtype=self.dtype).to(self.context.device)
            for (_, m), rank in shapes
        ]

    def _first_matrix(self, bucket_index: int) -> int:
        return sum(len(b) for b in self.layout[:bucket_index])

    def reduce_bucket(self, bucket: Bucket) -> Work:
        last = bucket.index == len(self.buckets) - 1
        if self.step < self.config.start_iter:
            if last:
                self.step += 1
            return self.world.allreduce_async(bucket.grad, "avg")
        prepared = self.run_async(lambda: self._prepare(bucket))
        if not last:
            return _AfterExchange(self, bucket, prepared)
        self._exchange = self.run_async(self._exchange_all)
        self.step += 1
        return _AfterExchange(self, bucket, prepared)

    def _prepare(self, bucket: Bucket) -> None:
        """On the worker thread: ``M = grad + residual`` and ``P = M Q`` for the bucket's matrices."""
        views = bucket.views(bucket.grad)
        first = self._first_matrix(bucket.index)
        matrices, ps = [], []
        for k, (i, view, _) in enumerate(self.layout[bucket.index], first):
            if self.config.error_feedback:
                # M is built in the residual's buffer (the new residual is written there too): no
                # full-size tensors allocated per step, which cost page faults in every step.
                m = self.residuals[k].add_(views[i].reshape(view))
            else:
                m = views[i].reshape(view).to(self.dtype)
            matrices.append(m)
            ps.append(m @ self.qs[k])
        self._prepared[bucket.index] = (matrices, ps)

    def _exchange_all(self) -> None:
        """On the worker thread, after every bucket's ``_prepare``: the two allreduces and the write-back."""
        n = self.world.size
        matrices = [m for b in range(len(self.buckets)) for m in self._prepared[b][0]]
        ps = [p for b in range(len(self.buckets)) for p in self._prepared[b][1]]
        plain = []
        for bucket, layout in zip(self.buckets, self.layout):
            compressed = {i for i, _, _ in layout}
            views = bucket.views(bucket.grad)
            plain += [views[i] for i in range(len(bucket.params)) if i not in compressed]
        parts = [p.reshape(-1) for p in ps] + [v.reshape(-1).to(self.dtype) for v in plain]
        reduced = self.world.allreduce(torch.cat(parts), "sum").split([t.numel() for t in parts])
        ps = orthogonalize_all([r.view_as(p) for r, p in zip(reduced, ps)])
        for view, total in zip(plain, reduced[len(ps) :]):
            view.copy_((total / n).view_as(view))
        qs = [m.T @ p for m, p in zip(matrices, ps)]
        qs = [
            q.view_as(old)
            for q, old in zip(
                self.world.allreduce(torch.cat([q.reshape(-1) for q in qs]), "avg").split([q.numel() for q in qs]), qs
            )
        ]
        k = 0
        for bucket, layout in zip(self.buckets, self.layout):
            views = bucket.views(bucket.grad)
            for i, view, _ in layout:
                if views[i].dtype == self.dtype:
                    approximation = torch.mm(ps[k], qs[k].T, out=views[i].view(view))
                else:
                    approximation = ps[k] @ qs[k].T
                    views[i].copy_(approximation.view_as(views[i]))
                if self.config.error_feedback:
                    matrices[k].sub_(approximation)  # the residual's buffer: M - P Q^T
                k += 1
        if self.config.warm_start:
            self.qs = qs
        else:
            shapes = [(m.shape, q.shape[1]) for m, q in zip(matrices, qs)]
            self.qs = self._random_qs(shapes, self.step)
        self._prepared.clear()

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "qs": [q.detach().reshape(-1).clone() for q in self.qs],
            "residuals": [r.detach().reshape(-1).clone() for r in self.residuals],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step = state.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"{self.config.name}: the checkpoint's 'step' must be an int >= 0, got {step!r}")
        qs = check_tensor_list(state, "qs", [q.numel() for q in self.qs], self.config.name, self.dtype)
        residuals = check_tensor_list(
            state, "residuals", [r.numel() for r in self.residuals], self.config.name, self.dtype
        )
        self.step = step
        self.qs = [q.to(self.context.device).view_as(old).clone() for q, old in zip(qs, self.qs)]
        self.residuals = [r.to(self.context.device).view_as(old).clone() for r, old in zip(residuals, self.residuals)]

"""PowerSGD: low-rank gradient compression with error feedback.

Its settings: :class:`bagua_common.algorithms.configs.PowerSGDConfig`.

As each bucket becomes ready in the backward pass, the impl's worker thread adds each of its
matrices' residual, computes ``P = M Q`` and sums the bucket's ``P`` factors and uncompressed
gradients over the ranks in one allreduce, while the rest of the backward pass goes on. When the
last bucket's is done it orthogonalizes every ``P`` of the step (in the batches of
:func:`orthogonalization_batches`, which span buckets), computes the ``Q`` factors and averages
them all in one allreduce; where torch's own PowerSGD hook spends three allreduces per bucket,
this is one per bucket and one per step. The orthogonalization's batches are the whole step's,
so on two ranks the bits do not depend on the bucketing (on more, an element's sum over the
ranks may associate by its place in the message, as in any allreduce). The approximations
``P Q^T`` are written into the buckets, so every rank applies the same gradients and the
replicas stay identical. The first ``start_iter`` steps are exact allreduces, bucket by bucket.
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
    WeighedOut,
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

    fault_tolerant = True

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


def narrow_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for a ``b`` of a few columns (PowerSGD's ``M Q`` and ``M^T P``), computed as ``(b^T a^T)^T``.

    torch's CPU matmul takes a slow path when the product is only a few columns wide: 20-30x slower
    than the transposed product for the GPT's matrices at rank 4. The two differ in rounding only.
    """
    return torch.mm(b.T, a.T).T


class _AfterExchange:
    """A bucket's handle: complete once the step's ``Q`` exchange (launched with the last bucket) is."""

    def __init__(self, impl: PowerSGDImpl, bucket: Bucket, summed: Work):
        self._impl, self._bucket, self._summed = impl, bucket, summed

    def wait(self) -> torch.Tensor:
        self._summed.wait()
        self._impl._exchange.wait()
        return self._bucket.grad

    def is_completed(self) -> bool:
        exchange = self._impl._exchange
        return self._summed.is_completed() and exchange is not None and exchange.is_completed()


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
        self._carried = {"step": 0, "qs": list(self.qs)}
        # Per bucket of the step so far: its matrices M and its P factors summed over the ranks.
        self._summed: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
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
        summed = self.run_async(lambda: self._sum_bucket(bucket))
        if last:
            self._exchange = self.run_async(self._exchange_qs)
            self.step += 1
        return _AfterExchange(self, bucket, summed)

    def _sum_bucket(self, bucket: Bucket) -> None:
        """On the worker thread, as the bucket is ready: ``M = grad + residual``, ``P = M Q``, then one allreduce
        sums the bucket's ``P`` factors and averages its uncompressed gradients (written back at once)."""
        views = bucket.views(bucket.grad)
        first = self._first_matrix(bucket.index)
        layout = self.layout[bucket.index]
        matrices, ps = [], []
        for k, (i, view, _) in enumerate(layout, first):
            if self.config.error_feedback:
                # M is built in the residual's buffer (the new residual is written there too): no
                # full-size tensors allocated per step, which cost page faults in every step.
                m = self.residuals[k].add_(views[i].reshape(view))
            else:
                m = views[i].reshape(view).to(self.dtype)
            matrices.append(m)
            ps.append(narrow_product(m, self.qs[k]))
        compressed = {i for i, _, _ in layout}
        plain = [v for i, v in enumerate(views) if i not in compressed]
        parts = [p.reshape(-1) for p in ps] + [v.reshape(-1).to(self.dtype) for v in plain]
        reduced = self.world.allreduce(torch.cat(parts), "sum").split([t.numel() for t in parts])
        for view, total in zip(plain, reduced[len(ps) :]):
            view.copy_((total / self.world.size).view_as(view))
        self._summed[bucket.index] = (matrices, [r.view_as(p) for r, p in zip(reduced, ps)])

    def _exchange_qs(self) -> None:
        """On the worker thread, after every bucket's ``_sum_bucket``: orthogonalize every ``P``, average every
        ``Q = M^T P`` in one allreduce, and write ``P Q^T`` (and the new residuals) back."""
        matrices = [m for b in range(len(self.buckets)) for m in self._summed[b][0]]
        ps = orthogonalize_all([p for b in range(len(self.buckets)) for p in self._summed[b][1]])
        qs = [narrow_product(m.T, p) for m, p in zip(matrices, ps)]
        qs = [
            q.view_as(old)
            for q, old in zip(
                self.world.allreduce(torch.cat([q.reshape(-1) for q in qs]), "avg").split([q.numel() for q in qs]), qs
            )
        ]
        # A step that joiners are weighed out of applies every approximation scaled (by the reducer); a joiner
        # contributes no M, so its residual stays the zeros it started from.
        weighed_out = self.weighed_out or WeighedOut(contributes=True, scale=1.0)
        k = 0
        for bucket, layout in zip(self.buckets, self.layout):
            views = bucket.views(bucket.grad)
            for i, view, _ in layout:
                if views[i].dtype == self.dtype:
                    approximation = torch.mm(ps[k], qs[k].T, out=views[i].view(view))
                else:
                    approximation = ps[k] @ qs[k].T
                    views[i].copy_(approximation.view_as(views[i]))
                if self.config.error_feedback and weighed_out.contributes:
                    matrices[k].sub_(approximation, alpha=weighed_out.scale)  # the residual's buffer: M - P Q^T
                k += 1
        if self.config.warm_start:
            self.qs = qs
        else:
            shapes = [(m.shape, q.shape[1]) for m, q in zip(matrices, qs)]
            self.qs = self._random_qs(shapes, self.step)
        self._summed.clear()

    # --- fault tolerance: Q and the step carry over a change of members (as of the last commit), residuals restart;
    # a joiner is weighed out of its first step, given Q and the step before it

    def weighed_out_scale(self, trainers: int) -> float:
        return self.mean_over(trainers)

    def on_commit(self) -> None:
        self._carried = {"step": self.step, "qs": list(self.qs)}  # each step makes new Q tensors: no copy needed

    def carried_state(self) -> dict[str, Any]:
        return dict(self._carried)

    def load_carried_state(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.qs = [q.to(self.context.device).view_as(old).clone() for q, old in zip(state["qs"], self.qs)]
        self.on_commit()

    def replicated_tensors(self) -> list[torch.Tensor]:
        return list(self.qs)

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
        self.on_commit()  # a restored checkpoint is committed state: a change before the next commit carries it

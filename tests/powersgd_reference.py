"""PowerSGD simulated for all ranks in one process, in float64 NumPy (the tests' reference).

Written from the paper (Vogels, Karimireddy and Jaggi, 2019, Algorithm 1 with error feedback
and warm start) and ``bagua_common.algorithms.configs.PowerSGDConfig``'s docstring, sharing no code with either front
end beyond the configuration's rule for which tensors are compressed.
"""

from __future__ import annotations

import numpy as np

from bagua_common.algorithms.configs import PowerSGDConfig, matrix_view


def gram_schmidt(p: np.ndarray) -> np.ndarray:
    q = p.copy()
    for i in range(q.shape[1]):
        for j in range(i):
            q[:, i] -= (q[:, j] @ q[:, i]) * q[:, j]
        norm = np.linalg.norm(q[:, i])
        q[:, i] = q[:, i] / norm if norm > 0 else 0.0
    return q


class PowerSGDReference:
    """All ``ranks`` ranks' PowerSGD state; :meth:`step` turns their gradients into the averaged ones."""

    def __init__(self, shapes: list[tuple[int, ...]], ranks: int, config: PowerSGDConfig, initial_qs: list[np.ndarray]):
        self.shapes, self.ranks, self.config = shapes, ranks, config
        self.ranks_of = [config.compressed_rank(s) for s in shapes]
        self.qs = [np.asarray(q, np.float64) for q in initial_qs]
        self.residuals = [
            [np.zeros(matrix_view(s)) for s, r in zip(shapes, self.ranks_of) if r is not None] for _ in range(ranks)
        ]
        self.step_count = 0

    def step(self, grads: list[list[np.ndarray]]) -> list[np.ndarray]:
        """``grads[rank][leaf]`` in; the gradient every rank applies, per leaf, out."""
        grads = [[np.asarray(g, np.float64) for g in rank_grads] for rank_grads in grads]
        out: list[np.ndarray] = []
        exact = self.step_count < self.config.start_iter
        self.step_count += 1
        compressed_index = 0
        for leaf, shape in enumerate(self.shapes):
            mean = sum(g[leaf] for g in grads) / self.ranks
            if exact or self.ranks_of[leaf] is None:
                out.append(mean.reshape(shape))
                continue
            k = compressed_index
            compressed_index += 1
            view = matrix_view(shape)
            matrices = [
                g[leaf].reshape(view) + (self.residuals[r][k] if self.config.error_feedback else 0)
                for r, g in enumerate(grads)
            ]
            p = gram_schmidt(sum(m @ self.qs[k] for m in matrices))
            q = sum(m.T @ p for m in matrices) / self.ranks
            approximation = p @ q.T
            if self.config.error_feedback:
                for r, m in enumerate(matrices):
                    self.residuals[r][k] = m - approximation
            self.qs[k] = q
            out.append(approximation.reshape(shape))
        return out

"""Rank bodies for test_adam_convergence_torch.py: QAdam and 1-bit Adam on the real-model tasks.

The models are those of tests/adam_tasks.py (the JAX test's), as torch modules holding the
same NumPy initial parameters. One job of gloo processes trains every (task, algorithm)
variant in turn; rank ``r`` takes its equal share of rows of each global batch.
"""

from __future__ import annotations

import os

import adam_tasks
import numpy as np
import torch
from adam_tasks import BATCH, LR, WARMUP_STEPS
from torch import nn
from torch.nn import functional as F


class TaskModel(nn.Module):
    """A task's parameters (named as in adam_tasks), registered from its NumPy initialization."""

    def __init__(self, params: dict[str, np.ndarray]):
        super().__init__()
        for name, value in params.items():
            self.register_parameter(name, nn.Parameter(torch.from_numpy(value.copy())))


class CNN(TaskModel):
    """Two ReLU convolutions (HWIO weights, as in JAX) and a dense layer on NHWC digit images."""

    def __init__(self, seed: int):
        super().__init__(adam_tasks.cnn_params(seed))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.permute(0, 3, 1, 2)
        h = F.relu(F.conv2d(h, self.conv1.permute(3, 2, 0, 1), self.conv1_b, padding=1))
        h = F.relu(F.conv2d(h, self.conv2.permute(3, 2, 0, 1), self.conv2_b, stride=2, padding=1))
        return h.permute(0, 2, 3, 1).flatten(1) @ self.dense + self.dense_b


class Transformer(TaskModel):
    """Token + position embeddings, one single-head attention block, an MLP and a mean-pooled head."""

    def __init__(self, seed: int):
        super().__init__(adam_tasks.transformer_params(seed))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed[tokens] + self.pos
        q, k, v = h @ self.q, h @ self.k, h @ self.v
        attention = torch.softmax(q @ k.transpose(1, 2) / np.sqrt(q.shape[-1]), dim=-1)
        h = h + (attention @ v) @ self.o
        h = h + F.relu(h @ self.w1 + self.b1) @ self.w2
        return h.mean(1) @ self.head + self.head_b


TASKS = {
    "cnn": (CNN, adam_tasks.cnn_batches, adam_tasks.cnn_eval),
    "transformer": (Transformer, adam_tasks.transformer_batches, adam_tasks.transformer_eval),
}


def loss_of(model: nn.Module, batch: dict[str, np.ndarray]) -> torch.Tensor:
    inputs = torch.from_numpy(batch["x"])
    return F.cross_entropy(model(inputs), torch.from_numpy(batch["y"]).long())


def final(model: nn.Module, task: str, seed: int) -> dict:
    """The held-out loss and the parameters (NumPy) of a trained model."""
    with torch.no_grad():
        loss = float(loss_of(model, TASKS[task][2](seed)))
    return {
        "loss": loss,
        "params": {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
    }


def adam_reference(task: str, seed: int) -> dict:
    """Single-process ``torch.optim.Adam`` on the global batches (the ranks' averaged gradients)."""
    model_class, batches, _ = TASKS[task]
    model = model_class(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for batch in batches(seed):
        optimizer.zero_grad()
        loss_of(model, batch).backward()
        optimizer.step()
    return final(model, task, seed)


def job(seed: int, variants: list[tuple[str, str]]) -> dict:
    """Train each (task, algorithm) variant on this rank (the data of the test run's ``seed``); the held-out loss and
    parameters per variant."""
    torch.set_num_threads(1)
    import bagua_torch
    from bagua_torch.algorithms.onebit_adam import (
        OneBitAdamAlgorithm,
        OneBitAdamOptimizer,
    )
    from bagua_torch.algorithms.qadam import QAdamAlgorithm, QAdamOptimizer

    algorithms = {
        "qadam": (QAdamOptimizer, QAdamAlgorithm),
        "onebit_adam": (OneBitAdamOptimizer, OneBitAdamAlgorithm),
    }
    rank = int(os.environ["RANK"])
    group = bagua_torch.init_process_group(timeout=60)
    share = BATCH // group.size
    rows = slice(rank * share, (rank + 1) * share)
    out = {}
    for task, algorithm in variants:
        model_class, batches, _ = TASKS[task]
        model = model_class(seed)
        optimizer_class, algorithm_class = algorithms[algorithm]
        optimizer = optimizer_class(model.parameters(), lr=LR, warmup_steps=WARMUP_STEPS)
        wrapped = bagua_torch.with_bagua(model, [optimizer], algorithm_class(optimizer))
        for batch in batches(seed):
            optimizer.zero_grad()
            loss_of(wrapped, {key: value[rows] for key, value in batch.items()}).backward()
            optimizer.step()
        wrapped.close()
        out[f"{task}/{algorithm}"] = final(model, task, seed)
    return out

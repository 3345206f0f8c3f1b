"""What test_lightning_torch.py's runs train, without Lightning (so that the test's own process never imports it):
the algorithms' options, the model, its optimizer and this rank's rows of the data."""

from __future__ import annotations

import torch
from torch import nn

ROWS, BATCH = 24, 4  # per epoch: 24 rows over 2 ranks in batches of 4, 3 steps
OPTIONS = {
    "gradient_allreduce": {},
    "bytegrad": {"error_feedback": True},
    "decentralized": {},
    "low_precision_decentralized": {},
    "async": {"sync_interval_ms": 20, "warmup_steps": 2},
    "qadam": {},
    "onebit_adam": {},
    "powersgd": {"rank": 2, "start_iter": 1},
    "diloco": {"sync_every": 2},
}
ADAM = {"qadam": "QAdamOptimizer", "onebit_adam": "OneBitAdamOptimizer"}


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def make_optimizer(algorithm: str, params) -> torch.optim.Optimizer:
    if algorithm in ADAM:
        from bagua_torch import algorithms

        return getattr(algorithms, ADAM[algorithm])(params, lr=0.01, warmup_steps=2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def dataset(seed: int) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 2, generator=g))


def sampler(data: torch.utils.data.Dataset, rank: int) -> torch.utils.data.DistributedSampler:
    """This rank's rows, in order (Lightning keeps a DistributedSampler it is given)."""
    return torch.utils.data.DistributedSampler(data, num_replicas=2, rank=rank, shuffle=False)

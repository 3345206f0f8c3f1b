"""Rank bodies for test_checkpoint_torch.py: train, save, restore into another world size, report the state.

:func:`restore_then_save` restores (when given a folder) every algorithm of :data:`ALGORITHMS`
from ``restore_root/<name>``, reports what each rank got, trains a few steps on rank-dependent
data (so decentralized parameters drift apart) and saves into ``save_root/<name>``, reporting
the saved state too.
"""

from __future__ import annotations

import torch
from gradient_allreduce_bytegrad_workers_torch import SMALL_BUCKET, batch, loss_fn, make_mlp, setup

LR = 0.05
STEPS = 3


def build(name: str, seed: int):
    """The wrapped model and its optimizer for algorithm ``name``."""
    import bagua_torch
    from bagua_torch import algorithms as A

    model = make_mlp(seed)
    if name in ("qadam", "onebit_adam"):
        from bagua_torch.algorithms.onebit_adam import OneBitAdamOptimizer
        from bagua_torch.algorithms.qadam import QAdamOptimizer

        optimizer_class = QAdamOptimizer if name == "qadam" else OneBitAdamOptimizer
        optimizer = optimizer_class(model.parameters(), lr=LR, warmup_steps=1)
        algorithm_class = A.QAdamAlgorithm if name == "qadam" else A.OneBitAdamAlgorithm
        algorithm = algorithm_class(optimizer, hierarchical=False)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
        algorithm = {
            "gradient_allreduce": lambda: A.GradientAllReduceAlgorithm(),
            "bytegrad": lambda: A.ByteGradAlgorithm(hierarchical=False, error_feedback=True),
            "decentralized": lambda: A.DecentralizedAlgorithm(hierarchical=False),
            "low_precision_decentralized": lambda: A.LowPrecisionDecentralizedAlgorithm(hierarchical=False),
            "powersgd": lambda: A.PowerSGDAlgorithm(rank=1, start_iter=1, min_compression_rate=1.0),
            "async": lambda: A.AsyncModelAverageAlgorithm(warmup_steps=1, sync_interval_ms=1),
        }[name]()
    wrapped = bagua_torch.with_bagua(model, [optimizer], algorithm, bucket_bytes=SMALL_BUCKET)
    return wrapped, optimizer


ALGORITHMS = (
    "gradient_allreduce",
    "bytegrad",
    "qadam",
    "onebit_adam",
    "decentralized",
    "low_precision_decentralized",
    "powersgd",
    "async",
)


def _numpy(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().numpy().copy()
    if isinstance(value, dict):
        return {k: _numpy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_numpy(v) for v in value]
    return value


def report(model, optimizer) -> dict:
    """The rank's parameters, algorithm state and optimizer state, as NumPy."""
    return {
        "params": {n: p.detach().numpy().copy() for n, p in model.module.named_parameters()},
        "algorithm": _numpy(model.algorithm_impl.state_dict()),
        "optimizer": _numpy(optimizer.state_dict()["state"]),
    }


def restore_then_save(seed: int, restore_root: str | None, save_root: str) -> dict:
    from bagua_torch.checkpoint import restore, save

    group = setup()
    results = {}
    for name in ALGORITHMS:
        model, optimizer = build(name, seed)
        result = {}
        first = 0
        if restore_root is not None:
            first = restore(f"{restore_root}/{name}", model, optimizer)
            result["restored"] = report(model, optimizer)
        for step in range(first, first + STEPS):
            x, y = batch(seed, step, group.rank)
            optimizer.zero_grad()
            loss_fn(model, x, y).backward()
            optimizer.step()
        save(f"{save_root}/{name}", model, optimizer, step=first + STEPS)
        result["saved"] = report(model, optimizer)
        model.close()
        results[name] = result
    if restore_root is not None:
        results["refusals"] = refusals(seed, restore_root)
    return results


def refusals(seed: int, root: str) -> dict:
    """Restores that cannot work (another model, another algorithm, no checkpoint): the error messages."""
    import bagua_torch
    from bagua_torch.algorithms import DecentralizedAlgorithm
    from bagua_torch.checkpoint import restore

    errors = {}
    wider = torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    optimizer = torch.optim.Adam(wider.parameters(), lr=LR)
    mlp = make_mlp(seed)
    for label, model in (
        ("model", bagua_torch.with_bagua(wider, [optimizer], "gradient_allreduce")),
        (
            "algorithm",
            bagua_torch.with_bagua(mlp, [torch.optim.SGD(mlp.parameters(), lr=LR)], DecentralizedAlgorithm()),
        ),
    ):
        try:
            restore(f"{root}/gradient_allreduce", model, [])
        except ValueError as e:
            errors[label] = str(e)
        model.close()
    try:
        restore(f"{root}/absent", model, [])
    except FileNotFoundError as e:
        errors["none"] = str(e)
    return errors

"""Bagua's ``bagua.torch_api.checkpoint``: ``save_checkpoint`` / ``load_checkpoint`` in Bagua's file layout.

``<path>/iter_<iteration:07d>/mp_rank_00_model_states.pt`` holds ``{"iteration", "model",
"optimizer", "lr_scheduler"}`` (the model's own ``state_dict()``, without a ``module.`` prefix)
and ``<path>/latest_checkpointed_iteration.txt`` the last iteration; rank 0 writes, every rank
waits for it. Fixed against Bagua: ``load_checkpoint(strict=...)`` is honoured (Bagua ignored
it), a corrupt tracker file raises a ValueError (Bagua called ``sys.exit()``), and files are
loaded with ``weights_only=True`` (tensors and plain data, never arbitrary pickles).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from bagua_torch.torch_api import communication, env

__all__ = ["load_checkpoint", "save_checkpoint"]


def _tracker(checkpoints_path: str) -> str:
    return os.path.join(checkpoints_path, "latest_checkpointed_iteration.txt")


def _model_file(checkpoints_path: str, iteration: int) -> str:
    return os.path.join(checkpoints_path, f"iter_{iteration:07d}", "mp_rank_00_model_states.pt")


def _barrier() -> None:
    if communication.is_initialized():
        communication.barrier()
    elif dist.is_initialized():
        dist.barrier()


def save_checkpoint(
    iteration: int,
    checkpoints_path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
) -> None:
    """Save the model (and optimizer, LR scheduler) at ``iteration``; collective, rank 0 writes."""
    if env.get_rank() == 0:
        state = {
            "iteration": iteration,
            "model": model.state_dict(),
            "optimizer": None if optimizer is None else optimizer.state_dict(),
            "lr_scheduler": None if lr_scheduler is None else lr_scheduler.state_dict(),
        }
        filename = _model_file(checkpoints_path, iteration)
        os.makedirs(os.path.dirname(filename), exist_ok=True)
        torch.save(state, filename)
        with open(_tracker(checkpoints_path), "w") as f:
            f.write(str(iteration))
    _barrier()


def load_checkpoint(
    checkpoints_path: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    lr_scheduler: Any = None,
    strict: bool = True,
) -> int:
    """Load the latest checkpoint into the model (and optimizer, LR scheduler); return its iteration (0 if none)."""
    tracker = _tracker(checkpoints_path)
    if not os.path.isfile(tracker):
        return 0
    with open(tracker) as f:
        text = f.read().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise ValueError(f"{tracker} holds {text!r}, not an iteration number") from None
    state = torch.load(_model_file(checkpoints_path, iteration), map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"], strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if lr_scheduler is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    _barrier()
    return iteration

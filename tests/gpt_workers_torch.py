"""Rank bodies that train the workload's GPT with bagua_torch (tests/test_gpt_models.py, the convergence gate)."""

from __future__ import annotations

import os

import torch

from bagua_common.workload import init_gpt_params, load_corpus
from bagua_torch.models.gpt import GPT, next_token_loss


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)


def allreduce_losses(size: str, seed: int, steps: int, batch: int, lr: float, weight_decay: float) -> dict:
    """This rank's loss at each of ``steps`` steps (and its parameters after them) of gradient allreduce with AdamW, from ``init_gpt_params(seed)``,
    on the corpus batches of ``(seed, step, rank)``."""
    import bagua_torch

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    bagua_torch.init_process_group(timeout=60)
    model = GPT(size, init_gpt_params(size, seed))
    optimizer = adamw(model, lr, weight_decay)
    wrapped = bagua_torch.with_bagua(model, [optimizer], "gradient_allreduce")
    corpus, length = load_corpus(), model.config.context + 1
    losses = []
    for step in range(steps):
        tokens = torch.from_numpy(corpus.batch(seed, step, rank, batch, length))
        optimizer.zero_grad()
        loss = next_token_loss(wrapped(tokens[:, :-1]), tokens)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    wrapped.close()
    return {"rank": rank, "losses": losses, "params": {k: v.detach().numpy() for k, v in model.state_dict().items()}}

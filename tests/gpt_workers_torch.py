"""Rank bodies that train the workload's GPT with bagua_torch (tests/test_gpt_models.py, the convergence gate)."""

from __future__ import annotations

import os
import time

import torch

from bagua_common.workload import init_gpt_params, load_corpus
from bagua_torch.models.gpt import GPT, next_token_loss


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)


def allreduce_losses(size: str, seed: int, steps: int, batch: int, lr: float, weight_decay: float) -> dict:
    """This rank's loss at each of ``steps`` steps (and its parameters after them) of gradient allreduce
    with AdamW, from ``init_gpt_params(seed)``, on the corpus batches of ``(seed, step, rank)``."""
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


def _algorithm(name: str, model: torch.nn.Module):
    """(optimizer, algorithm) of ``name`` for the gate: AdamW and the registry's algorithm with the gate's options,
    or, for an algorithm that is an optimizer itself, its own optimizer; the optimizer's lr follows the gate's
    schedule through a LambdaLR."""
    from gpt_gate import B2, LR, OPTIONS, WEIGHT_DECAY, learning_rate

    from bagua_torch.algorithms import algorithm_class, get_algorithm

    options = dict(OPTIONS.get(name, {}))
    optimizer_class = getattr(algorithm_class(name), "optimizer_class", None)
    if optimizer_class is not None:
        optimizer = optimizer_class(
            model.parameters(), lr=LR, warmup_steps=options.pop("warmup_steps"), betas=(0.9, B2)
        )
        algorithm = get_algorithm(name, optimizer=optimizer, **options)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, B2), eps=1e-8, weight_decay=WEIGHT_DECAY)
        algorithm = get_algorithm(name, **options)
    return optimizer, algorithm, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: learning_rate(step) / LR)


def gate(names: list[str], seed: int, start: dict) -> dict:
    """Train the gate's GPT from the parameters ``start`` with each algorithm of ``names`` in turn, on the gate's
    nodes of NRANKS ranks; this rank's gate summary of each."""
    from gpt_gate import (
        ASYNC_STEP_SECONDS,
        BATCH,
        HELDOUT_WINDOWS,
        MODEL,
        NRANKS,
        PRETRAIN_STEPS,
        STEPS,
        TORCH_NODES,
        summary,
    )

    import bagua_torch

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    group = bagua_torch.init_process_group(timeout=60, local_world_size=NRANKS, local_rank=rank % NRANKS)
    corpus = load_corpus()
    out = {"rank": rank, "hierarchical": group.communicators.hierarchical}
    for name in names:
        model = GPT(MODEL, start)
        flat_start = torch.cat([p.detach().flatten() for p in model.parameters()])
        optimizer, algorithm, schedule = _algorithm(name, model)
        wrapped = bagua_torch.with_bagua(model, [optimizer], algorithm)
        length = model.config.context + 1
        for step in range(STEPS):
            began = time.monotonic()
            tokens = torch.from_numpy(corpus.batch(seed, PRETRAIN_STEPS + step, rank, BATCH // TORCH_NODES, length))
            optimizer.zero_grad()
            next_token_loss(wrapped(tokens[:, :-1]), tokens).backward()
            optimizer.step()
            schedule.step()
            if name == "async":  # the host's wait for an accelerator's step (see ASYNC_STEP_SECONDS)
                time.sleep(max(0.0, ASYNC_STEP_SECONDS - (time.monotonic() - began)))
        wrapped.close()
        heldout = torch.from_numpy(corpus.heldout_batch(HELDOUT_WINDOWS, length))
        with torch.no_grad():
            heldout_loss = next_token_loss(model(heldout[:, :-1]), heldout).item()
        out[name] = summary({k: v.detach().numpy() for k, v in model.state_dict().items()}, heldout_loss)
        if name == "async":
            out[name]["rounds"] = wrapped.algorithm_impl.rounds
        if name in REPLICAS_AVERAGED_EVERY_STEP:
            out[name]["replica_spread"] = _replica_spread(model, flat_start, group.world)
    return out


REPLICAS_AVERAGED_EVERY_STEP = ("decentralized", "low_precision_decentralized")


def _replica_spread(model: torch.nn.Module, start: torch.Tensor, world) -> float:
    """The largest distance of a rank's parameters from the ranks' mean, over the distance the mean moved from
    ``start`` (collective): replicas averaged every step stay within about a step of each other, replicas left
    alone drift apart as far as they train."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    mean = world.allreduce(flat.clone(), "avg")
    mine = (flat - mean).norm() / (mean - start).norm()
    return float(world.allreduce(mine.reshape(1), "max").item())

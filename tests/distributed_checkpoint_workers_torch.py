"""Rank bodies for test_distributed_checkpoint_torch.py: save through DCP, resume, restore damaged copies."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from checkpoint_workers_torch import report
from gradient_allreduce_bytegrad_workers_torch import SMALL_BUCKET, make_mlp, setup, train

LR = 0.05
# gradient_allreduce trains with plain SGD: an optimizer without state, whose empty state dict DCP does not save.
ALGORITHMS = ("bytegrad", "decentralized", "diloco", "gradient_allreduce")


def build(name: str, seed: int):
    """The wrapped model and its optimizer for algorithm ``name``."""
    import bagua_torch
    from bagua_torch import algorithms as A

    model = make_mlp(seed)
    if name == "gradient_allreduce":
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    algorithm = {
        "gradient_allreduce": lambda: A.GradientAllReduceAlgorithm(hierarchical=False),
        "bytegrad": lambda: A.ByteGradAlgorithm(hierarchical=False, error_feedback=True),
        "decentralized": lambda: A.DecentralizedAlgorithm(hierarchical=False),
        "diloco": lambda: A.DiLoCoAlgorithm(sync_every=3),
    }[name]()
    return bagua_torch.with_bagua(model, [optimizer], algorithm, bucket_bytes=SMALL_BUCKET), optimizer


def save_resume_damage(seed: int, root: str) -> dict:
    """Per algorithm: train 4 steps, save (DiLoCo: mid-round), train 2 more and save; resume from step 4 and train
    the same 2 steps; then try restoring damaged copies of step 6. Reports the states and the error messages."""
    from bagua_torch.distributed_checkpoint import restore, save

    group = setup(backend="gloo")
    results = {}
    for name in ALGORITHMS:
        model, optimizer = build(name, seed)
        train(model, optimizer, seed, range(4), group.rank)
        first = save(f"{root}/{name}", model, optimizer, step=4)
        saved = report(model, optimizer)
        train(model, optimizer, seed, range(4, 6), group.rank)
        second = save(f"{root}/{name}", model, optimizer, step=6)
        want = report(model, optimizer)
        model.close()

        model, optimizer = build(name, seed + 1)
        step = restore(first, model, optimizer)
        train(model, optimizer, seed, range(step, 6), group.rank)
        results[name] = {"saved": saved, "want": want, "resumed": report(model, optimizer), "step": step}
        if name == "bytegrad":
            results["errors"] = damaged_restores(model, optimizer, Path(first), Path(second), group)
        model.close()
    return results


def damaged_restores(model, optimizer, first: Path, second: Path, group) -> dict:
    """Restore copies of ``second`` with one file damaged each way: {damage: (file, error message)}."""
    from bagua_torch.distributed_checkpoint import restore

    def truncate(path):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    damages = {
        "truncated": ("__1_0.distcp", truncate),
        "empty": ("__0_0.distcp", lambda path: path.write_bytes(b"")),
        "another checkpoint": ("__1_0.distcp", lambda path: shutil.copyfile(first / path.name, path)),
        "missing": ("manifest.json", Path.unlink),
        "metadata truncated": (".metadata", truncate),
    }
    errors = {}
    for what, (file, damage) in damages.items():
        copy = second.parent / f"damaged_{what.replace(' ', '_')}" / second.name
        if group.rank == 0:
            shutil.copytree(second, copy)
            damage(copy / file)
        model.communicators.world.barrier()
        try:
            restore(copy, model, optimizer)
            errors[what] = (str(copy / file), "restored")
        except (ValueError, FileNotFoundError) as e:
            errors[what] = (str(copy / file), str(e))
    return errors


def restore_each(seed: int, checkpoint: Callable[[str], str], then: Callable | None = None) -> dict:
    """Per algorithm: a model built from ``seed`` restores ``checkpoint(name)``; reports the step and the state, and
    what ``then(name, model, optimizer, step)`` returns (a dict) when given."""
    from bagua_torch.distributed_checkpoint import restore

    setup(backend="gloo")
    results = {}
    for name in ALGORITHMS:
        model, optimizer = build(name, seed)
        step = restore(checkpoint(name), model, optimizer)
        results[name] = {"step": step, **report(model, optimizer)}
        if then is not None:
            results[name].update(then(name, model, optimizer, step))
        model.close()
    return results


def restore_alone(seed: int, root: str) -> dict:
    """One rank restores every algorithm's 2-rank step-4 checkpoint and reports what it got; it then trains a step
    and saves that one-rank state as step 5 under ``root/one_rank`` (reported as ``saved``) for :func:`restore_two`."""
    from bagua_torch.distributed_checkpoint import save

    def train_and_save(name, model, optimizer, step):
        train(model, optimizer, seed, range(step, step + 1), 0)
        save(f"{root}/one_rank/{name}", model, optimizer, step=step + 1)
        return {"saved": report(model, optimizer)}

    return restore_each(seed + 1, lambda name: f"{root}/{name}/step_000000004", train_and_save)


def restore_two(seed: int, root: str) -> dict:
    """Each of two ranks restores every algorithm's one-rank step-5 checkpoint and reports what it got."""
    return restore_each(seed + 2, lambda name: f"{root}/one_rank/{name}/step_000000005")

"""The script test_lightning_torch.py runs on 2 CPU processes, started by Lightning's own launcher or by
bagua-launch: ``python lightning_train.py OUT SEED ALGORITHM...``.

For each algorithm: ``Trainer.fit`` with ``BaguaStrategy`` for one epoch (Lightning's ModelCheckpoint saves it), a new
Trainer resumed from that checkpoint for a second epoch (and, for ByteGrad with error feedback, one resumed from
the checkpoint without its ``"bagua"`` entry), then the same two epochs with ``bagua_torch.with_bagua`` on the
same per-rank batches. Each rank writes its parameters to ``OUT/rank<r>.npz`` as ``<algorithm>/<run>/<name>``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from lightning_run import ADAM, BATCH, OPTIONS, dataset, make_model, make_optimizer, sampler
from torch import nn


class Regression(pl.LightningModule):
    def __init__(self, algorithm: str, seed: int):
        super().__init__()
        self.algorithm, self.seed, self.net = algorithm, seed, make_model(seed)

    def training_step(self, batch, batch_index):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return make_optimizer(self.algorithm, self.net.parameters())

    def train_dataloader(self):
        data = dataset(self.seed)
        return torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler(data, self.global_rank))


def fit(algorithm: str, seed: int, epochs: int, checkpoint: str | None = None, save_in: Path | None = None):
    """The trained LightningModule; with ``save_in``, Lightning's ModelCheckpoint saves ``<algorithm>.ckpt`` there."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from bagua_torch.lightning import BaguaStrategy

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=BaguaStrategy(algorithm, **OPTIONS[algorithm]),
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=save_in is not None,
        callbacks=[ModelCheckpoint(dirpath=save_in, filename=algorithm)] if save_in is not None else [],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Regression(algorithm, seed)
    trainer.fit(module, ckpt_path=checkpoint)
    return trainer, module.net


def params_of(module: nn.Module, prefix: str) -> dict[str, np.ndarray]:
    return {f"{prefix}/{name}": p.detach().numpy().copy() for name, p in module.named_parameters()}


def with_bagua(algorithm: str, seed: int, rank: int, epochs: int) -> dict[str, np.ndarray]:
    """The reference: the wrapper on this rank's rows, the same batches."""
    import bagua_torch
    from bagua_torch.algorithms import get_algorithm

    model = make_model(seed)
    optimizer = make_optimizer(algorithm, model.parameters())
    options = {"optimizer": optimizer} if algorithm in ADAM else OPTIONS[algorithm]
    wrapped = bagua_torch.with_bagua(model, [optimizer], get_algorithm(algorithm, **options))
    data = dataset(seed)
    for _ in range(epochs):
        for x, y in torch.utils.data.DataLoader(data, batch_size=BATCH, sampler=sampler(data, rank)):
            optimizer.zero_grad()
            nn.functional.mse_loss(wrapped(x), y).backward()
            optimizer.step()
    wrapped.close()
    return params_of(model, f"{algorithm}/with_bagua")


def main(out: Path, seed: int, algorithms: list[str]) -> None:
    torch.set_num_threads(1)
    results: dict[str, np.ndarray] = {}
    for algorithm in algorithms:
        trainer, _ = fit(algorithm, seed, 1, save_in=out)
        rank, path = trainer.global_rank, str(out / f"{algorithm}.ckpt")
        results.update(params_of(fit(algorithm, seed, 2, path)[1], f"{algorithm}/resumed"))
        if algorithm == "bytegrad":
            if rank == 0:
                saved = torch.load(path, weights_only=True)
                del saved["bagua"]
                torch.save(saved, path + ".lightning_only")
            trainer.strategy.barrier()
            resumed = fit(algorithm, seed, 2, path + ".lightning_only")[1]
            results.update(params_of(resumed, f"{algorithm}/resumed_without_bagua_state"))
        results.update(with_bagua(algorithm, seed, rank, 2))
    np.savez(out / f"rank{rank}.npz", **results)


if __name__ == "__main__":
    main(Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:])

"""A PyTorch Lightning 2.x strategy that trains with any Bagua algorithm: ``Trainer(strategy=BaguaStrategy(...))``.

::

    trainer = Trainer(accelerator="cpu", devices=2, strategy=BaguaStrategy("bytegrad", error_feedback=True))
    trainer.fit(model)

It is Lightning's DDP strategy (its launcher, cluster environments, collectives for logging and
``barrier``) with the model wrapped by :class:`bagua_torch.BaguaModule` instead of torch's DDP,
so every algorithm of :func:`bagua_torch.algorithms.available_algorithms` runs, the
weight-averaging ones included. Lightning's launcher starts the processes, or ``bagua-launch``
(or any launcher that sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``) does and Lightning joins
them. QAdam and 1-bit Adam are built on the optimizer ``configure_optimizers`` returns (a
``QAdamOptimizer`` / ``OneBitAdamOptimizer``).

Lightning runs the training step and backward inside ``optimizer.step(closure)``; the strategy runs
the closure first, so the wrapper's step hooks come after the backward pass as the algorithms
expect (closures evaluated several times, as LBFGS does, are not supported). A checkpoint holds,
besides Lightning's own entries, every rank's wrapped-model state (parameters and the algorithm's
state) and optimizer state under ``"bagua"``, gathered to rank 0, so a resumed run goes on exactly
as the saved one would have, decentralized replicas and error-feedback residuals included.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

import bagua_torch
from bagua_common.algorithms.registry import check_options
from bagua_torch.algorithms import Algorithm, algorithm_class
from bagua_torch.bagua_module import BaguaModule, SyncPoint
from bagua_torch.broadcast import broadcast_tensors
from bagua_torch.bucketing import DEFAULT_BUCKET_BYTES

__all__ = ["BaguaStrategy"]


class BaguaStrategy(DDPStrategy):
    """Lightning's DDP strategy with the model trained by a Bagua ``algorithm`` (a name with keyword ``options``,
    or an :class:`~bagua_torch.algorithms.Algorithm`); ``bucket_bytes`` and ``sync_point`` are
    :class:`~bagua_torch.BaguaModule`'s, the other arguments Lightning's ``DDPStrategy``'s."""

    strategy_name = "bagua"

    def __init__(
        self,
        algorithm: str | Algorithm = "gradient_allreduce",
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        sync_point: SyncPoint = "backward",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = None,
        start_method: str = "popen",
        **options: Any,
    ):
        if isinstance(algorithm, str):
            check_options(algorithm_class(algorithm), options)  # an unknown name or option fails here, not in the ranks
        elif options:
            raise TypeError(f"BaguaStrategy: options {sorted(options)} can only be given with an algorithm name")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            start_method=start_method,
            **({} if timeout is None else {"timeout": timeout}),
        )
        self._algorithm, self._options = algorithm, options
        self._bucket_bytes, self._sync_point = bucket_bytes, sync_point
        self._wrapped: BaguaModule | None = None  # kept after teardown: trainer.save_checkpoint after fit

    def setup_distributed(self) -> None:
        """Lightning's ``torch.distributed`` set-up, then Bagua's communicators on it (unless the script made them)."""
        super().setup_distributed()
        if not bagua_torch.is_initialized():
            bagua_torch.init_process_group(
                rank=self.global_rank,
                world_size=self.world_size,
                local_rank=self.local_rank,
                local_world_size=self.num_processes,
                timeout=self._timeout,
            )

    def setup(self, trainer: pl.Trainer) -> None:
        """Move the model to the device; when fitting, build the optimizers and wrap the model with the algorithm
        (which needs them); otherwise make every rank's weights rank 0's, as Lightning's DDP does."""
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
            self.model = self._wrapped = BaguaModule(
                self.model,
                self.optimizers,
                self._algorithm,
                bucket_bytes=self._bucket_bytes,
                sync_point=self._sync_point,
                **self._options,
            )
        else:
            world = bagua_torch.get_process_group().world
            broadcast_tensors(world, list(self.model.parameters()) + list(self.model.buffers()))
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], Any],
        model: Any = None,
        **kwargs: Any,
    ) -> Any:
        """Run Lightning's closure (training step and backward), then step with its result (see the module
        docstring)."""
        result = closure()
        return super().optimizer_step(optimizer, lambda: result, model, **kwargs)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's gradient accumulation: the wrapper's ``no_sync``."""
        if isinstance(self.model, BaguaModule):
            with self.model.no_sync():
                yield
        else:
            yield

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Add every rank's wrapped-model and optimizer state under ``"bagua"`` (a collective), then let rank 0
        write the file."""
        if self._wrapped is not None:
            checkpoint["bagua"] = {"algorithm": self._wrapped.algorithm.name, "ranks": self._gathered_states()}
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def _gathered_states(self) -> list[torch.Tensor]:
        """Each rank's ``torch.save`` of its states, as uint8 tensors, gathered from all ranks."""
        buffer = io.BytesIO()
        torch.save(
            {"model": self._wrapped.state_dict(), "optimizers": [o.state_dict() for o in self.optimizers]}, buffer
        )
        mine = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(self.root_device)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.root_device) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([mine.numel()], device=self.root_device))
        longest = int(max(sizes).item())
        padded = torch.nn.functional.pad(mine, (0, longest - mine.numel()))
        gathered = [torch.empty(longest, dtype=torch.uint8, device=self.root_device) for _ in range(self.world_size)]
        dist.all_gather(gathered, padded)
        return [t[: int(n.item())].cpu() for t, n in zip(gathered, sizes)]

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Lightning's optimizer states, then this rank's own states from ``"bagua"`` where the checkpoint has them
        (the safe ``weights_only`` loader reads them)."""
        super().load_optimizer_state_dict(checkpoint)
        saved = checkpoint.get("bagua")
        if saved is None or not isinstance(self.model, BaguaModule):
            return
        if saved["algorithm"] != self.model.algorithm.name or len(saved["ranks"]) != self.world_size:
            raise ValueError(
                f"BaguaStrategy: the checkpoint was saved by {saved['algorithm']!r} on {len(saved['ranks'])} ranks; "
                f"this run trains {self.model.algorithm.name!r} on {self.world_size}"
            )
        blob = saved["ranks"][self.global_rank].numpy().tobytes()
        state = torch.load(io.BytesIO(blob), map_location=self.root_device, weights_only=True)
        self.model.load_state_dict(state["model"])
        for optimizer, optimizer_state in zip(self.optimizers, state["optimizers"]):
            optimizer.load_state_dict(optimizer_state)

    def teardown(self) -> None:
        """Stop the wrapper's threads and unwrap the model."""
        if isinstance(self.model, BaguaModule):
            self.model.close()
            self.model = self.lightning_module
        super().teardown()

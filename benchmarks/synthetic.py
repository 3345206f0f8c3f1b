"""Synthetic data-parallel training throughput of Bagua's algorithms next to the plain baselines.

What is measured
----------------
In the style of Horovod's and Bagua's synthetic benchmarks: a model trains on one fixed
batch of random "images" (``--image-size`` square, 3 channels) and random labels per
rank, so the data pipeline costs nothing and every second goes to compute and
communication. Two models, the same architecture and the same initial weights
(NumPy, seed 0) in both frameworks:

    mlp   (default) flattened image -> ``--layers`` dense layers of ``--width`` with ReLU
          -> 10 classes; about 6.3 M parameters (25 MB of fp32 gradient) by default, so
          the gradient is large relative to the compute and communication matters.
    cnn   a small conv net: conv3x3(3->32) relu maxpool2, conv3x3(32->64) relu maxpool2,
          dense(->``--width``/8) relu, dense(->10).

Each algorithm runs in its own job of ``--nproc`` processes, one CPU device (or GPU)
per process: ``--warmup-iters`` untimed iterations, then ``--iters`` timed ones, each of
``--batches-per-iter`` training steps of ``--batch-size`` images per process. Every rank
times every iteration (waiting on the results: ``block_until_ready`` in JAX) and the
script reports, per algorithm, images/s per device (the mean over ranks, then the mean
over iterations with a 95% interval ``1.96 * std / sqrt(iters)``) and in total
(per device x processes), and each algorithm's speed relative to

* the baseline a user would otherwise write, measured in the same run: PyTorch's
  ``torch.nn.parallel.DistributedDataParallel`` (gloo) for ``--framework torch``, and a
  plain ``jax.shard_map`` step differentiating the ``jax.lax.pmean`` of the loss over all
  processes' devices (``jax.distributed`` with gloo CPU collectives) for ``--framework jax``;
* Bagua's own ``gradient_allreduce`` (plain fp32 allreduce) measured in the same run.

How the jobs run
----------------
The script launches itself: for each algorithm it starts
``bagua-launch --nproc-per-node N [--mpi] benchmarks/synthetic.py --worker ...`` and
collects the ranks' timings from files.

* JAX, Bagua algorithms: ``bagua-launch --mpi`` (mpiexec); ``DataParallel`` with the
  native MPI communicator (``NativeCommunicator.world()``), one CPU device per process.
  With ``--jax-comm gloo``: plain ``bagua-launch`` and ``DataParallel(mesh=...)`` over every
  process's device (``jax.distributed`` + gloo, JAX's own collectives); no ``async`` there.
  ``async`` also runs its background averager (``algorithm.averager``) over a second MPI
  communicator; its steps do not wait for the averaging, so it measures local steps.
  QAdam and OneBitAdam are optimizers themselves (Adam with ``--lr``); the others use
  SGD with momentum 0.9. The warm-up phases of QAdam and OneBitAdam (full-precision
  steps) end within the benchmark's warm-up iterations, so the timed steps are the
  compressed ones.
* JAX baseline ``pmean``: plain ``bagua-launch`` (no MPI); ``jax.distributed.initialize``
  at the launcher's ``MASTER_ADDR:MASTER_PORT`` with ``jax_cpu_collectives_implementation
  = "gloo"``, a 1-D mesh over ``jax.devices()`` and a ``shard_map`` step.
* torch: plain ``bagua-launch``, gloo. Bagua algorithms by name through
  ``bagua_torch.with_bagua(model, [optimizer], name)`` after
  ``bagua_torch.init_process_group("gloo")``; names the registry does not have in this
  installation (``bagua_torch.algorithms.available_algorithms()``) are skipped with a note.

``decentralized_shift_one`` names ``decentralized`` with ``peer_selection_mode="shift_one"``
(the registry's default is ``"all"``) in both frameworks. With ``--convergence-steps N`` every
job then trains a digits MLP (scikit-learn's, standardized pixels) with the same algorithm for
N steps and records each rank's loss per step; the results report the training loss over the
last 10 steps (``digits_loss``), which ``benchmarks/network_study.py`` tables next to speed.

Every process gets ``JAX_PLATFORMS=cpu`` (with ``--device cpu``, the default) and an
``XLA_FLAGS`` without ``--xla_force_host_platform_device_count``, so each has exactly one
device. torch uses ``--threads`` intra-op threads per process (default: cores / processes,
at least 1). With more processes than cores the machine is oversubscribed; the results
say so.

How to run
----------
    python benchmarks/synthetic.py --framework jax --algorithm all --nproc 2
    python benchmarks/synthetic.py --framework torch --algorithm bytegrad --nproc 4 --model cnn
    python benchmarks/synthetic.py --framework torch --algorithm all --nproc 2 --plot

It shows a progress bar while the jobs run, prints each algorithm's result and a final
table, and writes ``synthetic-<framework>-<N>proc[-<model>].json`` and ``.md`` (device,
versions, date, exact command, settings) to ``--out`` (default ``benchmarks/results/``),
plus a ``.png`` bar chart with ``--plot`` (needs matplotlib). Each job's output is kept in
``<out>/logs/`` only when it fails (``--keep-logs`` keeps all).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import harness.results
import numpy as np
from harness import plots
from harness.console import Progress
from harness.links import bytes_sent
from harness.machine import device_info
from harness.options import add_out_option
from harness.results import finish_meta, header_lines, run_meta

FRAMEWORKS = ("jax", "torch")
# "gpt-<size>": the project's GPT (bagua_common.workload) of that size on windows of its corpus.
MODELS = ("mlp", "cnn", "gpt-tiny", "gpt-small", "gpt-gpt2")
BASELINES = {"jax": "pmean", "torch": "ddp"}
BASELINE_LABELS = {"pmean": "jax.lax.pmean (shard_map)", "ddp": "torch DDP"}
REFERENCE = "gradient_allreduce"
# Every algorithm name of Bagua, in the order of the table (the baseline comes first).
ALGORITHM_NAMES = (
    "gradient_allreduce",
    "bytegrad",
    "decentralized",
    "low_precision_decentralized",
    "async",
    "qadam",
    "onebit_adam",
)
ADAM_ALGORITHMS = ("qadam", "onebit_adam")
# Job names for registry algorithms with non-default options, in both frameworks.
VARIANTS = {
    "decentralized_shift_one": ("decentralized", {"peer_selection_mode": "shift_one"}),
    "powersgd_rank1": ("powersgd", {"rank": 1}),
    "powersgd_rank4": ("powersgd", {"rank": 4}),
}
# Torch DDP with one of its built-in communication hooks: the peers a torch user picks on a slow network.
DDP_HOOKS = ("ddp_fp16", "ddp_bf16", "ddp_powersgd_rank1", "ddp_powersgd_rank4")
NUM_CLASSES = 10
CHANNELS = 3
HERE = Path(__file__).resolve()
# The settings a job's step time depends on, recorded with the results.
TIMING_SETTINGS = (
    "model",
    "batch_size",
    "width",
    "layers",
    "image_size",
    "lr",
    "warmup_iters",
    "iters",
    "batches_per_iter",
    "threads",
)
# What a job passes on to its worker processes: the timing settings and the rest of the run's.
WORKER_OPTIONS = (
    *TIMING_SETTINGS,
    "comm_timeout",
    "device",
    "jax_comm",
    "convergence_steps",
    "digits_batch",
    "digits_hidden",
    "digits_lr",
    "digits_adam_lr",
)


# --------------------------------------------------------------------------- models


def init_params(model: str, image_size: int, width: int, layers: int, seed: int = 0) -> list[np.ndarray]:
    """The initial weights as a flat list of float32 arrays (the same in both frameworks).

    Dense weights are ``[in, out]`` (torch's Linear takes the transpose); conv weights are
    ``[out, in, kh, kw]`` (OIHW, torch's layout). He-uniform weights, zero biases.
    """
    if model.startswith("gpt-"):
        from bagua_common.workload.gpt_spec import init_gpt_params

        return list(init_gpt_params(model.removeprefix("gpt-"), seed).values())
    rng = np.random.default_rng(seed)

    def uniform(shape: tuple[int, ...], fan_in: int) -> np.ndarray:
        bound = math.sqrt(6.0 / fan_in)
        return rng.uniform(-bound, bound, shape).astype(np.float32)

    params: list[np.ndarray] = []
    if model == "mlp":
        sizes = [CHANNELS * image_size * image_size] + [width] * layers + [NUM_CLASSES]
        for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
            params += [uniform((fan_in, fan_out), fan_in), np.zeros(fan_out, np.float32)]
        return params
    if image_size % 4:
        raise ValueError(f"--model cnn needs an image size divisible by 4, got {image_size}")
    hidden = max(16, width // 8)
    flat = 64 * (image_size // 4) ** 2
    params += [uniform((32, CHANNELS, 3, 3), CHANNELS * 9), np.zeros(32, np.float32)]
    params += [uniform((64, 32, 3, 3), 32 * 9), np.zeros(64, np.float32)]
    params += [uniform((flat, hidden), flat), np.zeros(hidden, np.float32)]
    params += [uniform((hidden, NUM_CLASSES), hidden), np.zeros(NUM_CLASSES, np.float32)]
    return params


def random_batch(batch_size: int, image_size: int, rank: int, model: str = "mlp") -> tuple[np.ndarray, np.ndarray]:
    """One rank's fixed batch: NCHW float32 images and int labels; for a GPT, windows of its context plus one
    corpus bytes and the flat next bytes (the labels of its flat logits)."""
    if model.startswith("gpt-"):
        from bagua_common.workload import gpt_config, load_corpus

        tokens = load_corpus().batch(0, 0, rank, batch_size, gpt_config(model.removeprefix("gpt-")).context + 1)
        return tokens, tokens[:, 1:].reshape(-1)
    rng = np.random.default_rng(1000 + rank)
    x = rng.standard_normal((batch_size, CHANNELS, image_size, image_size), dtype=np.float32)
    y = rng.integers(0, NUM_CLASSES, batch_size).astype(np.int32)
    return x, y


def jax_model(model: str):
    """``loss_fn(params, batch)`` of the model in JAX (params: the list of init_params)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax import lax

    if model.startswith("gpt-"):
        from bagua_common.workload import gpt_config
        from bagua_jax.models.gpt import gpt_loss_fn

        size = model.removeprefix("gpt-")
        names, next_token_loss = list(gpt_config(size).parameter_shapes()), gpt_loss_fn(size)

        def gpt_loss(params, batch):
            return next_token_loss(dict(zip(names, params)), {"tokens": batch[0]})

        return gpt_loss

    def conv(x, w, b):
        y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return y + b[None, :, None, None]

    def pool(x):
        return lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")

    def logits(params, x):
        if model == "cnn":
            x = pool(jax.nn.relu(conv(x, params[0], params[1])))
            x = pool(jax.nn.relu(conv(x, params[2], params[3])))
            dense = params[4:]
        else:
            dense = params
        x = x.reshape(x.shape[0], -1)
        for i in range(0, len(dense) - 2, 2):
            x = jax.nn.relu(x @ dense[i] + dense[i + 1])
        return x @ dense[-2] + dense[-1]

    def loss_fn(params, batch):
        x, y = batch
        return optax.softmax_cross_entropy_with_integer_labels(logits(params, x), y).mean()

    return loss_fn


def torch_model(model: str, params: Sequence[np.ndarray]):
    """The model as a ``torch.nn.Module`` holding ``params`` (a GPT's returns its logits flat, one row per token)."""
    import torch
    from torch import nn

    if model.startswith("gpt-"):
        from bagua_common.workload import gpt_config
        from bagua_torch.models.gpt import GPT

        class FlatLogits(nn.Module):
            def __init__(self, gpt: nn.Module):
                super().__init__()
                self.gpt = gpt

            def forward(self, tokens: torch.Tensor) -> torch.Tensor:
                logits = self.gpt(tokens[:, :-1])
                return logits.reshape(-1, logits.shape[-1])

        size = model.removeprefix("gpt-")
        return FlatLogits(GPT(size, dict(zip(gpt_config(size).parameter_shapes(), params))))
    if model == "cnn":
        hidden, flat = params[4].shape[1], params[4].shape[0]
        net = nn.Sequential(
            nn.Conv2d(CHANNELS, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(flat, hidden),
            nn.ReLU(),
            nn.Linear(hidden, NUM_CLASSES),
        )
        layers = [net[0], net[3], net[7], net[9]]
    else:
        mods: list[nn.Module] = [nn.Flatten()]
        for i in range(0, len(params), 2):
            fan_in, fan_out = params[i].shape
            mods.append(nn.Linear(fan_in, fan_out))
            if i + 2 < len(params):
                mods.append(nn.ReLU())
        net = nn.Sequential(*mods)
        layers = [m for m in net if isinstance(m, nn.Linear)]
    with torch.no_grad():
        for layer, (w, b) in zip(layers, zip(params[0::2], params[1::2]), strict=True):
            weight = torch.from_numpy(w if w.ndim == 4 else w.T.copy())
            layer.weight.copy_(weight)
            layer.bias.copy_(torch.from_numpy(b))
    return net


# --------------------------------------------------------------------------- workers


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _rate_line(rank: int, i: int, total: int, rate: float) -> None:
    if rank == 0:
        print(f"iter {i + 1}/{total}: {rate:.1f} img/s per device (rank 0)", flush=True)


@dataclasses.dataclass
class RankJob:
    """One rank's training loop pieces: ``state, loss = step(state, place(x, y))``, then ``finish(state)``."""

    step: Callable[[Any, Any], tuple[Any, Any]]
    place: Callable[[np.ndarray, np.ndarray], Any]
    state: Any
    finish: Callable[[Any], None]


def algorithm_spec(name: str) -> tuple[str, dict[str, Any]]:
    """The registry name and options behind a job name (``decentralized_shift_one`` is ``decentralized``
    with ``peer_selection_mode="shift_one"``; the registry's default is ``"all"``)."""
    return VARIANTS.get(name, (name, {}))


def worker_jax(args: argparse.Namespace) -> dict[str, Any]:
    """One rank of a JAX job; returns its timings (and digits losses with --convergence-steps)."""
    import jax

    rank, size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    on_mesh = args.algorithm == BASELINES["jax"] or args.jax_comm == "gloo"
    if on_mesh and size > 1:
        if jax.config.jax_platforms in (None, "", "cpu"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            num_processes=size,
            process_id=rank,
        )
    setup = _jax_pmean_setup if args.algorithm == BASELINES["jax"] else _jax_bagua_setup
    params = init_params(args.model, args.image_size, args.width, args.layers)
    job = setup(args, rank, size, jax_model(args.model), params, args.lr, _algorithm_warmup_steps(args))
    return _measure_job(
        args,
        rank,
        size,
        job,
        lambda lr, warmup: setup(args, rank, size, jax_model("mlp"), digits_params(args.digits_hidden), lr, warmup),
        jax.block_until_ready,
    )


def _jax_pmean_setup(
    args: argparse.Namespace, rank: int, size: int, loss_fn, params, lr: float, warmup_steps: int
) -> RankJob:
    """The baseline: a shard_map step with lax.pmean over every process's device."""
    import jax
    import optax
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    tx = optax.sgd(lr, momentum=0.9)
    devices = jax.devices()
    if len(devices) != size or jax.local_device_count() != 1:
        raise RuntimeError(
            f"expected one device per process, got {len(devices)} devices over {size} processes "
            f"({jax.local_device_count()} local)"
        )
    mesh = Mesh(np.array(devices), ("d",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))

    def per_device(params, opt_state, batch):
        # Differentiating the mean loss: the parameters are replicated (invariant over "d"), so
        # AD already all-reduces their gradient; a pmean of a per-device loss's gradient would
        # get that sum and reduce it again (twice the traffic, n times the gradient).
        loss, grads = jax.value_and_grad(lambda p: lax.pmean(loss_fn(p, batch), "d"))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    sharded = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=(P(), P(), P())),
        donate_argnums=(0, 1),
    )

    def replicate(leaf):
        leaf = np.asarray(leaf)
        return jax.make_array_from_callback(leaf.shape, replicated, lambda index: leaf[index])

    params = [replicate(p) for p in params]
    opt_state = jax.jit(tx.init, out_shardings=replicated)(params)

    def place(x, y):
        return jax.make_array_from_process_local_data(split, x), jax.make_array_from_process_local_data(split, y)

    def step(state, batch):
        params, opt_state, loss = sharded(state[0], state[1], batch)
        return (params, opt_state), loss

    return RankJob(step, place, (params, opt_state), lambda state: None)


def _jax_bagua_setup(
    args: argparse.Namespace, rank: int, size: int, loss_fn, params, lr: float, warmup_steps: int
) -> RankJob:
    """A Bagua algorithm: DataParallel over the native (MPI) communicator, or over a mesh of every
    process's device (JAX's collectives over gloo) with ``--jax-comm gloo``."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh

    from bagua_jax import NativeCommunicator
    from bagua_jax.algorithms import AsyncModelAverage, make_algorithm
    from bagua_jax.trainer import DataParallel

    name, options = algorithm_spec(args.algorithm)
    if name in ADAM_ALGORITHMS:
        options["warmup_steps"] = warmup_steps
    if name == "powersgd":
        options["start_iter"] = warmup_steps
    algorithm = make_algorithm(name, learning_rate=lr, **options)
    optimizer = None if name in ADAM_ALGORITHMS else optax.sgd(lr, momentum=0.9)
    if args.jax_comm == "gloo":
        if isinstance(algorithm, AsyncModelAverage):
            raise SystemExit("async averages in a background thread over the native engine; use --jax-comm mpi")
        trainer = DataParallel(loss_fn, optimizer, algorithm, mesh=Mesh(np.array(jax.devices()), ("d",)))

        def place(x, y):
            return trainer.shard_batch((x, y))

        return RankJob(trainer.step, place, trainer.init(params), lambda state: None)
    comm = NativeCommunicator.world(timeout=args.comm_timeout)
    if comm.size != size:
        raise RuntimeError(f"the MPI world has {comm.size} ranks, the launcher says {size}")
    trainer = DataParallel(loss_fn, optimizer, algorithm, communicator=comm)
    state = trainer.init(params)
    averager = None
    if isinstance(algorithm, AsyncModelAverage):
        averager = algorithm.averager(state.params, NativeCommunicator.mpi_world(timeout=args.comm_timeout))

    def step(state, batch):
        state, loss = trainer.step(state, batch)
        if averager is not None:
            state = state._replace(params=averager.apply(state.params))
        return state, loss

    def finish(state):
        if averager is not None:
            averager.abort()
        comm.barrier(jnp.zeros((), jnp.float32))

    return RankJob(step, lambda x, y: (jnp.asarray(x), jnp.asarray(y)), state, finish)


def _algorithm_warmup_steps(args: argparse.Namespace) -> int:
    """Full-precision warm-up steps of QAdam / OneBitAdam: over before the timed iterations."""
    return max(1, args.warmup_iters * args.batches_per_iter // 2)


def worker_torch(args: argparse.Namespace) -> dict[str, Any]:
    """One rank of a torch job; returns its timings (and digits losses with --convergence-steps)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    rank, size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    torch.manual_seed(0)
    if args.algorithm in (BASELINES["torch"], *DDP_HOOKS):
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.comm_timeout))
    else:
        import bagua_torch

        bagua_torch.init_process_group("gloo", timeout=args.comm_timeout)
    params = init_params(args.model, args.image_size, args.width, args.layers)
    job = _torch_setup(args, torch_model(args.model, params), args.lr, _algorithm_warmup_steps(args))
    result = _measure_job(
        args,
        rank,
        size,
        job,
        lambda lr, warmup: _torch_setup(args, torch_model("mlp", digits_params(args.digits_hidden)), lr, warmup),
        lambda state: state,  # torch's steps return when done
    )
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return result


def _torch_setup(args: argparse.Namespace, net, lr: float, warmup_steps: int) -> RankJob:
    """DDP (the baseline) or a Bagua algorithm around ``net``, in an initialized process group."""
    import torch
    import torch.nn.functional as F

    if args.algorithm in (BASELINES["torch"], *DDP_HOOKS):
        optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
        # One bucket for DDP's PowerSGD hook: its second allreduce is issued from a callback, and
        # gloo matches collectives by issue order, so with several buckets it interleaves with the
        # next bucket's first on some ranks only (measured at 4 ranks: "Received data size doesn't match").
        one_bucket = {"bucket_cap_mb": 1024} if args.algorithm.startswith("ddp_powersgd") else {}
        model = torch.nn.parallel.DistributedDataParallel(net, **one_bucket)
        if args.algorithm != BASELINES["torch"]:
            _register_ddp_hook(model, args.algorithm, warmup_steps)
    else:
        import bagua_torch
        from bagua_torch.algorithms import get_algorithm

        name, options = algorithm_spec(args.algorithm)
        if name in ADAM_ALGORITHMS:
            # QAdam and OneBitAdam come with their own optimizer (Adam with averaged momentum).
            if name == "qadam":
                from bagua_torch.algorithms.qadam import QAdamOptimizer as opt_cls
            else:
                from bagua_torch.algorithms.onebit_adam import (
                    OneBitAdamOptimizer as opt_cls,
                )
            optimizer = opt_cls(net.parameters(), lr=lr, warmup_steps=warmup_steps)
            options["optimizer"] = optimizer
        else:
            optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
        if name == "powersgd":
            options["start_iter"] = warmup_steps
        model = bagua_torch.with_bagua(net, [optimizer], get_algorithm(name, **options))

    def step(state, batch):
        optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(batch[0]), batch[1])
        loss.backward()
        optimizer.step()
        return state, loss.detach()

    def finish(state):
        if hasattr(model, "close"):
            model.close()

    return RankJob(step, lambda x, y: (torch.from_numpy(x), torch.from_numpy(y).long()), None, finish)


def _register_ddp_hook(model, name: str, warmup_steps: int) -> None:
    """DDP's built-in hook called ``name``; PowerSGD configured like ours (rank, exact steps first,
    error feedback, warm start)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    if name == "ddp_fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "ddp_bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    else:
        state = powersgd.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=int(name.removeprefix("ddp_powersgd_rank")),
            # torch needs > 1 with error feedback or warm start
            start_powerSGD_iter=max(2, warmup_steps),
            use_error_feedback=True,
            warm_start=True,
        )
        model.register_comm_hook(state, powersgd.powerSGD_hook)


def digits_params(hidden: int, seed: int = 0) -> list[np.ndarray]:
    """The digits MLP's initial weights (64 pixels -> ``hidden`` -> 10), in init_params' format."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in ((64, hidden), (hidden, NUM_CLASSES)):
        bound = math.sqrt(6.0 / fan_in)
        params += [rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32), np.zeros(fan_out, np.float32)]
    return params


def _measure_job(
    args: argparse.Namespace,
    rank: int,
    size: int,
    job: RankJob,
    digits_setup: Callable[[float, int], RankJob],
    wait: Callable[[Any], Any],
) -> dict[str, Any]:
    """Time ``job``'s steps on one random batch (``wait(state)`` returns once a run of steps is done), then with
    --convergence-steps train the digits MLP set up by ``digits_setup``; finishes the job."""
    batch = job.place(*random_batch(args.batch_size, args.image_size, rank, args.model))

    def run(n: int, state):
        for _ in range(n):
            state, _ = job.step(state, batch)
        return wait(state)

    result, state = _time_loop(args, rank, size, run, job.state)
    if args.convergence_steps:
        result["digits_losses"] = _digits_losses(args, rank, size, digits_setup)
    job.finish(state)
    return result


def _digits_losses(
    args: argparse.Namespace, rank: int, size: int, setup: Callable[[float, int], RankJob]
) -> list[float]:
    """Train a fresh digits MLP with the same algorithm for --convergence-steps steps; this rank's
    loss on its part of every global batch (the same global batches on every rank)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    # Standardized pixels: with raw [0, 1] pixels, a few coordinates keep a near-zero second
    # moment, and OneBitAdam (frozen variance, sign-compressed momentum) diverges after warm-up.
    x = digits.data.astype(np.float32)
    x, y = (x - x.mean(0)) / (x.std(0) + 1e-6), digits.target.astype(np.int32)
    name = algorithm_spec(args.algorithm)[0]
    lr = args.digits_adam_lr if name in ADAM_ALGORITHMS else args.digits_lr
    job = setup(lr, max(1, args.convergence_steps // 10))
    per_rank = args.digits_batch // size
    rng = np.random.default_rng(7)
    state, losses = job.state, []
    for _ in range(args.convergence_steps):
        index = rng.choice(len(x), per_rank * size, replace=False)[rank * per_rank : (rank + 1) * per_rank]
        state, loss = job.step(state, job.place(x[index], y[index]))
        losses.append(float(loss))
    job.finish(state)
    return losses


def _time_loop(args, rank: int, size: int, run, state) -> tuple[dict[str, Any], Any]:
    """Warm-up iterations, then timed ones; images/s per iteration on this rank, and the state."""
    start = time.perf_counter()
    for _ in range(args.warmup_iters):
        state = run(args.batches_per_iter, state)
    warmup_s = time.perf_counter() - start
    if rank == 0:
        print(f"warm-up done in {warmup_s:.1f} s", flush=True)
    rates = []
    sent_before = bytes_sent()
    for i in range(args.iters):
        t0 = time.perf_counter()
        state = run(args.batches_per_iter, state)
        rates.append(args.batch_size * args.batches_per_iter / (time.perf_counter() - t0))
        _rate_line(rank, i, args.iters, rates[-1])
    sent = (bytes_sent() - sent_before) / (args.iters * args.batches_per_iter)
    result = {"rank": rank, "size": size, "algorithm": args.algorithm, "rates": rates, "warmup_s": warmup_s}
    return {**result, "bytes_sent_per_step": sent}, state


def worker_main(args: argparse.Namespace) -> None:
    result = worker_jax(args) if args.framework == "jax" else worker_torch(args)
    rank = result["rank"]
    path = Path(f"{args.result}.rank{rank}")
    path.write_text(json.dumps(result) + "\n")
    if rank == 0:
        print(json.dumps({k: result[k] for k in ("algorithm", "size", "rates")}), flush=True)


# --------------------------------------------------------------------------- the parent


def child_environment(args: argparse.Namespace) -> dict[str, str]:
    """Each rank's environment: one device per process, JAX on the CPU (with --device cpu)."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    if args.device == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["CUDA_VISIBLE_DEVICES"] = ""
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE.parent.parent), env.get("PYTHONPATH", "")) if p)
    return env


def worker_command(args: argparse.Namespace, algorithm: str, result: Path) -> list[str]:
    launch = [
        sys.executable,
        "-m",
        "bagua_launch",
        "--nproc-per-node",
        str(args.nproc),
        "--timeout",
        str(args.job_timeout),
        "--grace",
        "5",
    ]
    if args.framework == "jax" and algorithm != BASELINES["jax"] and args.jax_comm == "mpi":
        launch.append("--mpi")
    options = {name: getattr(args, name) for name in WORKER_OPTIONS}
    return [*launch, str(HERE), *worker_arguments(args.framework, algorithm, result, options)]


def worker_arguments(framework: str, algorithm: str, result: Path, options: dict[str, Any]) -> list[str]:
    """One worker process's arguments: ``--worker``, its framework, algorithm and result file, then
    ``options`` as flags (``batch_size=8`` becomes ``--batch-size 8``); options left out keep
    their defaults."""
    argv = ["--worker", "--framework", framework, "--algorithm", algorithm, "--result", str(result)]
    for name, value in options.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def run_job(args: argparse.Namespace, algorithm: str, tmp: Path, bar: Progress, done: int) -> dict[str, Any]:
    """Launch one algorithm's job, follow its progress; its row of results."""
    result = tmp / f"{algorithm}.json"
    log = tmp / f"{algorithm}.log"
    cmd = worker_command(args, algorithm, result)
    start = time.perf_counter()
    iter_re = re.compile(rb"^\[rank 0\] iter (\d+)/", re.M)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_environment(args),
            cwd=HERE.parent.parent,
        )
        while proc.poll() is None:
            time.sleep(0.5)
            text = log.read_bytes()
            iters = [int(m) for m in iter_re.findall(text)]
            phase = (
                f"{iters[-1]}/{args.iters} iters"
                if iters
                else ("timing" if b"warm-up done" in text else "starting / warm-up")
            )
            bar.show(done + (iters[-1] / (args.iters + 1) if iters else 0.0), f"{algorithm}: {phase}")
            if time.perf_counter() - start > args.job_timeout + 30:
                proc.kill()
                proc.wait()
    wall = time.perf_counter() - start
    row: dict[str, Any] = {
        "algorithm": algorithm,
        "wall_s": round(wall, 1),
        "command": harness.results.command_line(cmd),
    }
    ranks = []
    for r in range(args.nproc):
        path = Path(f"{result}.rank{r}")
        if path.exists():
            ranks.append(json.loads(path.read_text()))
    if proc.returncode != 0 and len(ranks) == args.nproc:
        # Every rank wrote its timings, then the job failed on the way out (seen: a crash in
        # the MPI engine's shutdown); the measurement stands, the failure is reported with it.
        tail = log.read_text(errors="replace").splitlines()
        signal_line = next((line for line in tail if "EXIT STRING" in line), "")
        row["exit_note"] = (
            f"the job exited with code {proc.returncode} after every rank had written its "
            f"timings{': ' + signal_line.split(':', 1)[1].strip() if signal_line else ''}"
        )
        _keep_log(args, log, algorithm)
    if proc.returncode != 0 and len(ranks) != args.nproc:
        row["status"] = "failed"
        tail = log.read_text(errors="replace").splitlines()[-args.tail_lines :]
        row["error"] = f"exit code {proc.returncode}; " + " | ".join(line.strip() for line in tail[-3:])
        row["log_tail"] = tail
        row["retry"] = b"EADDRINUSE" in log.read_bytes() or b"address already in use" in log.read_bytes()
        _keep_log(args, log, algorithm)
        return row
    if args.keep_logs:
        _keep_log(args, log, algorithm)
    per_iter = np.mean(np.array([r["rates"] for r in ranks]), axis=0)  # mean over ranks, per iteration
    mean = float(np.mean(per_iter))
    ci = 1.96 * float(np.std(per_iter, ddof=1)) / math.sqrt(len(per_iter)) if len(per_iter) > 1 else float("nan")
    row.update(
        {
            "status": "ok",
            "per_device": mean,
            "per_device_ci95": ci,
            "total": mean * args.nproc,
            "total_ci95": ci * args.nproc,
            "per_iteration_per_device": [float(v) for v in per_iter],
            "per_rank_mean": [float(np.mean(r["rates"])) for r in ranks],
            "warmup_s": max(r["warmup_s"] for r in ranks),
        }
    )
    if args.convergence_steps:
        row["digits_loss"] = digits_loss(ranks)
    return row


def digits_loss(ranks: Sequence[dict[str, Any]], last: int = 10) -> float:
    """The digits training loss after --convergence-steps steps: each rank's mean over its last
    ``last`` steps (smoothing the batch-to-batch noise), averaged over the ranks."""
    return float(np.mean([np.mean(r["digits_losses"][-last:]) for r in ranks]))


def _keep_log(args: argparse.Namespace, log: Path, algorithm: str) -> None:
    keep = args.out / "logs"
    keep.mkdir(parents=True, exist_ok=True)
    shutil.copy(log, keep / f"synthetic-{args.framework}-{args.nproc}proc{_model_suffix(args)}-{algorithm}.log")


def _model_suffix(args: argparse.Namespace) -> str:
    return "" if args.model == "mlp" else f"-{args.model}"


def _pm(value: float | None, ci: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.1f} ± {ci:.1f}" if ci is not None and not math.isnan(ci) else f"{value:.1f}"


def _ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def add_ratios(rows: list[dict[str, Any]], framework: str) -> None:
    speeds = {r["algorithm"]: r.get("total") for r in rows if r.get("status") == "ok"}
    base, ref = speeds.get(BASELINES[framework]), speeds.get(REFERENCE)
    for r in rows:
        total = r.get("total") if r.get("status") == "ok" else None
        r["vs_baseline"] = total / base if total and base else None
        r["vs_gradient_allreduce"] = total / ref if total and ref else None


def table_lines(rows: Sequence[dict[str, Any]], framework: str) -> list[str]:
    base = BASELINE_LABELS[BASELINES[framework]]
    lines = [
        f"| algorithm | img/s per device | img/s total | vs {base} | vs gradient_allreduce |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        name = r["algorithm"] + (f" (baseline: {base})" if r["algorithm"] == BASELINES[framework] else "")
        if r.get("status") != "ok":
            lines.append(f"| {name} | {r.get('status')} | — | — | — |")
            continue
        lines.append(
            f"| {name} | {_pm(r['per_device'], r['per_device_ci95'])} | "
            f"{_pm(r['total'], r['total_ci95'])} | {_ratio(r['vs_baseline'])} | "
            f"{_ratio(r['vs_gradient_allreduce'])} |"
        )
    return lines


def print_table(rows: Sequence[dict[str, Any]], framework: str, nproc: int) -> None:
    base = BASELINES[framework]
    print(f"\n{'algorithm':<30}{'img/s/device':>18}{'img/s total':>20}{'vs ' + base:>10}{'vs allreduce':>14}")
    for r in rows:
        if r.get("status") != "ok":
            print(f"{r['algorithm']:<30}{r.get('status', '?'):>18}")
            continue
        print(
            f"{r['algorithm']:<30}{_pm(r['per_device'], r['per_device_ci95']):>18}"
            f"{_pm(r['total'], r['total_ci95']):>20}{_ratio(r['vs_baseline']):>10}"
            f"{_ratio(r['vs_gradient_allreduce']):>14}"
        )
    print(f"({nproc} processes; ± is the 95% interval over the timed iterations)")


def parameter_count(args: argparse.Namespace) -> int:
    return int(sum(p.size for p in init_params(args.model, args.image_size, args.width, args.layers)))


def write_results(args: argparse.Namespace, meta: dict[str, Any], rows: list[dict[str, Any]]) -> list[Path]:
    stem = f"synthetic-{args.framework}-{args.nproc}proc" + _model_suffix(args)
    base = BASELINE_LABELS[BASELINES[args.framework]]
    s = meta["settings"]
    md = [
        f"# Bagua synthetic benchmark: {args.framework}, {args.nproc} processes, {args.model}",
        "",
        *header_lines(meta),
        (
            f"- model: {args.model} ({meta['parameters']:,} parameters, {meta['parameters'] * 4 / 1e6:.1f} MB fp32 "
            f"gradient); batch {s['batch_size']} per process of {s['image_size']}x{s['image_size']}x3 random images"
        ),
        (
            f"- {s['warmup_iters']} warm-up iterations, then {s['iters']} timed iterations of "
            f"{s['batches_per_iter']} steps; torch threads per process: {s['threads']}"
        ),
        f"- total time {meta['total_s']:.0f} s",
    ]
    if meta["load_average_before"][0] >= meta["device"]["cores"]:  # after it, the load is mostly the run's own ranks
        md.append(
            f"- **busy machine**: the load average was at or above the core count ({meta['device']['cores']}) "
            "before the run (other work on the machine), so the timings are noisy and ratios between "
            "rows measured at different moments are uncertain beyond the intervals shown"
        )
    if meta["oversubscribed"]:
        md.append(
            f"- **oversubscribed**: {args.nproc} processes on {meta['device']['cores']} cores, so the "
            "processes share cores and these figures measure contention as much as communication"
        )
    md += [
        "",
        "img/s per device is the mean over ranks and then over the timed iterations, ± the 95% interval",
        "(1.96 std / sqrt(iterations)); total = per device x processes. Ratios are total img/s over the",
        f"baseline's ({base}) and over Bagua's gradient_allreduce, both measured in this run.",
        "`async` steps do not wait for its background weight averaging, so it measures local steps.",
        "",
        *table_lines(rows, args.framework),
        "",
    ]
    notes = meta.get("notes", [])
    failed = [r for r in rows if r.get("status") == "failed"]
    if notes or failed or any(r.get("exit_note") or r.get("retried_after") for r in rows):
        md += ["## Notes", ""] + [f"- {n}" for n in notes]
        md += [f"- {r['algorithm']} failed: {r.get('error', '')}" for r in failed]
        md += [f"- {r['algorithm']}: {r['exit_note']}" for r in rows if r.get("exit_note")]
        md += [
            f"- {r['algorithm']}: retried once after EADDRINUSE (port race with another program)"
            for r in rows
            if r.get("retried_after")
        ]
        md.append("")
    paths = list(harness.results.write_results(args.out, stem, md, {**meta, "results": rows}))
    if args.plot:
        png = plot(args, rows, args.out / f"{stem}.png", meta)
        if png:
            paths.append(png)
    return paths


def plot(args: argparse.Namespace, rows: Sequence[dict[str, Any]], path: Path, meta: dict[str, Any]) -> Path | None:
    ok = [r for r in rows if r.get("status") == "ok"]
    drawn = plots.figure(size=(max(6.0, 1.1 * len(ok) + 2), 4.5)) if ok else None  # nothing to chart without a job
    if drawn is None:
        return None
    names = [r["algorithm"] for r in ok]
    colors = [
        "tab:gray" if n == BASELINES[args.framework] else "tab:blue" if n == REFERENCE else "tab:orange" for n in names
    ]
    fig, ax = drawn[0], drawn[1][0][0]
    bars = ax.bar(names, [r["total"] for r in ok], yerr=[r["total_ci95"] for r in ok], capsize=4, color=colors)
    for bar, r in zip(bars, ok):
        if r.get("vs_baseline"):
            ax.annotate(
                f"{r['vs_baseline']:.2f}x",
                (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                ha="center",
                va="bottom",
                fontsize=8,
                xytext=(0, 3),
                textcoords="offset points",
            )
    ax.set_ylabel("images/s, all processes (95% interval)")
    over = " (oversubscribed)" if meta["oversubscribed"] else ""
    ax.set_title(
        f"{args.framework}, {args.model}, {args.nproc} processes on {meta['device']['cores']} "
        f"{meta['device']['kind']} cores{over}\nratios vs {BASELINE_LABELS[BASELINES[args.framework]]}",
        fontsize=10,
    )
    ax.tick_params(axis="x", labelrotation=30)
    for label in ax.get_xticklabels():
        label.set_horizontalalignment("right")
    return plots.save(fig, path, dpi=110)


def select_algorithms(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The jobs to run (the baseline and gradient_allreduce first) and notes on skipped names."""
    base = BASELINES[args.framework]
    wanted = [base, *ALGORITHM_NAMES] if args.algorithm == ["all"] else list(args.algorithm)
    if args.framework == "jax":
        from bagua_jax.algorithms import algorithm_names

        available = algorithm_names()
    else:
        from bagua_torch.algorithms import available_algorithms

        available = available_algorithms()
    jobs, notes = [], []
    for name in dict.fromkeys(wanted):
        if name == base or algorithm_spec(name)[0] in available or (args.framework == "torch" and name in DDP_HOOKS):
            jobs.append(name)
        elif name in ALGORITHM_NAMES:
            notes.append(f"{name}: not available in this installation's {args.framework} registry; skipped")
        else:
            raise SystemExit(
                f"unknown algorithm {name!r} for --framework {args.framework}; "
                f"choose from {', '.join([base, *available])} or all"
            )
    return jobs, notes


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--framework", choices=FRAMEWORKS, default="jax", help="jax (default) or torch")
    parser.add_argument(
        "--algorithm",
        nargs="+",
        default=["all"],
        metavar="NAME",
        help="algorithm names, the baseline (pmean for jax, ddp for torch) or 'all' (default)",
    )
    parser.add_argument("--nproc", type=int, default=2, help="processes, one device each (default 2)")
    parser.add_argument(
        "--device", choices=("cpu", "gpu"), default="cpu", help="cpu (default; sets JAX_PLATFORMS=cpu) or gpu"
    )
    parser.add_argument("--model", choices=MODELS, default="mlp", help="mlp (default, large gradient) or cnn")
    parser.add_argument("--batch-size", type=int, default=32, help="images per process per step (default 32)")
    parser.add_argument(
        "--width", type=int, default=1024, help="mlp hidden width; the cnn's dense layer is width/8 (default 1024)"
    )
    parser.add_argument("--layers", type=int, default=4, help="mlp hidden layers (default 4)")
    parser.add_argument("--image-size", type=int, default=32, help="square image side (default 32)")
    parser.add_argument("--lr", type=float, default=0.01, help="learning rate (default 0.01)")
    parser.add_argument("--warmup-iters", type=int, default=2, help="untimed iterations (default 2)")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations (default 10)")
    parser.add_argument("--batches-per-iter", type=int, default=5, help="steps per iteration (default 5)")
    parser.add_argument(
        "--threads", type=int, help="torch intra-op threads per process (default: cores / processes, at least 1)"
    )
    parser.add_argument(
        "--jax-comm",
        choices=("mpi", "gloo"),
        default="mpi",
        help="how JAX Bagua algorithms communicate: the native MPI engine under mpiexec "
        "(default), or JAX's collectives on a mesh over jax.distributed + gloo",
    )
    parser.add_argument(
        "--convergence-steps",
        type=int,
        default=0,
        help="after timing, train a digits MLP this many steps with the same algorithm and "
        "record its losses (default 0: off; needs scikit-learn)",
    )
    parser.add_argument("--digits-batch", type=int, default=128, help="digits global batch (default 128)")
    parser.add_argument("--digits-hidden", type=int, default=64, help="digits MLP hidden width (default 64)")
    parser.add_argument("--digits-lr", type=float, default=0.05, help="digits SGD learning rate (default 0.05)")
    parser.add_argument(
        "--digits-adam-lr", type=float, default=0.005, help="digits QAdam/OneBitAdam rate (default 0.005)"
    )
    parser.add_argument("--job-timeout", type=float, default=300, help="seconds per algorithm's job (default 300)")
    parser.add_argument("--comm-timeout", type=float, default=120, help="collective timeout in seconds")
    add_out_option(parser)
    parser.add_argument("--plot", action="store_true", help="also write a PNG bar chart (needs matplotlib)")
    parser.add_argument("--keep-logs", action="store_true", help="keep every job's output under <out>/logs")
    parser.add_argument("--tail-lines", type=int, default=20, help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("nproc", "batch_size", "width", "layers", "image_size", "iters", "batches_per_iter"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.convergence_steps < 0 or args.digits_batch % args.nproc:
        parser.error(f"--convergence-steps must be >= 0 and --digits-batch a multiple of --nproc ({args.nproc})")
    if args.warmup_iters < 1:
        parser.error("--warmup-iters must be at least 1 (the first iteration compiles)")
    if args.threads is None:
        from bagua_common.job.rank_environment import threads_per_rank

        args.threads = threads_per_rank(args.nproc)
    if args.worker:
        args.algorithm = args.algorithm[0]
    return args


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]] | None:
    args = parse_args(argv)
    if args.worker:
        worker_main(args)
        return None
    argv_used = sys.argv[1:] if argv is None else list(argv)
    jobs, notes = select_algorithms(args)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    device = device_info(args.device, "GPU (one per process)" if args.device == "gpu" else None)
    packages = ("numpy", "jax", "jaxlib", "optax") if args.framework == "jax" else ("numpy", "torch")
    meta = run_meta(
        packages,
        argv=argv_used,
        device=device,
        framework=args.framework,
        nproc=args.nproc,
        baseline=BASELINES[args.framework],
        oversubscribed=args.device == "cpu" and args.nproc > device["cores"],
        parameters=parameter_count(args),
        settings={name: getattr(args, name) for name in TIMING_SETTINGS},
        notes=notes,
    )
    if meta["oversubscribed"]:
        print(f"note: {args.nproc} processes on {device['cores']} cores: oversubscribed", file=sys.stderr)
    print(
        f"{args.framework}: {args.nproc} processes on {device['name']}; model {args.model} "
        f"({meta['parameters']:,} parameters), batch {args.batch_size} per process; "
        f"jobs: {' '.join(jobs)}",
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    bar = Progress(len(jobs))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bagua-synthetic-") as tmp:
        for i, name in enumerate(jobs):
            bar.show(i, f"{name}: starting", force=True)
            row = run_job(args, name, Path(tmp), bar, i)
            if row["status"] == "failed" and row.pop("retry", False):
                # The launcher's free port was taken by another program before the job bound
                # it (a race outside this job); try once more on a new port.
                print(f"{name}: port taken by another program (EADDRINUSE); retrying", file=sys.stderr)
                for leftover in Path(tmp).glob(f"{name}.json.rank*"):
                    leftover.unlink()
                row = run_job(args, name, Path(tmp), bar, i)
                row["retried_after"] = "EADDRINUSE"
            row.pop("retry", None)
            rows.append(row)
            bar.clear()
            if row["status"] == "ok":
                print(
                    f"{name:<30} {_pm(row['per_device'], row['per_device_ci95']):>16} img/s per device, "
                    f"{_pm(row['total'], row['total_ci95']):>18} img/s total  ({row['wall_s']:.0f} s)",
                    flush=True,
                )
                if row.get("exit_note"):
                    print(f"  note: {row['exit_note']}", flush=True)
            else:
                print(f"{name:<30} FAILED ({row['wall_s']:.0f} s): {row['error']}", flush=True)
        bar.show(len(jobs), "done", force=True)
        bar.clear()
    meta["total_s"] = round(time.perf_counter() - start, 1)
    finish_meta(meta)
    add_ratios(rows, args.framework)
    print_table(rows, args.framework, args.nproc)
    for path in write_results(args, meta, rows):
        print(f"wrote {path}")
    return rows


if __name__ == "__main__":
    main()

"""One rank of one variant of the LM study (``benchmarks/lm_study.py``): train the workload's GPT, then time steps.

Started once per rank inside the rank's network namespace (``harness.links``), with the path of a job file
(JSON, written by the study) as its only argument. The job runs in *phases*; before phase ``k`` the rank writes
``ready-<k>-<rank>`` into the job's folder and waits for ``go-<k>``, which the study writes once every rank is
ready and it has set the link of that phase (waiting, asynchronous averaging is paused: with ``--pairs`` the twin
job runs its phases meanwhile). Phase 0 trains ``steps`` steps (rank 0 evaluates its own model on
the held-out windows every ``eval_every`` steps); every later phase times steps at its link: one untimed round,
then ``timed_rounds`` timed rounds, each step blocked on and timed alone. A round is one step for the algorithms
that communicate every step; for DiLoCo it is ``timing_sync_every`` steps of a fresh copy of the variant with that
(short) round, so that each timed window holds whole rounds (see the study's docstring for how its time per step
at the trained round length follows). Bytes are the rank's namespace's interface counters (``/proc/net/dev``).
The rank writes ``rank<r>.json`` into the job's folder at the end.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from harness.links import bytes_sent

from bagua_common.workload import gpt_config, init_gpt_params, load_corpus

DDP_HOOKS = ("ddp_fp16", "ddp_powersgd_rank4")
TORCH_PEERS = ("ddp", *DDP_HOOKS)
JAX_PEERS = ("pmean",)
ADAM_TYPE = ("qadam", "onebit_adam")
COMM_TIMEOUT_S = 300


@dataclass
class RankJob:
    """One variant on this rank: ``step(tokens)`` trains one step and returns once it is done; ``heldout_loss(tokens)``
    is this rank's model's loss; ``finish()`` releases what the job holds; ``pause()`` and ``resume()`` stop and
    restart work done between steps (asynchronous averaging's rounds) while the job waits for a phase."""

    step: Callable[[np.ndarray], None]
    heldout_loss: Callable[[np.ndarray], float]
    finish: Callable[[], None]
    pause: Callable[[], None] = lambda: None
    resume: Callable[[], None] = lambda: None


def _torch_world(job: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if job["algorithm"] in TORCH_PEERS:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COMM_TIMEOUT_S))
    else:
        import bagua_torch

        bagua_torch.init_process_group("gloo", timeout=COMM_TIMEOUT_S)


def _torch_job(job: dict[str, Any], options: dict[str, Any]) -> RankJob:
    """DDP (with a hook) or a bagua_torch algorithm around a fresh GPT; AdamW unless the algorithm is Adam itself."""
    import torch

    from bagua_torch.models.gpt import GPT, next_token_loss

    model = GPT(job["size"], init_gpt_params(job["size"], job["seed"]))
    name = job["algorithm"]

    def adamw() -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=job["lr"], weight_decay=job["weight_decay"])

    if name in TORCH_PEERS:
        # One bucket for the PowerSGD hook: gloo matches collectives by issue order (see network_study.py).
        wrapped = torch.nn.parallel.DistributedDataParallel(
            model, **({"bucket_cap_mb": 1024} if name == "ddp_powersgd_rank4" else {})
        )
        optimizer = adamw()
        _register_ddp_hook(wrapped, name)
    else:
        import bagua_torch
        from bagua_torch.algorithms import algorithm_class, get_algorithm

        if name in ADAM_TYPE:
            optimizer = algorithm_class(name).optimizer_class(model.parameters(), lr=job["lr"])
            algorithm = get_algorithm(name, optimizer=optimizer, **options)
        else:
            optimizer, algorithm = adamw(), get_algorithm(name, **options)
        wrapped = bagua_torch.with_bagua(model, [optimizer], algorithm)

    def step(tokens: np.ndarray) -> None:
        batch = torch.from_numpy(tokens)
        optimizer.zero_grad(set_to_none=True)
        next_token_loss(wrapped(batch[:, :-1]), batch).backward()
        optimizer.step()

    def heldout_loss(tokens: np.ndarray) -> float:
        batch = torch.from_numpy(tokens)
        with torch.no_grad():
            return next_token_loss(model(batch[:, :-1]), batch).item()

    finish = getattr(wrapped, "close", lambda: None)
    if name == "async":
        return RankJob(step, heldout_loss, finish, wrapped.algorithm_impl.abort, wrapped.algorithm_impl.resume)
    return RankJob(step, heldout_loss, finish)


def _register_ddp_hook(model: Any, name: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    if name == "ddp_fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "ddp_powersgd_rank4":
        # torch's defaults (exact steps until iteration 1000 would cover the whole run) but the start: like ours
        # (start_iter 10), compressed from step 10, with error feedback and warm start.
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=10)
        model.register_comm_hook(state, powersgd.powerSGD_hook)


def _jax_world(job: dict[str, Any]) -> None:
    import jax

    if job["algorithm"] in JAX_PEERS:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            num_processes=int(os.environ["WORLD_SIZE"]),
            process_id=int(os.environ["RANK"]),
        )


def _jax_evaluator(job: dict[str, Any]) -> Callable[[Any, np.ndarray], float]:
    import jax

    from bagua_jax.models.gpt import gpt_loss_fn

    loss_fn = jax.jit(gpt_loss_fn(job["size"]))

    def heldout_loss(params: Any, tokens: np.ndarray) -> float:
        local = jax.tree.map(lambda p: np.asarray(p.addressable_data(0)), params)  # no collective: this rank only
        return float(loss_fn(local, {"tokens": tokens}))

    return heldout_loss


def _jax_pmean_job(job: dict[str, Any]) -> RankJob:
    """Plain JAX: a shard_map step over every process's device differentiating the ``lax.pmean`` of the loss (the
    parameters are replicated, so AD all-reduces their gradient), AdamW, over ``jax.distributed`` with gloo."""
    import jax
    import optax
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from bagua_jax.models.gpt import gpt_loss_fn

    loss_fn, tx = gpt_loss_fn(job["size"]), optax.adamw(job["lr"], weight_decay=job["weight_decay"])
    mesh = Mesh(np.array(jax.devices()), ("d",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))

    def per_device(params, opt_state, tokens):
        grads = jax.grad(lambda p: lax.pmean(loss_fn(p, {"tokens": tokens}), "d"))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    step_fn = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=(P(), P())),
        donate_argnums=(0, 1),
    )
    params = {
        k: jax.make_array_from_callback(v.shape, replicated, lambda index, v=v: v[index])
        for k, v in init_gpt_params(job["size"], job["seed"]).items()
    }
    state = [params, jax.jit(tx.init, out_shardings=replicated)(params)]
    evaluate = _jax_evaluator(job)

    def step(tokens: np.ndarray) -> None:
        state[:] = step_fn(state[0], state[1], jax.make_array_from_process_local_data(split, tokens))
        jax.block_until_ready(state[0])

    return RankJob(step, lambda tokens: evaluate(state[0], tokens), lambda: None)


def _jax_bagua_job(job: dict[str, Any], options: dict[str, Any]) -> RankJob:
    """A bagua_jax algorithm in ``DataParallel`` over the native (MPI) engine; AdamW unless it is Adam itself."""
    import jax
    import jax.numpy as jnp
    import optax

    from bagua_jax import NativeCommunicator
    from bagua_jax.algorithms import AsyncModelAverage, make_algorithm
    from bagua_jax.models.gpt import gpt_loss_fn
    from bagua_jax.trainer import DataParallel

    algorithm = make_algorithm(job["algorithm"], learning_rate=job["lr"], **options)
    optimizer = None if job["algorithm"] in ADAM_TYPE else optax.adamw(job["lr"], weight_decay=job["weight_decay"])
    comm = NativeCommunicator.world(timeout=COMM_TIMEOUT_S)
    trainer = DataParallel(gpt_loss_fn(job["size"]), optimizer, algorithm, communicator=comm)
    state = [trainer.init(init_gpt_params(job["size"], job["seed"]))]
    averager = None
    if isinstance(algorithm, AsyncModelAverage):
        averager = algorithm.averager(state[0].params, NativeCommunicator.mpi_world(timeout=COMM_TIMEOUT_S))
    evaluate = _jax_evaluator(job)

    def step(tokens: np.ndarray) -> None:
        new_state, _ = trainer.step(state[0], {"tokens": jnp.asarray(tokens)})
        if averager is not None:
            new_state = new_state._replace(params=averager.apply(new_state.params))
        state[0] = jax.block_until_ready(new_state)

    def finish() -> None:
        if averager is not None:
            averager.abort()
        comm.barrier(jnp.zeros((), jnp.float32))

    def heldout_loss(tokens: np.ndarray) -> float:
        return evaluate(state[0].params, tokens)

    if averager is not None:
        return RankJob(step, heldout_loss, finish, averager.abort, averager.resume)
    return RankJob(step, heldout_loss, finish)


def build_job(job: dict[str, Any], options: dict[str, Any]) -> RankJob:
    """The variant of ``job`` with the algorithm options ``options``, from the initial parameters."""
    if job["front_end"] == "torch":
        return _torch_job(job, options)
    return _jax_pmean_job(job) if job["algorithm"] in JAX_PEERS else _jax_bagua_job(job, options)


def _enter_phase(folder: Path, phase: int, rank: int, timeout: float) -> None:
    (folder / f"ready-{phase}-{rank}").touch()
    deadline = time.monotonic() + timeout
    while not (folder / f"go-{phase}").exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {rank}: the study did not start phase {phase} within {timeout:.0f} s")
        time.sleep(0.02)


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    folder, rank = Path(job_path).parent, int(os.environ["RANK"])
    (_torch_world if job["front_end"] == "torch" else _jax_world)(job)
    corpus, length = load_corpus(), gpt_config(job["size"]).context + 1
    heldout = corpus.heldout_batch(job["heldout_windows"], length)

    def tokens(step: int) -> np.ndarray:
        return corpus.batch(job["seed"], step, rank, job["batch"], length)

    trained = build_job(job, job["options"])
    _enter_phase(folder, 0, rank, job["phase_wait_s"])
    curve = [[0, trained.heldout_loss(heldout)]] if rank == 0 else []
    sent, start = bytes_sent(), time.perf_counter()
    for t in range(job["steps"]):
        trained.step(tokens(t))
        if rank == 0 and (t + 1) % job["eval_every"] == 0:
            curve.append([t + 1, trained.heldout_loss(heldout)])
    result: dict[str, Any] = {
        "rank": rank,
        "curve": curve,
        "train_s": time.perf_counter() - start,
        "train_bytes": bytes_sent() - sent,
        "phases": [],
    }
    timed = trained
    if job["timing_sync_every"]:
        trained.finish()
        timed = build_job(job, {**job["options"], "sync_every": job["timing_sync_every"]})
    round_steps, t = job["timing_sync_every"] or 1, job["steps"]
    for phase in range(1, len(job["links"])):
        timed.pause()
        _enter_phase(folder, phase, rank, job["phase_wait_s"])
        timed.resume()
        for _ in range(round_steps):
            timed.step(tokens(t))
            t += 1
        sent, times = bytes_sent(), []
        for _ in range(round_steps * job["timed_rounds"]):
            begin = time.perf_counter()
            timed.step(tokens(t))
            times.append(time.perf_counter() - begin)
            t += 1
        result["phases"].append({"link": job["links"][phase], "step_s": times, "bytes": bytes_sent() - sent})
    timed.finish()
    (folder / f"rank{rank}.json").write_text(json.dumps(result) + "\n")
    if job["front_end"] == "torch":
        import torch.distributed as dist

        dist.destroy_process_group()
        # torch's own teardown at interpreter exit aborts about 1 run in 15 ("terminate called without an active
        # exception", exit -6, no Python frame; torch and numpy the only extensions loaded), after the results are
        # written: leave without it.
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])

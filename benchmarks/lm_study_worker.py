"""One rank of one variant of the LM study (``benchmarks/lm_study.py``): train the workload's GPT, or time its steps.

Started once per rank inside the rank's network namespace (:mod:`harness.links`), with the path of a job file (JSON,
written by the study) as its only argument. The job's ``mode``:

* ``train``: ``steps`` steps from the initial parameters with the study's settings (:mod:`lm_study_settings`: the
  batch, AdamW's schedule, or the Adam-type algorithms' own); rank 0 evaluates its own model on the held-out windows
  every ``eval_every`` steps, and every rank notes the bytes its namespace sent so far at those steps;
* ``time``: phases given by the study (:func:`harness.phases.phases`): phase 0 builds the variant and runs
  ``UNTIMED_STEPS`` steps untimed (compilation, first buckets, exact first steps); each later phase runs one round
  untimed, then ``timed_rounds`` rounds, each step blocked on and timed alone, at that phase's link. A round is one
  step for the algorithms that communicate every step; for DiLoCo it is ``timing_round`` steps of the variant with
  that (short) round, so that each timed window holds whole rounds (the study's docstring says how the time per step
  at the trained round follows);
* ``async``: asynchronous averaging trains at the link: each timed phase trains ``steps`` steps from the initial
  parameters at its link; rank 0 keeps a copy of its parameters and the wall time since its first step at every
  ``eval_every`` steps and evaluates the copies once the steps are done (evaluating inline would stop rank 0 while
  the others train on).

Each rank writes its result with :func:`harness.jobs.write_rank_result`.
"""

from __future__ import annotations

import copy
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
from harness.jobs import write_rank_result
from harness.links import bytes_sent
from harness.phases import phases
from lm_study_settings import Schedule

from bagua_common.workload import gpt_config, init_gpt_params, load_corpus

DDP_HOOKS = ("ddp_fp16", "ddp_powersgd_rank4")
TORCH_PEERS = ("ddp", *DDP_HOOKS)
JAX_PEERS = ("pmean",)
ADAM_TYPE = ("qadam", "onebit_adam")
ADAM_OPTIMIZER_OPTIONS = ("warmup_steps",)
"""The options of an Adam-type variant that torch gives its optimizer (bagua_jax takes them all in the algorithm)."""


def adam_betas(job: dict[str, Any], options: dict[str, Any]) -> tuple[float, float]:
    """The Adam-type algorithms' betas: the variant's ``b1`` and ``b2`` options (taken out of ``options``), else the
    study's ``adam_betas``."""
    b1, b2 = job["settings"]["adam_betas"]
    return float(options.pop("b1", b1)), float(options.pop("b2", b2))


UNTIMED_STEPS = 12
"""Steps of the untimed first phase: compilation, first buckets, and DDP's PowerSGD hook's 10 exact steps."""
COMM_TIMEOUT_S = {"train": 6 * 3600, "time": 600, "async": 600}
"""How long a collective waits for its peers, by mode: a training job may be paused whole (SIGSTOP) while the machine
is measured, for longer than a timed job should ever wait."""


@dataclass
class RankJob:
    """One variant on this rank: ``step(tokens)`` trains one step and returns once it is done; ``params()`` is a copy
    of this rank's parameters; ``heldout_loss(params, tokens)`` the loss of such a copy; ``finish()`` releases what
    the job holds; ``pause()`` and ``resume()`` stop and restart work done between steps (asynchronous averaging's
    rounds) while the job waits for a phase."""

    step: Callable[[np.ndarray], None]
    params: Callable[[], Any]
    heldout_loss: Callable[[Any, np.ndarray], float]
    finish: Callable[[], None]
    pause: Callable[[], None] = lambda: None
    resume: Callable[[], None] = lambda: None


def schedule_of(job: dict[str, Any]) -> Schedule:
    """The learning-rate schedule the variant trains with: its own if it has one, else the Adam-type algorithms'
    (QAdam's, 1-bit Adam's) or AdamW's of the study's settings."""
    if job.get("schedule"):
        return Schedule(**job["schedule"])
    return Schedule(**job["settings"]["adam_schedule" if job["algorithm"] in ADAM_TYPE else "schedule"])


def _torch_world(job: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = COMM_TIMEOUT_S[job["mode"]]
    if job["algorithm"] in TORCH_PEERS:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
    else:
        import bagua_torch

        bagua_torch.init_process_group("gloo", timeout=timeout)


def _torch_job(job: dict[str, Any], options: dict[str, Any]) -> RankJob:
    """DDP (with a hook) or a bagua_torch algorithm around a fresh GPT; AdamW unless the algorithm is Adam itself."""
    import torch

    from bagua_torch.models.gpt import GPT, next_token_loss

    settings, name = job["settings"], job["algorithm"]
    model = GPT(settings["size"], init_gpt_params(settings["size"], settings["seed"]))
    schedule = schedule_of(job)
    options = dict(options)

    def adamw() -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            model.parameters(), lr=schedule.peak, betas=tuple(settings["betas"]), weight_decay=settings["weight_decay"]
        )

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
            own = {k: options.pop(k) for k in ADAM_OPTIMIZER_OPTIONS if k in options}
            betas = adam_betas(job, options)
            optimizer = algorithm_class(name).optimizer_class(model.parameters(), lr=schedule.peak, betas=betas, **own)
            algorithm = get_algorithm(name, optimizer=optimizer, **options)
        else:
            optimizer, algorithm = adamw(), get_algorithm(name, **options)
        wrapped = bagua_torch.with_bagua(model, [optimizer], algorithm)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor)

    def step(tokens: np.ndarray) -> None:
        batch = torch.from_numpy(tokens)
        optimizer.zero_grad(set_to_none=True)
        next_token_loss(wrapped(batch[:, :-1]), batch).backward()
        optimizer.step()
        scheduler.step()

    def params() -> dict[str, torch.Tensor]:
        return copy.deepcopy(model.state_dict())

    evaluated = GPT(settings["size"], init_gpt_params(settings["size"], settings["seed"]))

    def heldout_loss(state: dict[str, torch.Tensor], tokens: np.ndarray) -> float:
        evaluated.load_state_dict(state)
        batch = torch.from_numpy(tokens)
        with torch.no_grad():
            return next_token_loss(evaluated(batch[:, :-1]), batch).item()

    finish = getattr(wrapped, "close", lambda: None)
    if name == "async":
        impl = wrapped.algorithm_impl
        return RankJob(step, params, heldout_loss, finish, impl.abort, impl.resume)
    return RankJob(step, params, heldout_loss, finish)


def _register_ddp_hook(model: Any, name: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    if name == "ddp_fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name == "ddp_powersgd_rank4":
        # torch's defaults (exact steps until iteration 1000 would cover much of the run) but the start: like ours
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
            heartbeat_timeout_seconds=COMM_TIMEOUT_S[job["mode"]],
        )


def _jax_evaluation(job: dict[str, Any]) -> tuple[Callable[[Any], Any], Callable[[Any, np.ndarray], float]]:
    """(a host copy of this rank's parameters, the held-out loss of such a copy): no collective, this rank only."""
    import jax

    from bagua_jax.models.gpt import gpt_loss_fn

    loss_fn = jax.jit(gpt_loss_fn(job["settings"]["size"]))

    def host_copy(params: Any) -> Any:
        return jax.tree.map(lambda p: np.array(p.addressable_data(0)), params)

    def heldout_loss(params: Any, tokens: np.ndarray) -> float:
        return float(loss_fn(params, {"tokens": tokens}))

    return host_copy, heldout_loss


def _adamw(job: dict[str, Any]) -> Any:
    import optax

    settings = job["settings"]
    b1, b2 = settings["betas"]
    return optax.adamw(schedule_of(job).optax(), b1=b1, b2=b2, weight_decay=settings["weight_decay"])


def _jax_pmean_job(job: dict[str, Any]) -> RankJob:
    """Plain JAX: a shard_map step over every process's device differentiating the ``lax.pmean`` of the loss (the
    parameters are replicated, so AD all-reduces their gradient), AdamW, over ``jax.distributed`` with gloo."""
    import jax
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from bagua_jax.models.gpt import gpt_loss_fn

    settings = job["settings"]
    loss_fn, tx = gpt_loss_fn(settings["size"]), _adamw(job)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("d"))

    def per_device(params, opt_state, tokens):
        grads = jax.grad(lambda p: lax.pmean(loss_fn(p, {"tokens": tokens}), "d"))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return jax.tree.map(lambda p, u: p + u, params, updates), opt_state

    step_fn = jax.jit(
        jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P("d")), out_specs=(P(), P())),
        donate_argnums=(0, 1),
    )
    params = {
        k: jax.make_array_from_callback(v.shape, replicated, lambda index, v=v: v[index])
        for k, v in init_gpt_params(settings["size"], settings["seed"]).items()
    }
    state = [params, jax.jit(tx.init, out_shardings=replicated)(params)]
    host_copy, heldout_loss = _jax_evaluation(job)

    def step(tokens: np.ndarray) -> None:
        state[:] = step_fn(state[0], state[1], jax.make_array_from_process_local_data(split, tokens))
        jax.block_until_ready(state[0])

    return RankJob(step, lambda: host_copy(state[0]), heldout_loss, lambda: None)


def _jax_bagua_job(job: dict[str, Any], options: dict[str, Any]) -> RankJob:
    """A bagua_jax algorithm in ``DataParallel`` over the native (MPI) engine; AdamW unless it is Adam itself."""
    import jax
    import jax.numpy as jnp

    from bagua_jax import NativeCommunicator
    from bagua_jax.algorithms import AsyncModelAverage, make_algorithm
    from bagua_jax.models.gpt import gpt_loss_fn
    from bagua_jax.trainer import DataParallel

    settings, name = job["settings"], job["algorithm"]
    if name in ADAM_TYPE:
        options = dict(options)
        b1, b2 = adam_betas(job, options)
        algorithm = make_algorithm(name, learning_rate=schedule_of(job).optax(), b1=b1, b2=b2, **options)
        optimizer = None
    else:
        algorithm, optimizer = make_algorithm(name, **options), _adamw(job)
    timeout = COMM_TIMEOUT_S[job["mode"]]
    comm = NativeCommunicator.world(timeout=timeout)
    trainer = DataParallel(gpt_loss_fn(settings["size"]), optimizer, algorithm, communicator=comm)
    state = [trainer.init(init_gpt_params(settings["size"], settings["seed"]))]
    averager = None
    if isinstance(algorithm, AsyncModelAverage):
        averager = algorithm.averager(state[0].params, NativeCommunicator.mpi_world(timeout=timeout))
    host_copy, heldout_loss = _jax_evaluation(job)

    def step(tokens: np.ndarray) -> None:
        new_state, _ = trainer.step(state[0], {"tokens": jnp.asarray(tokens)})
        if averager is not None:
            new_state = new_state._replace(params=averager.apply(new_state.params))
        state[0] = jax.block_until_ready(new_state)

    def finish() -> None:
        if averager is not None:
            averager.abort()
        comm.barrier(jnp.zeros((), jnp.float32))

    params = lambda: host_copy(state[0].params)  # noqa: E731
    if averager is not None:
        return RankJob(step, params, heldout_loss, finish, averager.abort, averager.resume)
    return RankJob(step, params, heldout_loss, finish)


def build_job(job: dict[str, Any], options: dict[str, Any]) -> RankJob:
    """The variant of ``job`` with the algorithm options ``options``, from the initial parameters."""
    if job["front_end"] == "torch":
        return _torch_job(job, options)
    return _jax_pmean_job(job) if job["algorithm"] in JAX_PEERS else _jax_bagua_job(job, options)


class Tokens:
    """This rank's batches, ``Corpus.batch(seed, step, rank, windows, context + 1)``, and the held-out windows."""

    def __init__(self, job: dict[str, Any], rank: int):
        settings = job["settings"]
        self.corpus, self.length = load_corpus(), gpt_config(settings["size"]).context + 1
        self.seed, self.rank, self.windows = settings["seed"], rank, settings["windows"]
        self.heldout = self.corpus.heldout_batch(settings["heldout_windows"], self.length)

    def __call__(self, step: int) -> np.ndarray:
        return self.corpus.batch(self.seed, step, self.rank, self.windows, self.length)


def wait_while_stopped(pid: int) -> None:
    """Return once process ``pid`` (the study) is not stopped: a rank runs in a session of its own, so suspending the
    study (Ctrl-Z, SIGSTOP to its process group) does not reach it; between steps it follows the study instead."""
    stat = Path(f"/proc/{pid}/stat")
    while stat.exists() and stat.read_text().rpartition(")")[2].split()[0] in ("T", "t"):
        time.sleep(1.0)


def train(job: dict[str, Any], rank: int) -> dict[str, Any]:
    """``train`` mode (the module docstring): rank 0's held-out curve ``[step, loss]``, this rank's bytes sent at
    each evaluation ``[step, bytes]``, its wall time."""
    tokens, every = Tokens(job, rank), job["settings"]["eval_every"]
    trained = build_job(job, job["options"])
    curve = [[0, trained.heldout_loss(trained.params(), tokens.heldout)]] if rank == 0 else []
    sent, start, first = [[0, 0]], time.perf_counter(), bytes_sent()
    for t in range(job["steps"]):
        wait_while_stopped(job["study_pid"])
        trained.step(tokens(t))
        if (t + 1) % every == 0 or t + 1 == job["steps"]:
            sent.append([t + 1, bytes_sent() - first])
            if rank == 0:
                curve.append([t + 1, trained.heldout_loss(trained.params(), tokens.heldout)])
                if not np.isfinite(curve[-1][1]):
                    break
    trained.finish()
    return {"rank": rank, "curve": curve, "sent": sent, "train_s": time.perf_counter() - start}


def time_steps(job: dict[str, Any], rank: int, folder: Path) -> dict[str, Any]:
    """``time`` mode (the module docstring): per phase given, its link, each timed step's seconds and the bytes sent
    over them."""
    tokens = Tokens(job, rank)
    h_t = job["timing_round"]
    timed = build_job(job, {**job["options"], "sync_every": h_t} if h_t else job["options"])
    round_steps, t, recorded = h_t or 1, 0, []
    for seq, phase in phases(folder, rank, job["phase_wait_s"]):
        timed.resume()
        for _ in range(round_steps if job["timed"][phase] else max(round_steps, UNTIMED_STEPS)):
            timed.step(tokens(t))
            t += 1
        times, sent = [], bytes_sent()
        for _ in range(round_steps * job["timed_rounds"] if job["timed"][phase] else 0):
            begin = time.perf_counter()
            timed.step(tokens(t))
            times.append(time.perf_counter() - begin)
            t += 1
        recorded.append({"seq": seq, "link": job["links"][phase], "step_s": times, "bytes": bytes_sent() - sent})
        timed.pause()
    timed.finish()
    return {"rank": rank, "phases": recorded}


def train_at_link(job: dict[str, Any], rank: int, folder: Path) -> dict[str, Any]:
    """``async`` mode (the module docstring): per phase given, its link, rank 0's curve ``[step, seconds, loss]`` and
    this rank's bytes sent. The clock starts when the first step is done, leaving its compilation out (one step of a
    run of thousands)."""
    tokens, every, recorded = Tokens(job, rank), job["settings"]["eval_every"], []
    for seq, phase in phases(folder, rank, job["phase_wait_s"]):
        trained = build_job(job, job["options"])
        kept, first = [[0, 0.0, trained.params()]], bytes_sent()
        trained.step(tokens(0))
        start = time.perf_counter()
        for t in range(1, job["steps"]):
            trained.step(tokens(t))
            if rank == 0 and ((t + 1) % every == 0 or t + 1 == job["steps"]):
                kept.append([t + 1, time.perf_counter() - start, trained.params()])
        wall, sent = time.perf_counter() - start, bytes_sent() - first
        trained.finish()
        curve = [[s, round(elapsed, 3), trained.heldout_loss(p, tokens.heldout)] for s, elapsed, p in kept]
        recorded.append({"seq": seq, "link": job["links"][phase], "curve": curve, "wall_s": wall, "bytes": sent})
    return {"rank": rank, "phases": recorded}


def one_core_per_rank(rank: int) -> None:
    """Bind this process to one core, the ranks spread over the cores: JAX's equivalent of the one thread a torch
    rank is given (``torch.set_num_threads(1)``). XLA sizes its CPU thread pools from the affinity mask, and with 4
    ranks of 2 threads each on 2 cores the study's JAX step took 1.8x as long (``jax/diloco`` 154 against 81 ms;
    torch's ranks gain nothing from the same binding). Called before JAX creates its CPU client."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    folder, rank = Path(job_path).parent, int(os.environ["RANK"])
    if job["front_end"] == "jax":
        one_core_per_rank(rank)
    (_torch_world if job["front_end"] == "torch" else _jax_world)(job)
    if job["mode"] == "train":
        result = train(job, rank)
    elif job["mode"] == "time":
        result = time_steps(job, rank, folder)
    else:
        result = train_at_link(job, rank, folder)
    write_rank_result(job["result"], rank, result)
    if job["front_end"] == "torch":
        import torch.distributed as dist

        dist.destroy_process_group()
        # torch's own teardown at interpreter exit aborts about 1 run in 15 ("terminate called without an active
        # exception", exit -6, no Python frame; torch and numpy the only extensions loaded), after the results are
        # written: leave without it.
        os._exit(0)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(sys.argv[1])

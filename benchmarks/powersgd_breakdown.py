"""Where a PowerSGD step's time goes on the network study's links: compute, compression, waiting, wire.

Each rank (4 by default, one per namespace of the harness's links, the same models as :mod:`network_study`) runs
the pieces of a PowerSGD step one after the other, timing each:

* compute: forward, backward and the SGD update of the model, no communication;
* compression: PowerSGD's arithmetic on those gradients (``M = G + residual``, ``P = M Q``, orthogonalization,
  ``Q = M^T P``, ``P Q^T`` and the new residual), no communication;
* waiting: a barrier (the time this rank waits for the slowest one);
* wire: the step's two allreduces (every P with the uncompressed gradients, then every Q) of the sizes the
  algorithm sends, started together after the barrier.

torch runs over gloo (as ``bagua_torch``'s PowerSGD in the study), JAX over the native MPI engine (as
``bagua_jax``'s). Per rank the median of each piece over ``--steps`` steps after ``--warmup``, then the mean over
the ranks; the table gives the median over the repeats, and the study's step time beside it when ``--study``
names its JSON. (The orthogonalization alone, without a network: ``benchmarks/powersgd_orthogonalize.py``.)

    python benchmarks/powersgd_breakdown.py --links 100mbit none --models mlp matrices
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import network_study  # noqa: E402
import synthetic  # noqa: E402
from harness import results, study  # noqa: E402
from harness.jobs import run_ranks, write_rank_result  # noqa: E402
from harness.links import link_name, parse_rate, rate_label  # noqa: E402

PIECES = ("compute", "compression", "waiting", "wire")
MODELS = [*network_study.MODELS, *network_study.GPT_MODELS]


def factor_layout(shapes: list[tuple[int, ...]], rank: int) -> tuple[list[tuple[int, tuple[int, int], int]], list[int]]:
    """The factors PowerSGD of ``rank`` makes of tensors of ``shapes``: (index, matrix view, rank) of each compressed
    one, and the indices of those sent whole."""
    from bagua_common.algorithms.configs import PowerSGDConfig, matrix_view

    config = PowerSGDConfig(rank=rank)
    compressed = [(i, matrix_view(s), config.compressed_rank(s)) for i, s in enumerate(shapes)]
    compressed = [c for c in compressed if c[2] is not None]
    done = {i for i, _, _ in compressed}
    return compressed, [i for i in range(len(shapes)) if i not in done]


def synthetic_model(model: str) -> tuple[str, list, int]:
    """The synthetic benchmark's name of ``model``, its initial parameters and its image side (0 for a GPT)."""
    if model in network_study.GPT_MODELS:
        return model, synthetic.init_params(model, 0, 0, 0), 0
    width, layers, image_size = network_study.MODELS[model]
    return "mlp", synthetic.init_params("mlp", image_size, width, layers), image_size


def worker_torch(args: argparse.Namespace) -> dict[str, list[float]]:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from bagua_torch.algorithms.powersgd import narrow_product, orthogonalize_all

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    name, arrays, image_size = synthetic_model(args.model)
    net = synthetic.torch_model(name, arrays)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    batch = synthetic.random_batch(args.batch_size, image_size, dist.get_rank(), name)
    x, y = (torch.from_numpy(a) for a in batch)
    y = y.long()
    params = list(net.parameters())
    compressed, plain = factor_layout([tuple(p.shape) for p in params], args.rank)
    generator = torch.Generator().manual_seed(0)
    qs = [torch.randn(view[1], r, generator=generator) for _, view, r in compressed]
    residuals = [torch.zeros(view) for _, view, _ in compressed]
    p_numel = sum(view[0] * r for _, view, r in compressed) + sum(params[i].numel() for i in plain)
    q_numel = sum(view[1] * r for _, view, r in compressed)
    times: dict[str, list[float]] = {k: [] for k in PIECES}
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
        t1 = time.perf_counter()
        ms = [params[i].grad.reshape(view) + e for (i, view, _), e in zip(compressed, residuals)]
        ps = orthogonalize_all([narrow_product(m, q) for m, q in zip(ms, qs)])
        qs = [narrow_product(m.T, p) for m, p in zip(ms, ps)]
        residuals = [m - p @ q.T for m, p, q in zip(ms, ps, qs)]
        t2 = time.perf_counter()
        dist.barrier()
        t3 = time.perf_counter()
        dist.all_reduce(torch.zeros(p_numel))
        dist.all_reduce(torch.zeros(q_numel))
        t4 = time.perf_counter()
        if step >= args.warmup:
            for key, seconds in zip(PIECES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[key].append(seconds)
    dist.barrier()
    dist.destroy_process_group()
    return times


def worker_jax(args: argparse.Namespace) -> dict[str, list[float]]:
    import jax
    import jax.numpy as jnp
    import optax

    from bagua_jax import NativeCommunicator
    from bagua_jax.algorithms.powersgd import orthogonalize_all

    comm = NativeCommunicator.world(timeout=120)
    name, arrays, image_size = synthetic_model(args.model)
    params = [jnp.asarray(p) for p in arrays]
    loss_fn = synthetic.jax_model(name)
    optimizer = optax.sgd(0.01, momentum=0.9)
    rank = int(os.environ["RANK"])
    batch = tuple(jnp.asarray(a) for a in synthetic.random_batch(args.batch_size, image_size, rank, name))
    compressed, plain = factor_layout([tuple(p.shape) for p in params], args.rank)

    @jax.jit
    def compute(params, opt_state):
        grads = jax.grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads

    @jax.jit
    def compression(grads, qs, residuals):
        ms = [grads[i].reshape(view) + e for (i, view, _), e in zip(compressed, residuals)]
        ps = orthogonalize_all([m @ q for m, q in zip(ms, qs)])
        new_qs = [m.T @ p for m, p in zip(ms, ps)]
        return new_qs, [m - p @ q.T for m, p, q in zip(ms, ps, new_qs)]

    key = jax.random.PRNGKey(0)
    qs = [jax.random.normal(jax.random.fold_in(key, k), (view[1], r)) for k, (_, view, r) in enumerate(compressed)]
    residuals = [jnp.zeros(view) for _, view, _ in compressed]
    p_flat = jnp.zeros(sum(view[0] * r for _, view, r in compressed) + sum(params[i].size for i in plain))
    q_flat = jnp.zeros(sum(view[1] * r for _, view, r in compressed))
    opt_state = optimizer.init(params)
    times: dict[str, list[float]] = {k: [] for k in PIECES}
    for step in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        params, opt_state, grads = jax.block_until_ready(compute(params, opt_state))
        t1 = time.perf_counter()
        qs, residuals = jax.block_until_ready(compression(grads, qs, residuals))
        t2 = time.perf_counter()
        jax.block_until_ready(comm.barrier(jnp.zeros(())))
        t3 = time.perf_counter()
        jax.block_until_ready(comm.allreduce(p_flat, "sum"))
        jax.block_until_ready(comm.allreduce(q_flat, "avg"))
        t4 = time.perf_counter()
        if step >= args.warmup:
            for name, seconds in zip(PIECES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[name].append(seconds)
    comm.barrier(jnp.zeros(()))
    return times


def worker(argv: list[str]) -> None:
    """One rank: ``--framework``, ``--model``, ``--rank``, ``--steps``, ``--warmup``, ``--batch-size`` and
    ``--result`` as :func:`measure` passes them; writes the pieces' times."""
    p = argparse.ArgumentParser()
    p.add_argument("--framework", choices=("torch", "jax"))
    p.add_argument("--model", choices=MODELS)
    for name in ("rank", "steps", "warmup", "batch-size"):
        p.add_argument(f"--{name}", type=int)
    p.add_argument("--result")
    args = p.parse_args(argv)
    times = worker_jax(args) if args.framework == "jax" else worker_torch(args)
    write_rank_result(args.result, int(os.environ.get("RANK", os.environ.get("PMI_RANK", "0"))), times)


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=list(network_study.MODELS), choices=MODELS)
    p.add_argument("--rank", type=int, default=4, help="PowerSGD's rank")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--job-timeout", type=float, default=180)
    p.add_argument(
        "--study",
        default=str(HERE / "results" / "network-study-peers.json"),
        help="the network study's JSON of the PowerSGD times shown beside ('none': none)",
    )


def variants(args: argparse.Namespace) -> list[study.Variant]:
    return [
        study.Variant(f"{fw} {model}", {"framework": fw, "model": model})
        for model in args.models
        for fw in ("torch", "jax")
    ]


def measure(trial: study.Trial) -> dict[str, Any]:
    """One job: each piece's time (mean over the ranks of each rank's median), and their sum as ``step_s``."""
    args, result = trial.args, trial.scratch()
    argv = [
        sys.executable,
        __file__,
        "--worker",
        "--framework",
        trial.variant["framework"],
        "--model",
        trial.variant["model"],
        "--rank",
        str(args.rank),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch-size",
        str(args.batch_size),
        "--result",
        str(result),
    ]
    outcome = run_ranks(trial.net, argv, result, mpi=trial.variant["framework"] == "jax", timeout=args.job_timeout)
    row = outcome.row()
    if outcome.ranks is not None:
        row.update({k: statistics.fmean(statistics.median(t[k]) for t in outcome.ranks) for k in PIECES})
        row["step_s"] = sum(row[k] for k in PIECES)
    return row


def _upgraded(row: dict[str, Any], ranks: int) -> dict[str, Any]:
    """A row of a results file written before the harness: one job per link, its label as ``rate``."""
    if "variant" in row:
        return row
    name = f"{row['framework']} {row['model']}"
    return {
        **row,
        "variant": name,
        "link": link_name(row["rate"]),
        "ranks": ranks,
        "status": "ok",
        "step_s": sum(row[k] for k in PIECES),
    }


def report(data: dict[str, Any]) -> list[str]:
    settings = data.get("settings", {})
    ranks = settings.get("ranks", [4])
    rows = [_upgraded(r, ranks[0]) for r in data["rows"]]
    rank = settings.get("rank", 4)
    path = settings.get("study")
    figures = (
        network_study.Figures(json.loads(Path(path).read_text())["rows"])
        if path and path != "none" and Path(path).exists()
        else None
    )
    pieces = {k: study.summary(rows, k) for k in (*PIECES, "step_s")}
    head = ["link", "model", "front end", *(f"{k} ms" for k in PIECES), "sum ms", "study step ms"]
    cells = []
    for n, link in sorted({(r["ranks"], r["link"]) for r in rows}, key=lambda x: (x[0], study.link_order(x[1]))):
        for name in dict.fromkeys(r["variant"] for r in rows):
            framework, model = name.split(" ", 1)
            key = (name, n, link)
            if key not in pieces["step_s"]:
                continue
            theirs = figures.step(model, n, link, framework, f"powersgd_rank{rank}") if figures else None
            recorded = [
                r["study_step_s"] for r in rows if r["variant"] == name and r["link"] == link and r.get("study_step_s")
            ]  # results written before the harness kept it per row
            study_ms = theirs.scaled(1e3).format(".0f") if theirs else f"{recorded[0] * 1e3:.0f}" if recorded else ""
            times = [pieces[k][key].scaled(1e3).format(".1f") for k in (*PIECES, "step_s")]
            cells.append([rate_label(parse_rate(link)), model, framework, *times, study_ms])
    return [
        f"PowerSGD rank {rank}, {'/'.join(map(str, ranks))} ranks, one per network namespace "
        f"(benchmarks/harness/links.py); per rank the median of {settings.get('steps', 10)} steps after "
        f"{settings.get('warmup', 3)}, then the mean over the ranks; median over the repeats [min, max]. torch: "
        "gloo; JAX: the native MPI engine (as in the study).",
        "",
        *results.table(head, cells, "lll" + "r" * 6),
        "",
    ]


STUDY = study.Study(
    name="network-study-powersgd-breakdown",
    title="PowerSGD: where the step's time goes",
    description=__doc__,
    variants=variants,
    measure=measure,
    links=("100mbit", "none"),
    ranks=(4,),
    repeats=1,
    add_options=add_options,
    report=report,
    plot=False,
    worker=worker,
)


if __name__ == "__main__":
    sys.exit(study.main(STUDY))

"""Where a PowerSGD step's time goes on the network study's links: compute, compression, waiting, wire.

Each rank (4 by default, one per network namespace of :mod:`harness.links`, the same models
as :mod:`network_study`) runs the pieces of a PowerSGD step one after the other, timing each:

* compute: forward, backward and the SGD update of the model, no communication;
* compression: PowerSGD's arithmetic on those gradients (``M = G + residual``, ``P = M Q``,
  orthogonalization, ``Q = M^T P``, ``P Q^T`` and the new residual), no communication;
* waiting: a barrier (the time this rank waits for the slowest one);
* wire: the step's two allreduces (every P with the uncompressed gradients, then every Q) of
  the sizes the algorithm sends, started together after the barrier.

torch runs over gloo (as ``bagua_torch``'s PowerSGD in the study), JAX over the native MPI
engine (as ``bagua_jax``'s). The table gives the mean over the ranks of each piece's median
and the study's step time beside it when ``--study`` names its JSON.

    python benchmarks/powersgd_breakdown.py --rates 100mbit none --models mlp matrices

``--orthogonalize`` (no network, no root) instead times the orthogonalization of one step's
``P`` factors alone: the previous per-matrix, per-column loop against the batched
``orthogonalize_all`` of each front end, interleaved and repeated, on the study's models and
the GPT sizes of ``--gpt-sizes``:

    python benchmarks/powersgd_breakdown.py --orthogonalize --models mlp matrices --gpt-sizes small gpt2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import network_study  # noqa: E402
import synthetic  # noqa: E402
from harness import links as nh  # noqa: E402
from harness.jobs import child_env  # noqa: E402
from harness.results import finish_meta, header_lines, run_meta, write_results  # noqa: E402

PIECES = ("compute", "compression", "waiting", "wire")


def _layout(shapes: list[tuple[int, ...]], rank: int) -> tuple[list[tuple[int, tuple[int, int], int]], list[int]]:
    from bagua_common.algorithms.configs import PowerSGDConfig, matrix_view

    config = PowerSGDConfig(rank=rank)
    compressed = [(i, matrix_view(s), config.compressed_rank(s)) for i, s in enumerate(shapes)]
    compressed = [c for c in compressed if c[2] is not None]
    done = {i for i, _, _ in compressed}
    return compressed, [i for i in range(len(shapes)) if i not in done]


def _synthetic_model(model: str) -> tuple[str, list, int]:
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
    name, arrays, image_size = _synthetic_model(args.model)
    net = synthetic.torch_model(name, arrays)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    batch = synthetic.random_batch(args.batch_size, image_size, dist.get_rank(), name)
    x, y = (torch.from_numpy(a) for a in batch)
    y = y.long()
    params = list(net.parameters())
    compressed, plain = _layout([tuple(p.shape) for p in params], args.rank)
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
    name, arrays, image_size = _synthetic_model(args.model)
    params = [jnp.asarray(p) for p in arrays]
    loss_fn = synthetic.jax_model(name)
    optimizer = optax.sgd(0.01, momentum=0.9)
    rank = int(os.environ["RANK"])
    batch = tuple(jnp.asarray(a) for a in synthetic.random_batch(args.batch_size, image_size, rank, name))
    compressed, plain = _layout([tuple(p.shape) for p in params], args.rank)

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


def orthogonalize_per_matrix(p):
    """The torch orthogonalization before batching (one matrix, one column pair at a time): the baseline."""
    import torch

    for i in range(p.shape[1]):
        column = p[:, i]
        for j in range(i):
            column -= torch.dot(p[:, j], column) * p[:, j]
        norm = torch.linalg.vector_norm(column)
        if norm > 0:
            column /= norm
    return p


def p_shapes(args: argparse.Namespace) -> dict[str, list[tuple[int, int]]]:
    """Per model, the ``(n, r)`` of every ``P`` factor PowerSGD of rank ``args.rank`` orthogonalizes in a step."""
    from bagua_common.workload.gpt_spec import gpt_config

    shapes = {}
    for model in args.models:
        shapes[model] = [tuple(p.shape) for p in _synthetic_model(model)[1]]
    for size in args.gpt_sizes:
        shapes[f"gpt-{size}"] = list(gpt_config(size).parameter_shapes().values())
    return {name: [(view[0], r) for _, view, r in _layout(s, args.rank)[0]] for name, s in shapes.items()}


def time_orthogonalization(args: argparse.Namespace) -> None:
    """The ``--orthogonalize`` mode: per-matrix loop against one batched call, per front end and model."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from bagua_jax.algorithms.powersgd import orthogonalize as jax_orthogonalize
    from bagua_jax.algorithms.powersgd import orthogonalize_all as jax_orthogonalize_all
    from bagua_torch.algorithms.powersgd import orthogonalize_all

    torch.set_num_threads(1)
    meta = run_meta(("torch", "jax"), argv=sys.argv[1:])
    rng = np.random.default_rng(0)
    jax_loop = jax.jit(lambda ps: [jax_orthogonalize(p) for p in ps])
    jax_batched = jax.jit(jax_orthogonalize_all)
    rows = []
    for model, shapes in p_shapes(args).items():
        arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        tensors, jax_arrays = [torch.from_numpy(a) for a in arrays], [jnp.asarray(a) for a in arrays]
        variants = {
            ("torch", "loop"): lambda: [orthogonalize_per_matrix(t.clone()) for t in tensors],
            ("torch", "batched"): lambda: orthogonalize_all(tensors),
            ("jax", "loop"): lambda: jax.block_until_ready(jax_loop(jax_arrays)),
            ("jax", "batched"): lambda: jax.block_until_ready(jax_batched(jax_arrays)),
        }
        times: dict[tuple[str, str], list[float]] = {key: [] for key in variants}
        for round_ in range(args.rounds + 1):  # round 0 warms up (and compiles)
            order = list(variants) if round_ % 2 else list(reversed(variants))
            for key in order:
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    variants[key]()
                    if round_:
                        times[key].append(time.perf_counter() - t0)
        for framework in ("torch", "jax"):
            loop, batched = (statistics.median(times[(framework, v)]) for v in ("loop", "batched"))
            rows.append({"model": model, "matrices": len(shapes), "framework": framework,
                         "loop_s": loop, "batched_s": batched, "speedup": loop / batched})  # fmt: skip
            print(f"{model:>10} {framework:>5}: loop {loop * 1e3:8.3f} ms  batched {batched * 1e3:8.3f} ms  "
                  f"{loop / batched:5.2f}x", flush=True)  # fmt: skip
    finish_meta(meta)
    lines = [
        f"# PowerSGD rank {args.rank}: orthogonalizing one step's P factors, per-matrix loop against batched",
        "",
        *header_lines(meta),
        "- The machine is a 2-core box heavily loaded by other engineers' builds and tests (see the load "
        "average): the ratios, measured side by side, carry more than the absolute times.",
        f"- Per variant the median of {args.rounds} interleaved rounds of {args.steps} calls (one torch thread); "
        "the JAX columns are each jitted once, the loop as one graph of per-matrix operations.",
        "",
        "| model | matrices | front end | loop ms | batched ms | loop / batched |",
        "|---|---:|---|---:|---:|---:|",
        *(
            f"| {r['model']} | {r['matrices']} | {r['framework']} | {r['loop_s'] * 1e3:.3f} | "
            f"{r['batched_s'] * 1e3:.3f} | {r['speedup']:.2f}x |"
            for r in rows
        ),
        "",
    ]
    for path in write_results(args.out, "powersgd-orthogonalize", lines, {"meta": meta, "rows": rows}):
        print(f"wrote {path}")


def worker_main(args: argparse.Namespace) -> None:
    times = worker_jax(args) if args.framework == "jax" else worker_torch(args)
    rank = int(os.environ.get("RANK", os.environ.get("PMI_RANK", "0")))
    Path(f"{args.result}.rank{rank}").write_text(json.dumps(times))


def run(args: argparse.Namespace) -> None:
    meta = run_meta(("torch", "jax"), argv=sys.argv[1:])
    rows = []
    study = {}
    if args.study and args.study.exists():
        merged = network_study.merged(json.loads(args.study.read_text())["rows"])
        study = {network_study._key(r): r["step_s"] for r in merged if r.get("status") == "ok"}
    port = 29900
    with tempfile.TemporaryDirectory(prefix="bagua-breakdown-") as tmp:
        for rate in args.rates:
            with nh.Network(args.ranks, rate) as net:
                for model in args.models:
                    for framework in ("torch", "jax"):
                        port += 1
                        result = Path(tmp) / f"{framework}-{model}-{port}"
                        argv = [sys.executable, __file__, "--worker", "--framework", framework, "--model", model,
                                "--rank", str(args.rank), "--steps", str(args.steps), "--warmup", str(args.warmup),
                                "--batch-size", str(args.batch_size), "--result", str(result)]  # fmt: skip
                        env = child_env()
                        with open(Path(tmp) / f"{result.name}.log", "w") as log:
                            if framework == "jax":
                                net.run_mpi(argv, args.job_timeout, base_env=env, stdout=log)
                            else:
                                net.run_all(argv, port, args.job_timeout, base_env=env, stdout=log)
                        per_rank = [Path(f"{result}.rank{r}") for r in range(args.ranks)]
                        if not all(p.exists() for p in per_rank):
                            tail = (Path(tmp) / f"{result.name}.log").read_text(errors="replace")[-600:]
                            print(f"{framework} {model} {rate}: failed: {tail}", flush=True)
                            continue
                        loaded = [json.loads(p.read_text()) for p in per_rank]
                        row = {
                            "framework": framework,
                            "model": model,
                            "rate": nh.rate_label(net.rate),
                            **{k: statistics.fmean(statistics.median(t[k]) for t in loaded) for k in PIECES},
                        }
                        algorithm = f"powersgd_rank{args.rank}"
                        row["study_step_s"] = study.get((model, args.ranks, row["rate"], framework, algorithm))
                        rows.append(row)
                        print(
                            f"{row['rate']:>12} {model:>8} {framework:>5}: "
                            + " ".join(f"{k} {row[k] * 1e3:6.1f} ms" for k in PIECES),
                            flush=True,
                        )
    finish_meta(meta)
    lines = [
        f"# PowerSGD rank {args.rank}: where the step's time goes ({args.ranks} ranks)",
        "",
        *header_lines(meta),
        "- The machine is a 2-core box shared with other engineers' builds and tests: see the load average.",
        f"- {args.ranks} ranks, one per network namespace (benchmarks/harness/links.py); per rank the "
        f"median of {args.steps} steps after {args.warmup}, then the mean over the ranks. torch: gloo; JAX: the "
        "native MPI engine (as in the study).",
        "",
        "| rate | model | front end | compute ms | compression ms | waiting ms | wire ms | sum ms | study step ms |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        total = sum(r[k] for k in PIECES)
        study_cell = "" if r["study_step_s"] is None else f"{r['study_step_s'] * 1e3:.0f}"
        lines.append(
            f"| {r['rate']} | {r['model']} | {r['framework']} | "
            + " | ".join(f"{r[k] * 1e3:.1f}" for k in PIECES)
            + f" | {total * 1e3:.1f} | {study_cell} |"
        )
    lines.append("")
    for path in write_results(args.out, f"{args.name}", lines, {"meta": meta, "rows": rows}):
        print(f"wrote {path}")
    print("\n".join(lines))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", nargs="+", default=["100mbit", "none"])
    p.add_argument(
        "--models",
        nargs="+",
        default=list(network_study.MODELS),
        choices=[*network_study.MODELS, *network_study.GPT_MODELS],
    )
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--rank", type=int, default=4, help="PowerSGD's rank")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--job-timeout", type=float, default=180)
    p.add_argument("--study", type=Path, default=HERE / "results" / "network-study-peers.json")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--name", default="network-study-powersgd-breakdown")
    p.add_argument("--orthogonalize", action="store_true", help="time the orthogonalization alone (no network)")
    p.add_argument("--gpt-sizes", nargs="*", default=["small"], help="GPT sizes for --orthogonalize")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds for --orthogonalize")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--framework", choices=("torch", "jax"), help=argparse.SUPPRESS)
    p.add_argument("--model", choices=[*network_study.MODELS, *network_study.GPT_MODELS], help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p.parse_args(argv)


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker_main(arguments)
    elif arguments.orthogonalize:
        time_orthogonalization(arguments)
    else:
        nh.require_root()
        run(arguments)

"""PowerSGD's orthogonalization of one step's ``P`` factors: the per-matrix loop against one batched call.

No network: each front end orthogonalizes the ``P`` factors PowerSGD of rank ``--rank`` makes in one step of each
model (the network study's ``--models`` and the GPT sizes of ``--gpt-sizes``), the old way (torch: one matrix and
one column pair at a time; JAX: one jitted graph of per-matrix operations) and the batched way
(``orthogonalize_all``). A trial times ``--steps`` calls after one untimed call (JAX compiles there), one torch
thread; the table gives the median over the repeats of each trial's median call, and loop / batched.

    python benchmarks/powersgd_orthogonalize.py --models mlp matrices --gpt-sizes small gpt2 --repeats 5
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import network_study  # noqa: E402
from harness import results, study  # noqa: E402
from harness.repeats import paired_ratios  # noqa: E402
from powersgd_breakdown import factor_layout, synthetic_model  # noqa: E402

WAYS = ("loop", "batched")


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


def p_shapes(model: str, rank: int) -> list[tuple[int, int]]:
    """The ``(n, r)`` of every ``P`` factor PowerSGD of ``rank`` orthogonalizes in a step of ``model`` (a network
    study model, or ``gpt-<size>``)."""
    from bagua_common.workload.gpt_spec import gpt_config

    if model in network_study.MODELS:
        shapes = [tuple(p.shape) for p in synthetic_model(model)[1]]
    else:
        shapes = list(gpt_config(model.removeprefix("gpt-")).parameter_shapes().values())
    return [(view[0], r) for _, view, r in factor_layout(shapes, rank)[0]]


@functools.cache
def _calls(model: str, rank: int) -> dict[tuple[str, str], Any]:
    """Per (front end, way), the call that orthogonalizes ``model``'s factors (the same random matrices)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from bagua_jax.algorithms.powersgd import orthogonalize as jax_orthogonalize
    from bagua_jax.algorithms.powersgd import orthogonalize_all as jax_orthogonalize_all
    from bagua_torch.algorithms.powersgd import orthogonalize_all

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in p_shapes(model, rank)]
    tensors, jax_arrays = [torch.from_numpy(a) for a in arrays], [jnp.asarray(a) for a in arrays]
    jax_loop = jax.jit(lambda ps: [jax_orthogonalize(p) for p in ps])
    jax_batched = jax.jit(jax_orthogonalize_all)
    return {
        ("torch", "loop"): lambda: [orthogonalize_per_matrix(t.clone()) for t in tensors],
        ("torch", "batched"): lambda: orthogonalize_all(tensors),
        ("jax", "loop"): lambda: jax.block_until_ready(jax_loop(jax_arrays)),
        ("jax", "batched"): lambda: jax.block_until_ready(jax_batched(jax_arrays)),
    }


def add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=list(network_study.MODELS), choices=list(network_study.MODELS))
    p.add_argument("--gpt-sizes", nargs="*", default=["small"], help="GPT sizes")
    p.add_argument("--rank", type=int, default=4, help="PowerSGD's rank")
    p.add_argument("--steps", type=int, default=5, help="timed calls per trial")


def variants(args: argparse.Namespace) -> list[study.Variant]:
    models = [*args.models, *(f"gpt-{size}" for size in args.gpt_sizes)]
    return [
        study.Variant(f"{model} {fw} {way}", {"model": model, "framework": fw, "way": way})
        for model in models
        for fw in ("torch", "jax")
        for way in WAYS
    ]


def measure(trial: study.Trial) -> dict[str, Any]:
    v = trial.variant
    call = _calls(v["model"], trial.args.rank)[(v["framework"], v["way"])]
    call()
    times = []
    for _ in range(trial.args.steps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "matrices": len(p_shapes(v["model"], trial.args.rank))}


def report(data: dict[str, Any]) -> list[str]:
    head = ["model", "matrices", "front end", "loop ms", "batched ms", "loop / batched"]
    if data["rows"] and "variant" not in data["rows"][0]:  # written before the harness: one figure per variant
        cells = [
            [
                r["model"],
                r["matrices"],
                r["framework"],
                f"{r['loop_s'] * 1e3:.3f}",
                f"{r['batched_s'] * 1e3:.3f}",
                f"{r['speedup']:.2f}x",
            ]
            for r in data["rows"]
        ]
        return [*results.table(head, cells, "lrlrrr"), ""]
    spreads = study.summary(data["rows"], "step_s")
    cells = []
    for model in dict.fromkeys(r["model"] for r in data["rows"]):
        matrices = next(r["matrices"] for r in data["rows"] if r["model"] == model)
        for fw in ("torch", "jax"):
            loop, batched = (spreads.get((f"{model} {fw} {way}", 1, "none")) for way in WAYS)
            if not (loop and batched):
                continue
            ratio = paired_ratios(loop.values, batched.values) if len(loop.values) == len(batched.values) else None
            cells.append(
                [
                    model,
                    matrices,
                    fw,
                    loop.scaled(1e3).format(".3f"),
                    batched.scaled(1e3).format(".3f"),
                    ratio.format(".2f", "x") if ratio else f"{loop.median / batched.median:.2f}x",
                ]
            )
    settings = data["settings"]
    return [
        f"PowerSGD rank {settings['rank']}; per trial the median of {settings['steps']} calls after one untimed call, "
        "one torch thread; the JAX loop is one jitted graph of per-matrix operations. ms: median over the repeats "
        "[min, max]; loop / batched: the ratio per repeat, median [min, max].",
        "",
        *results.table(head, cells, "lrlrrr"),
        "",
    ]


STUDY = study.Study(
    name="powersgd-orthogonalize",
    title="PowerSGD: orthogonalizing one step's P factors, per-matrix loop against batched",
    description=__doc__,
    variants=variants,
    measure=measure,
    ranks=(1,),
    repeats=5,
    network=False,
    add_options=add_options,
    report=report,
    plot=False,
)


if __name__ == "__main__":
    sys.exit(study.main(STUDY))

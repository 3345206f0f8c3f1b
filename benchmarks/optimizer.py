"""The fused optimizer's step beside torch's per-tensor, foreach and fused implementations, and end to end.

What is measured
----------------
**Step.** The time of ``optimizer.step()`` alone (gradients already in place), per step, for two
workloads: 400 float32 tensors of 16 to 4096 elements (log-uniform sizes), and the parameters of
a 24-block MLP with LayerNorms (192 small tensors). One row per optimizer (Adam, AdamW, SGD with
momentum, Adagrad, RMSprop, Adadelta, NAdam, and a plain-Python elementwise Adam), columns:

    for-loop        torch's implementation one tensor at a time (foreach=False): the baseline
    foreach         torch's foreach=True (where the class has it)
    fused           torch's fused=True (where it runs on this device)
    wrapper         bagua_torch.fuse_optimizer(the for-loop optimizer), gradients in its buffers
    wrapper+fused   bagua_torch.fuse_optimizer(the fused=True optimizer)
    wrapper copies  the wrapper when every step brings freshly allocated gradients
                    (``zero_grad()`` with set_to_none=True): the copy path

**End to end.** A 2-rank ByteGrad training step (forward, backward, the reduction, the step) of
the 24-block MLP on gloo, each rank a process with one thread: torch's Adam per tensor, torch's
foreach Adam, ``fuse_optimizer(Adam, module=model)`` on the model's buckets (no gradient copied),
and ``fuse_optimizer(Adam)`` standalone (the model copies the reduced gradients into its buffers).

Every configuration runs ``--steps`` timed steps per round; rounds interleave all configurations
in a fresh random order (the same on both ranks), and the tables give the median time per step
over ``--rounds`` rounds and its ratio to a baseline measured in the same rounds. torch runs on
one thread, as the wrapper's gain is per-tensor overhead, not parallelism; the step is timed in
CPU time of that thread (a shared machine preempts millisecond steps), the end-to-end step in
wall-clock time (it waits for the other rank). The bars (issue 18):
wrapper + Adam >= 2.5x the for-loop; wrapper + the plain-Python optimizer >= 4x the same
optimizer per tensor; wrapper + fused Adam >= 2x torch's fused Adam per tensor; the copy path
within 20% of the fast path.

How to run
----------
    python3 benchmarks/optimizer.py                      # writes benchmarks/results/optimizer-cpu.*
    python3 benchmarks/optimizer.py --rounds 3 --steps 3 --e2e-rounds 3 --out /tmp
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from harness.console import Progress
from harness.results import RESULTS, finish_meta, header_lines, run_meta, write_results
from torch import nn

from bagua_common.job.local_launch import free_port
from bagua_torch.fused_optimizer import fuse_optimizer

COLUMNS = ["for-loop", "foreach", "fused", "wrapper", "wrapper+fused", "wrapper copies"]


class PythonAdam(torch.optim.Optimizer):
    """Adam written elementwise in plain Python, as a user (or a third-party package) would."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                state["step"] += 1
                state["m"].mul_(b1).add_(p.grad, alpha=1 - b1)
                state["v"].mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                correction = (1 - b2 ** state["step"]) ** 0.5 / (1 - b1 ** state["step"])
                denominator = state["v"].sqrt().add_(group["eps"])
                p.addcdiv_(state["m"], denominator, value=-group["lr"] * correction)


OPTIMIZERS: dict[str, tuple[type, dict]] = {
    "Adam": (torch.optim.Adam, {"lr": 1e-3}),
    "AdamW": (torch.optim.AdamW, {"lr": 1e-3}),
    "SGD (momentum)": (torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 1e-2}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 1e-3}),
    "Adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "NAdam": (torch.optim.NAdam, {"lr": 1e-3}),
    "plain-Python Adam": (PythonAdam, {"lr": 1e-3}),
}


def tensors_400(seed: int = 0) -> list[nn.Parameter]:
    """400 float32 parameters of 16 to 4096 elements, sizes log-uniform."""
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(np.log(16), np.log(4096), 400)).astype(int)
    return [nn.Parameter(torch.randn(int(n))) for n in sizes]


def mlp_24_blocks() -> nn.Module:
    """A 24-block MLP: two Linear(64, 64) and two LayerNorms per block (192 parameter tensors)."""
    blocks = [
        nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64))
        for _ in range(24)
    ]
    return nn.Sequential(*blocks)


@functools.cache
def implementation(optimizer: str, column: str) -> dict | None:
    """The keyword that selects ``column``'s torch implementation, or None where the class lacks it."""
    cls, kwargs = OPTIMIZERS[optimizer]
    takes = inspect.signature(cls.__init__).parameters
    if column in ("foreach", "fused", "wrapper+fused"):
        key = "foreach" if column == "foreach" else "fused"
        if key not in takes:
            return None
        probe = nn.Parameter(torch.zeros(1))
        probe.grad = torch.zeros(1)
        try:  # fused=True is accepted by more classes than run it on this device
            cls([probe], **kwargs, **{key: True}).step()
        except (RuntimeError, ValueError, TypeError):
            return None
        return {key: True}
    return {"foreach": False} if "foreach" in takes else {}


Step = Callable[[], None]


def configuration(make_params: Callable[[], list[nn.Parameter]], optimizer: str, column: str) -> tuple[Step, Step]:
    """Build one cell's optimizer over fresh parameters with gradients set.

    Returns ``(prepare, step)``: ``prepare`` (untimed) stands for the backward pass, ``step``
    is what is timed.
    """
    cls, kwargs = OPTIMIZERS[optimizer]
    torch.manual_seed(0)
    params = make_params()
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    built = cls(params, **kwargs, **implementation(optimizer, column))
    if column.startswith("wrapper"):
        built = fuse_optimizer(built)
    built.step()  # state is created, and the wrapper verifies itself, outside the timing
    if column != "wrapper copies":
        return lambda: None, built.step

    def fresh_gradients() -> None:
        """What backward does after ``zero_grad()``: new gradient tensors, not buffer views."""
        for p, g in zip(params, grads):
            p.grad = g

    return fresh_gradients, built.step


def cells() -> list[tuple[str, str]]:
    """Every (optimizer, column) this device can run."""
    return [
        (optimizer, column)
        for optimizer in OPTIMIZERS
        for column in COLUMNS
        if implementation(optimizer, column) is not None
    ]


def measure_steps(
    make_params: Callable[[], list[nn.Parameter]], rounds: int, steps: int, progress: Progress
) -> dict[tuple[str, str], list[float]]:
    """Per-step CPU times (seconds, this thread's) of every cell, from interleaved rounds.

    CPU time rather than wall-clock time: on a shared, oversubscribed machine a step of a
    millisecond is preempted in most rounds, and the wall clock measures the other jobs.
    """
    steppers = {cell: configuration(make_params, *cell) for cell in cells()}
    times: dict[tuple[str, str], list[float]] = {cell: [] for cell in steppers}
    for r in range(rounds):
        order = list(steppers)
        random.Random(r).shuffle(order)
        for cell in order:
            prepare, step = steppers[cell]
            elapsed = 0.0
            for _ in range(steps):
                prepare()
                start = time.thread_time()
                step()
                elapsed += time.thread_time() - start
            times[cell].append(elapsed / steps)
        progress.line(f"round {r + 1}/{rounds}")
    return times


# ----------------------------------------------------------------------------- end to end (2 ranks)

E2E_ROWS = ["torch Adam per tensor", "torch Adam foreach", "fused on the buckets", "fused standalone"]
E2E_BATCH = 32


def e2e_rank(rounds: int, steps: int) -> None:
    """One rank of the end-to-end measurement; rank 0 prints each row's per-round times as one line."""
    import bagua_torch

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    bagua_torch.init_process_group(backend="gloo", timeout=120)
    runs = {}
    for row in E2E_ROWS:
        torch.manual_seed(0)
        model = bagua_torch.with_bagua(mlp_24_blocks(), [], "bytegrad")
        adam = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=row == "torch Adam foreach")
        if row == "fused on the buckets":
            adam = fuse_optimizer(adam, module=model)
        elif row == "fused standalone":
            adam = fuse_optimizer(adam)
        runs[row] = (model, adam)
    data = torch.Generator().manual_seed(rank)
    x, y = torch.randn(E2E_BATCH, 64, generator=data), torch.randn(E2E_BATCH, 64, generator=data)

    def train(row: str, count: int) -> float:
        model, adam = runs[row]
        start = time.perf_counter()
        for _ in range(count):
            adam.zero_grad(set_to_none=False)
            nn.functional.mse_loss(model(x), y).backward()
            adam.step()
        return (time.perf_counter() - start) / count

    for row in E2E_ROWS:
        train(row, 2)  # state, verification and the first collectives outside the timing
    times: dict[str, list[float]] = {row: [] for row in E2E_ROWS}
    for r in range(rounds):
        order = list(E2E_ROWS)
        random.Random(r).shuffle(order)  # the same order on both ranks
        for row in order:
            times[row].append(train(row, steps))
    copied = runs["fused on the buckets"][1].stats()
    if rank == 0:
        print(json.dumps({"times": times, "bucket_stats": copied}), flush=True)
    for model, _ in runs.values():
        model.close()


def measure_e2e(rounds: int, steps: int, progress: Progress) -> dict:
    """Run :func:`e2e_rank` on 2 local processes; rank 0's per-round times per row."""
    env = {
        **os.environ,
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]),
    }
    command = [sys.executable, __file__, "--e2e-rank", "--e2e-rounds", str(rounds), "--e2e-steps", str(steps)]
    procs = [
        subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"an end-to-end rank failed: exit codes {[p.returncode for p in procs]}")
    progress.line("end to end")
    return json.loads(outputs[0].strip().splitlines()[-1])


# ----------------------------------------------------------------------------- report


def step_tables(name: str, times: dict[tuple[str, str], list[float]]) -> tuple[list[str], dict]:
    median = {cell: statistics.median(t) for cell, t in times.items()}
    lines = [
        f"## Step: {name}",
        "",
        "CPU ms per step (speed-up over the row's for-loop); `-`: torch has no such implementation here.",
        "",
        "| optimizer | " + " | ".join(COLUMNS) + " | best torch vs wrapper |",
        "|---|" + "---:|" * (len(COLUMNS) + 1),
    ]
    for optimizer in OPTIMIZERS:
        base = median[(optimizer, "for-loop")]
        row = [
            f"{median[(optimizer, c)] * 1e3:.3f} ({base / median[(optimizer, c)]:.1f}x)"
            if (optimizer, c) in median
            else "-"
            for c in COLUMNS
        ]
        torch_best = min(median[(optimizer, c)] for c in ("for-loop", "foreach", "fused") if (optimizer, c) in median)
        wrapper_best = min(median[(optimizer, c)] for c in ("wrapper", "wrapper+fused") if (optimizer, c) in median)
        lines.append(f"| {optimizer} | " + " | ".join(row) + f" | {torch_best / wrapper_best:.2f}x |")
    bars = [
        ("Adam wrapper vs for-loop", ("Adam", "for-loop"), ("Adam", "wrapper"), 2.5),
        (
            "plain-Python wrapper vs per tensor",
            ("plain-Python Adam", "for-loop"),
            ("plain-Python Adam", "wrapper"),
            4.0,
        ),
        ("Adam wrapper+fused vs torch fused", ("Adam", "fused"), ("Adam", "wrapper+fused"), 2.0),
        ("Adam copy path vs fast path", ("Adam", "wrapper"), ("Adam", "wrapper copies"), 1 / 1.2),
    ]
    lines += ["", "| bar | measured | needed | met |", "|---|---:|---:|---|"]
    for label, slow, fast, needed in bars:
        if slow in median and fast in median:
            ratio = median[slow] / median[fast]
            lines.append(f"| {label} | {ratio:.2f}x | {needed:.2f}x | {'yes' if ratio >= needed else 'no'} |")
    lines.append("")
    payload = {f"{o} / {c}": {"median_s": median[(o, c)], "samples_s": times[(o, c)]} for o, c in times}
    return lines, payload


def e2e_table(result: dict, rounds: int, steps: int) -> list[str]:
    times = result["times"]
    median = {row: statistics.median(t) for row, t in times.items()}
    base = median["torch Adam per tensor"]
    lines = [
        "## End to end: 2-rank ByteGrad training step, 24-block MLP, batch 32 per rank (gloo, 1 thread per rank)",
        "",
        f"Median ms per step over {rounds} interleaved rounds of {steps} steps (rank 0).",
        "",
        "| optimizer | ms per step | speed-up vs torch Adam per tensor |",
        "|---|---:|---:|",
    ]
    lines += [f"| {row} | {median[row] * 1e3:.2f} | {base / median[row]:.2f}x |" for row in E2E_ROWS]
    stats = result["bucket_stats"]
    lines += [
        "",
        f"Fused on the buckets: gradient bytes copied by the optimizer {stats['bytes_copied']}, by the model "
        f"{stats['model_bytes_copied']}, over all its steps.",
        "",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--e2e-rounds", type=int, default=9)
    parser.add_argument("--e2e-steps", type=int, default=5)
    parser.add_argument("--e2e-rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.e2e_rank:
        e2e_rank(args.e2e_rounds, args.e2e_steps)
        return
    torch.set_num_threads(1)
    meta = run_meta(["torch"], argv=sys.argv[1:], rounds=args.rounds, steps=args.steps, threads=1)
    workloads = {
        "400 tensors (16-4096 elements)": tensors_400,
        "24-block MLP (192 tensors)": lambda: list(mlp_24_blocks().parameters()),
    }
    progress = Progress(len(workloads) * args.rounds + 1)
    body, payload = [], {}
    for name, make_params in workloads.items():
        lines, payload[name] = step_tables(name, measure_steps(make_params, args.rounds, args.steps, progress))
        body += lines
    e2e = measure_e2e(args.e2e_rounds, args.e2e_steps, progress)
    body += e2e_table(e2e, args.e2e_rounds, args.e2e_steps)
    payload["end to end"] = e2e
    finish_meta(meta)
    markdown = [
        "# Fused optimizer on CPU: step and end to end",
        "",
        *header_lines(meta),
        f"- step: median CPU time of one thread over {args.rounds} interleaved rounds of {args.steps} steps",
        "",
        *body,
    ]
    md_path, _ = write_results(args.out, "optimizer-cpu", markdown, {**meta, "results": payload})
    print("\n".join(markdown))
    print(f"written: {md_path}", file=sys.stderr)


if __name__ == "__main__":
    main()

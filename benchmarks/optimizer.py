"""The fused optimizer's step next to torch's per-tensor, foreach and fused implementations.

What is measured
----------------
The time of ``optimizer.step()`` alone (gradients already in place), per step, for two
workloads: 400 float32 tensors of 16 to 4096 elements (log-uniform sizes), and the
parameters of a 24-block MLP with LayerNorms (192 small tensors). Rows:

    torch for-loop         torch.optim.Adam(foreach=False): one tensor at a time (the baseline)
    torch foreach          torch.optim.Adam(foreach=True)
    torch fused            torch.optim.Adam(fused=True)
    fused wrapper          bagua_torch.fuse_optimizer(Adam(foreach=False))
    fused wrapper + fused  bagua_torch.fuse_optimizer(Adam(fused=True))
    python per tensor      a plain-Python elementwise Adam (no foreach, no fused kernel)
    fused wrapper + python bagua_torch.fuse_optimizer(that optimizer)
    fused wrapper, copies  the wrapper when every step brings freshly allocated gradients
                           (``zero_grad()`` with set_to_none=True): the copy path

Every configuration runs ``--steps`` timed steps per round (for the copy path, the fresh
gradients are assigned outside the timing, as backward would allocate them); rounds interleave all configurations
in a fresh random order, and the table gives the median time per step over ``--rounds``
rounds and its ratio to a baseline measured in the same rounds. torch runs on one thread
(``torch.set_num_threads(1)``), as the fused wrapper's gain is per-tensor overhead, not
parallelism. The bars (issue 18): wrapper + Adam >= 2.5x the for-loop; wrapper + the
plain-Python optimizer >= 4x the same optimizer per tensor; wrapper + fused Adam >= 2x
torch's fused Adam per tensor; the copy path within 20% of the fast path.

How to run
----------
    python3 benchmarks/optimizer.py                      # writes benchmarks/results/optimizer-cpu.*
    python3 benchmarks/optimizer.py --rounds 3 --steps 5 --out /tmp
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bagua_torch.fused_optimizer import fuse_optimizer  # noqa: E402


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


def tensors_400(seed: int = 0) -> list[nn.Parameter]:
    """400 float32 parameters of 16 to 4096 elements, sizes log-uniform."""
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(np.log(16), np.log(4096), 400)).astype(int)
    return [nn.Parameter(torch.randn(int(n))) for n in sizes]


def mlp_24_blocks() -> list[nn.Parameter]:
    """The parameters of a 24-block MLP (two Linear(64, 64) and two LayerNorms per block)."""
    blocks = [
        nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64))
        for _ in range(24)
    ]
    return list(nn.Sequential(*blocks).parameters())


Step = Callable[[], None]


def configuration(make_params: Callable[[], list[nn.Parameter]], name: str) -> tuple[Step, Step]:
    """Build one row's optimizer over fresh parameters with gradients set.

    Returns ``(prepare, step)``: ``prepare`` (untimed) stands for the backward pass, ``step``
    is what is timed.
    """
    torch.manual_seed(0)
    params = make_params()
    grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    builders = {
        "torch for-loop": lambda: torch.optim.Adam(params, lr=1e-3, foreach=False),
        "torch foreach": lambda: torch.optim.Adam(params, lr=1e-3, foreach=True),
        "torch fused": lambda: torch.optim.Adam(params, lr=1e-3, fused=True),
        "fused wrapper": lambda: fuse_optimizer(torch.optim.Adam(params, lr=1e-3, foreach=False)),
        "fused wrapper + fused": lambda: fuse_optimizer(torch.optim.Adam(params, lr=1e-3, fused=True)),
        "python per tensor": lambda: PythonAdam(params, lr=1e-3),
        "fused wrapper + python": lambda: fuse_optimizer(PythonAdam(params, lr=1e-3)),
        "fused wrapper, copies": lambda: fuse_optimizer(torch.optim.Adam(params, lr=1e-3, foreach=False)),
    }
    optimizer = builders[name]()
    optimizer.step()  # state is created, and the wrapper verifies itself, outside the timing
    if name != "fused wrapper, copies":
        return lambda: None, optimizer.step

    def fresh_gradients() -> None:
        """What backward does after ``zero_grad()``: new gradient tensors, not buffer views."""
        for p, g in zip(params, grads):
            p.grad = g

    return fresh_gradients, optimizer.step


ROWS = [
    "torch for-loop",
    "torch foreach",
    "torch fused",
    "fused wrapper",
    "fused wrapper + fused",
    "python per tensor",
    "fused wrapper + python",
    "fused wrapper, copies",
]
BARS = [
    ("fused wrapper", "torch for-loop", 2.5),
    ("fused wrapper + python", "python per tensor", 4.0),
    ("fused wrapper + fused", "torch fused", 2.0),
    ("fused wrapper, copies", "fused wrapper", 1 / 1.2),
]


def measure(make_params: Callable[[], list[nn.Parameter]], rounds: int, steps: int) -> dict[str, list[float]]:
    """Median-ready per-step times (seconds) of every row, from interleaved rounds."""
    steppers = {name: configuration(make_params, name) for name in ROWS}
    times: dict[str, list[float]] = {name: [] for name in ROWS}
    for r in range(rounds):
        order = list(ROWS)
        random.Random(r).shuffle(order)
        for name in order:
            prepare, step = steppers[name]
            elapsed = 0.0
            for _ in range(steps):
                prepare()
                start = time.perf_counter()
                step()
                elapsed += time.perf_counter() - start
            times[name].append(elapsed / steps)
        print(f"  round {r + 1}/{rounds}", end="\r", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    workloads = {"400 tensors (16-4096 elements)": tensors_400, "24-block MLP (192 tensors)": mlp_24_blocks}
    results = {}
    lines = [
        "# Fused optimizer step on CPU",
        "",
        f"Command: `python3 {' '.join(sys.argv)}`; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch {torch.__version__}, one thread; load average before "
        f"{os.getloadavg()[0]:.1f}. Median ms per step over {args.rounds} interleaved rounds of "
        f"{args.steps} steps; speed-up over the baseline named in the row.",
        "",
    ]
    for workload, make_params in workloads.items():
        print(workload, file=sys.stderr)
        times = measure(make_params, args.rounds, args.steps)
        median = {name: statistics.median(t) for name, t in times.items()}
        results[workload] = {"median_s": median, "samples_s": times}
        lines += [f"## {workload}", "", "| row | ms per step | speed-up |", "|---|---:|---:|"]
        for name in ROWS:
            base = "python per tensor" if "python" in name else "torch for-loop"
            if name == "fused wrapper + fused":
                base = "torch fused"
            lines.append(f"| {name} | {median[name] * 1e3:.3f} | {median[base] / median[name]:.2f}x vs {base} |")
        lines += ["", "| bar | measured | needed | met |", "|---|---:|---:|---|"]
        for fast, slow, needed in BARS:
            ratio = median[slow] / median[fast]
            lines.append(f"| {fast} vs {slow} | {ratio:.2f}x | {needed:.2f}x | {'yes' if ratio >= needed else 'no'} |")
        lines.append("")
    lines.append(f"Load average after: {os.getloadavg()[0]:.1f}.")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "optimizer-cpu.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "optimizer-cpu.json"), "w") as f:
        json.dump({"command": sys.argv, "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

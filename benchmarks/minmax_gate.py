"""The convergence gate's algorithms that send min-max codes, trained under a label, so that two builds compare.

A change to the min-max format changes the bytes these algorithms exchange. This script runs the GPT
convergence gate's training (``tests/gpt_gate.py``: its GPT from the shared AdamW start; JAX on a 2-device mesh,
torch on 2 nodes of 2 ranks) for ByteGrad, QAdam, low-precision decentralized and DiLoCo with a ``uint8`` outer
exchange, over several seeds, and records every rank's held-out loss under ``--label``. Run it once on each build; the
report puts the labels side by side, with the seed-to-seed spread as the yardstick.

How to run::

    python benchmarks/minmax_gate.py --label before
    # ... rebuild with the change ...
    python benchmarks/minmax_gate.py --label after

It writes ``minmax-gate.json`` and ``minmax-gate.md`` to ``--out`` (default ``benchmarks/results/``), keeping the
labels of earlier runs there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.options import add_out_option  # noqa: E402
from harness.results import finish_meta, run_meta, write_results  # noqa: E402

ALGORITHMS = ("bytegrad", "qadam", "low_precision_decentralized", "diloco")
MINMAX_OPTIONS = {"diloco": {"outer_exchange": "uint8"}}
"""Options beyond the gate's that make an algorithm send min-max codes (DiLoCo's default exchange is fp32)."""
SEEDS = (0, 1, 2)


def _use_minmax_options() -> None:
    """Add :data:`MINMAX_OPTIONS` to the gate's options (read by both front ends' gate runs at call time)."""
    import gpt_gate

    for name, options in MINMAX_OPTIONS.items():
        gpt_gate.OPTIONS[name] = {**gpt_gate.OPTIONS.get(name, {}), **options}


def torch_gate(names: list[str], seed: int, start: dict) -> dict:
    """Rank body: the gate's torch run of ``names`` from the parameters ``start`` with :data:`MINMAX_OPTIONS`."""
    _use_minmax_options()
    from gpt_workers_torch import gate

    return gate(names, seed, start)


def run_seed(seed: int) -> dict[str, dict[str, list[float]]]:
    """front end -> algorithm -> every rank's held-out loss, for one seed."""
    from multiprocess import run_ranks
    from test_gpt_convergence_gate import _jax_mesh_run, pretrained

    _use_minmax_options()
    from gpt_gate import NRANKS, TORCH_NODES

    os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    losses: dict[str, dict[str, list[float]]] = {"jax": {}, "torch": {}}
    start = pretrained(seed)
    for name in ALGORITHMS:
        losses["jax"][name] = [r["heldout_loss"] for r in _jax_mesh_run(name, seed, start)]
    ranks = run_ranks("minmax_gate:torch_gate", NRANKS * TORCH_NODES, list(ALGORITHMS), seed, start, timeout=900)
    ranks = sorted((r.value for r in ranks), key=lambda v: v["rank"])
    for name in ALGORITHMS:
        losses["torch"][name] = [r[name]["heldout_loss"] for r in ranks]
    return losses


def report(runs: dict[str, dict]) -> list[str]:
    """One row per (front end, algorithm): each label's mean held-out loss over seeds and ranks, its per-seed means,
    and the difference of the labels' means next to the largest difference between two seeds of one label."""
    labels = list(runs)
    lines = [
        "# Min-max algorithms on the gate's GPT, by build",
        "",
        "Held-out loss (nats per byte) after the convergence gate's steps, mean over ranks; per seed "
        f"({', '.join(str(s) for s in SEEDS)}) and their mean.",
        "",
        "| front end | algorithm | " + " | ".join(f"{label} (per seed)" for label in labels) + " | "
        + " | ".join(f"{label} mean" for label in labels) + " | spread between seeds |",
        "|---|---|" + "---|" * (2 * len(labels) + 1),
    ]  # fmt: skip
    for front_end in ("jax", "torch"):
        for name in ALGORITHMS:
            per_seed = {
                label: [sum(runs[label][str(s)][front_end][name]) / len(runs[label][str(s)][front_end][name])
                        for s in SEEDS if str(s) in runs[label]]
                for label in labels
            }  # fmt: skip
            means = {label: sum(v) / len(v) for label, v in per_seed.items() if v}
            spread = max((max(v) - min(v)) for v in per_seed.values() if v)
            lines.append(
                f"| {front_end} | {name} | "
                + " | ".join(", ".join(f"{x:.4f}" for x in per_seed[label]) for label in labels)
                + " | "
                + " | ".join(f"{means[label]:.4f}" for label in labels)
                + f" | {spread:.4f} |"
            )
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", required=True, help="the build's name in the report (before, after, ...)")
    add_out_option(parser)
    args = parser.parse_args(argv)
    path = args.out / "minmax-gate.json"
    previous = json.loads(path.read_text()) if path.exists() else {"runs": {}, "labels": {}}
    runs, labels = previous["runs"], previous["labels"]
    runs[args.label] = {}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    meta = run_meta(["jax", "torch"], argv=sys.argv[1:] if argv is None else argv)
    meta["commit"] = commit.stdout.strip()
    for seed in SEEDS:
        runs[args.label][str(seed)] = run_seed(seed)
        print(f"seed {seed}: {json.dumps(runs[args.label][str(seed)])}", flush=True)
    finish_meta(meta)
    labels[args.label] = meta
    lines = report(runs) + [
        f"- {label}: commit {m['commit']}, `{m['command']}`, {m['date']}" for label, m in labels.items()
    ]
    md, _ = write_results(args.out, "minmax-gate", [*lines, ""], {"runs": runs, "labels": labels})
    print(f"wrote {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Time per step of ``bagua_torch`` training against a baseline commit: 2 ranks, gloo and MPI, side by side.

The baseline tree (``--baseline``, a commit: the code before a change) is exported with ``git
archive`` into a temporary folder; each job's ranks import either it or this checkout (the
``PYTHONPATH`` of the ranks names one tree alone; both use the installed native library). Per
repeat, each engine runs one job with each tree, one after the other and each alone on the
machine (which goes first alternates between repeats), each behind the harness's load gate (again
when it met load): two jobs at once on 2 cores would measure which tree's ranks win the cores
rather than their speed. A job is one 2-rank run that wraps an MLP with ``with_bagua`` once per
algorithm and bucket size (SGD, fixed random data) and times ``--steps`` steps after ``--warmup``;
a configuration's time per step is the slower rank's median step.

The table gives, per configuration, the median time per step of each tree and the ratio
new/old: the geometric mean of the repeats' ratios, with a 95% bootstrap interval over them.

    python benchmarks/torch_step.py --baseline fca22f2 --repeats 6
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENGINES = ("gloo", "mpi")
ALGORITHMS = ("gradient_allreduce", "bytegrad")


def worker(args: argparse.Namespace) -> None:
    """One rank: time every algorithm and bucket size; write ``{"step_s": {config: s}, "tree": ...}`` to
    ``--result``."""
    import torch

    import bagua_torch

    torch.set_num_threads(1)
    group = bagua_torch.init_process_group(timeout=120)
    generator = torch.Generator().manual_seed(1000 + group.rank)
    x = torch.randn(args.batch, args.width, generator=generator)
    step_s = {}
    for algorithm, bucket_bytes in itertools.product(args.algorithms, args.bucket_bytes):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
        model = torch.nn.Sequential(*itertools.chain.from_iterable((layer, torch.nn.ReLU()) for layer in layers))
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        wrapped = bagua_torch.with_bagua(model, [optimizer], algorithm, bucket_bytes=bucket_bytes)

        def step() -> None:
            optimizer.zero_grad(set_to_none=True)
            wrapped(x).square().mean().backward()
            optimizer.step()

        for _ in range(args.warmup):
            step()
        group.world.barrier()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        step_s[f"{algorithm} {bucket_bytes}"] = statistics.median(times)
        wrapped.close()
    result = {"step_s": step_s, "tree": str(Path(bagua_torch.__file__).parent.parent)}
    Path(f"{args.result}.{group.rank}").write_text(json.dumps(result))


def _start(tree: Path, engine: str, args: argparse.Namespace, result: Path) -> list[subprocess.Popen]:
    """Start a 2-rank job importing ``tree``; its ranks write to ``result``.0 and .1."""
    from bagua_common.job.local_launch import free_port, mpiexec

    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--result",
        str(result),
        "--algorithms",
        *args.algorithms,
        "--bucket-bytes",
        *map(str, args.bucket_bytes),
        *(f"--{k}={getattr(args, k)}" for k in ("steps", "warmup", "width", "layers", "batch")),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(tree),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    if engine == "mpi":
        return [subprocess.Popen([mpiexec(), "-n", "2", *command], env=env)]
    return [
        subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"})
        for r in range(2)
    ]


def _finish(procs: list[subprocess.Popen], tree: Path, result: Path) -> dict[str, float]:
    """Per ``"algorithm bucket_bytes"``, the slower rank's time per step of the job :func:`_start` started."""
    for proc in procs:
        if proc.wait(timeout=600) != 0:
            raise RuntimeError(f"the job of {tree} failed (exit {proc.returncode})")
    ranks = [json.loads(Path(f"{result}.{r}").read_text()) for r in range(2)]
    if any(Path(rank["tree"]).resolve() != tree.resolve() for rank in ranks):
        raise RuntimeError(f"the ranks imported {[rank['tree'] for rank in ranks]}, not {tree}")
    return {config: max(rank["step_s"][config] for rank in ranks) for config in ranks[0]["step_s"]}


def _ratio_interval(old: list[float], new: list[float], draws: int = 10000) -> tuple[float, float, float]:
    """The geometric mean of new/old over the repeats and a 95% bootstrap interval of it."""
    import numpy as np

    logs = np.log(np.asarray(new) / np.asarray(old))
    rng = np.random.default_rng()
    means = logs[rng.integers(0, len(logs), (draws, len(logs)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return math.exp(logs.mean()), math.exp(low), math.exp(high)


def main(args: argparse.Namespace, argv: list[str]) -> None:
    sys.path.insert(0, str(ROOT))  # this checkout's packages, before any installed copy
    import numpy as np
    from harness.console import Progress, Transcript
    from harness.jobs import export_tree
    from harness.load import LoadGate
    from harness.results import finish_meta, load_lines, run_meta, write_results

    configs = [(e, a, b) for e in args.engines for a in args.algorithms for b in args.bucket_bytes]
    meta = run_meta(["torch"], argv=argv, baseline=args.baseline)
    times: dict[tuple[str, str, int], dict[str, list[float]]] = {c: {"old": [], "new": []} for c in configs}
    loads = []
    progress = Progress(args.repeats * len(args.engines))
    gate = LoadGate(args.max_load)
    with tempfile.TemporaryDirectory(prefix="bagua-torch-step-") as tmp:
        trees = {"old": export_tree(args.baseline, Path(tmp)), "new": ROOT}

        def job(which: str, engine: str) -> dict[str, float]:
            with tempfile.TemporaryDirectory(dir=tmp) as work:
                result = Path(work) / which
                return _finish(_start(trees[which], engine, args, result), trees[which], result)

        for repeat in range(args.repeats):
            for engine in args.engines:
                measured = {}
                for which in ("old", "new") if repeat % 2 == 0 else ("new", "old"):
                    label = f"{engine} {which} repeat {repeat}"
                    value, load, aside = gate.measure(lambda w=which, e=engine: job(w, e), label)
                    loads += [load.as_dict(), *(x.as_dict() for x in aside)]
                    if load.published:
                        measured[which] = value
                    else:
                        progress.line(f"repeat {repeat + 1}: {engine} {which}: not published ({load.describe()})")
                if len(measured) < len(trees):
                    continue
                for (e, algorithm, bucket), t in times.items():
                    if e == engine:
                        for which in trees:
                            t[which].append(measured[which][f"{algorithm} {bucket}"])
                progress.line(f"repeat {repeat + 1}: {engine}")
    gate.close()
    finish_meta(meta)
    transcript = Transcript()
    transcript.say(f"{'engine':6} {'algorithm':19} {'bucket B':>9} {'old ms':>8} {'new ms':>8}  new/old [95% interval]")
    rows = []
    for (engine, algorithm, bucket), t in times.items():
        if len(t["old"]) < 2:
            transcript.say(f"{engine:6} {algorithm:19} {bucket:9d} fewer than 2 published repeats")
            continue
        ratio, low, high = _ratio_interval(t["old"], t["new"])
        old_ms, new_ms = 1e3 * float(np.median(t["old"])), 1e3 * float(np.median(t["new"]))
        transcript.say(
            f"{engine:6} {algorithm:19} {bucket:9d} {old_ms:8.2f} {new_ms:8.2f}  {ratio:.3f} [{low:.3f}, {high:.3f}]"
        )
        rows.append({"engine": engine, "algorithm": algorithm, "bucket_bytes": bucket, **t, "ratio": ratio,
                     "interval": [low, high]})  # fmt: skip
    lines = transcript.markdown(f"bagua_torch time per step, this tree against {args.baseline}", meta)
    at = lines.index("```") - 1  # after the header list
    lines[at:at] = load_lines(loads)
    paths = write_results(args.out, args.stem, lines, {**meta, "loads": loads, "rows": rows})
    print(f"wrote {paths[0]} and {paths[1]}", file=sys.stderr)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default="fca22f2", help="the commit to compare against (default fca22f2)")
    parser.add_argument("--repeats", type=int, default=6, help="runs of each configuration per tree")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--algorithms", nargs="+", choices=ALGORITHMS, default=list(ALGORITHMS))
    parser.add_argument("--bucket-bytes", nargs="+", type=int, default=[16384], help="bucket sizes (bytes)")
    parser.add_argument("--steps", type=int, default=40, help="timed steps per job")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--width", type=int, default=256, help="the MLP's width")
    parser.add_argument("--layers", type=int, default=8, help="the MLP's layers")
    parser.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    parser.add_argument("--stem", default="torch-step-2ranks", help="the results files' name")
    parser.add_argument("--max-load", type=float, default=None, help="the load gate's limit (default 0.75 per core)")
    parser.add_argument("--out", type=Path, default=HERE / "results", help="results directory")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse(sys.argv[1:])
    if arguments.worker:
        worker(arguments)  # imports only torch and the tree under test, which may predate the harness
    else:
        main(arguments, sys.argv[1:])

"""Synchronous step time with the balanced sampler against torch's DistributedSampler.

Sample lengths are skewed (log-normal, 16..512 tokens). Three parts, each repeated with the two
samplers interleaved, ratios reported (balanced / DistributedSampler, lower is better):

1. model: the epoch's sum over steps of the largest per-rank cost, cost = length or length^2
   summed over a rank's samples, or (padded) the batch size times the longest sample's cost;
2. replay: each virtual rank's batch really runs forward+backward in this process (one thread,
   the fastest of three timings; the two samplers' steps interleaved), the step time is the
   largest of the ranks' measured times (only the synchrony is modelled), for a token-wise
   feed-forward layer on the rank's packed tokens (cost linear in length), per-sequence
   attention (quadratic) and a transformer encoder layer;
3. real: 2 and 4 processes (gloo, one thread each), a transformer encoder layer, each step
   ends with an all-reduce. Each rank runs its batch either sample by sample or as one batch
   padded to its longest sample (masked), as transformers are trained. The two samplers' steps
   alternate within one loop, so load spikes of the shared machine hit both alike; reported:
   the summed step times of rank 0, which each step's all-reduce makes the slowest rank's, and
   the time of the steps' all-reduces alone (steps without compute, alternating with the others).

The balanced sampler is ``BalancedBatchSampler(megabatch=...)``: steps of groups of similar cost.

It prints the three parts and writes them, with the machine, versions and load average, to
``balance-cpu.md`` and ``balance-cpu.json`` in ``--out`` (default ``benchmarks/results/``).

    python benchmarks/balance.py [--ranks 4] [--samples 256] [--batch 4] [--megabatch 64] [--repeats 3]
                                 [--parts model replay real] [--processes 2 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness.console import Transcript
from harness.machine import load_average
from harness.options import add_out_option, add_subset_option
from harness.results import finish_meta, run_meta, write_results
from torch import nn
from torch.utils.data import DistributedSampler

from bagua_common.job.local_launch import free_port
from bagua_torch.data import BalancedBatchSampler

D_MODEL = 128
TIMINGS_PER_BATCH = 3  # the fastest of these is the batch's compute (the box is shared)


def skewed_lengths(n: int, seed: int = 0) -> np.ndarray:
    return np.clip(np.random.default_rng(seed).lognormal(4.3, 0.8, n), 16, 512).astype(int)


def distributed_batches(n: int, ranks: int, batch: int, epoch: int) -> list[list[list[int]]]:
    """batches[rank][step] as DistributedSampler plus consecutive batching gives them."""
    out = []
    for rank in range(ranks):
        sampler = DistributedSampler(range(n), num_replicas=ranks, rank=rank, seed=1)
        sampler.set_epoch(epoch)
        indices = list(sampler)
        out.append([indices[i : i + batch] for i in range(0, len(indices), batch)])
    return out


def balanced_batches(lengths, ranks: int, batch: int, epoch: int, megabatch: int | None) -> list[list[list[int]]]:
    out = []
    for rank in range(ranks):
        sampler = BalancedBatchSampler(lengths, batch_size=batch, num_replicas=ranks, rank=rank, megabatch=megabatch)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


class Attention(nn.Module):
    """Self-attention only: cost grows with length squared."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.view(x.shape[0], 4, -1).transpose(0, 1)
        return nn.functional.scaled_dot_product_attention(q, q, q).transpose(0, 1).reshape(x.shape)


def models() -> dict[str, tuple[nn.Module, bool]]:
    """Each model and whether it is token-wise (so a rank's samples run packed, as one)."""
    feed_forward = nn.Sequential(nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL))
    attention = nn.Sequential(nn.Linear(D_MODEL, D_MODEL), Attention())
    layer = nn.TransformerEncoderLayer(D_MODEL, 4, 4 * D_MODEL, dropout=0.0)
    return {
        "linear (feed-forward)": (feed_forward, True),
        "quadratic (attention)": (attention, False),
        "transformer layer": (layer, False),
    }


def run_batch(model: nn.Module, lengths: np.ndarray, indices: list[int], packed: bool) -> None:
    """Forward and backward of a batch: packed tokens, or each sample at its own length."""
    sizes = [int(lengths[i]) for i in indices]
    for size in [sum(sizes)] if packed else sizes:
        model(torch.randn(size, D_MODEL)).square().mean().backward()


def run_padded(model: nn.Module, lengths: np.ndarray, indices: list[int]) -> None:
    """Forward and backward of a batch-first transformer layer on the batch padded to its longest sample."""
    sizes = torch.tensor([int(lengths[i]) for i in indices])
    pad = torch.arange(int(sizes.max())) >= sizes[:, None]  # True where padded
    out = model(torch.randn(len(indices), pad.shape[1], D_MODEL), src_key_padding_mask=pad)
    out[~pad].square().mean().backward()


def modelled(lengths, ranks, batch, epoch, power, padded, megabatch) -> float:
    def total(batches):
        cost = lengths.astype(float) ** power
        rank_cost = (lambda b: len(b) * cost[b].max()) if padded else (lambda b: cost[b].sum())
        return sum(max(rank_cost(b[s]) for b in batches) for s in range(len(batches[0])))

    dist_total = total(distributed_batches(len(lengths), ranks, batch, epoch))
    return total(balanced_batches(lengths, ranks, batch, epoch, megabatch)) / dist_total


def step_seconds(model, packed, lengths, rank_batches) -> float:
    """The largest over ranks of the fastest of TIMINGS_PER_BATCH runs of each rank's batch."""
    times = []
    for batch in rank_batches:
        fastest = float("inf")
        for _ in range(TIMINGS_PER_BATCH):
            start = time.perf_counter()
            run_batch(model, lengths, batch, packed)
            fastest = min(fastest, time.perf_counter() - start)
        times.append(fastest)
    return max(times)


def replayed(model, packed, lengths, plain, balanced) -> tuple[float, float]:
    """Epoch seconds of both samplers, their steps interleaved so load spikes hit both alike."""
    totals = [0.0, 0.0]
    for step in range(max(len(plain[0]), len(balanced[0]))):
        for which, batches in enumerate((plain, balanced)):
            if step < len(batches[0]):
                totals[which] += step_seconds(model, packed, lengths, [b[step] for b in batches])
    return totals[0], totals[1]


REAL_MODES = ("sample by sample", "padded batch")


def real_worker(rank: int, world: int, port: int, lengths, batch: int, megabatch, repeats: int, queue) -> None:
    """One rank: every epoch, each mode, the two samplers' steps alternating; rank 0 reports the sums."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(D_MODEL, 4, 4 * D_MODEL, dropout=0.0, batch_first=True)
    token = torch.zeros(1)
    for repeat in range(repeats):
        plain = distributed_batches(len(lengths), world, batch, repeat)[rank]
        balanced = balanced_batches(lengths, world, batch, repeat, megabatch)[rank]
        for mode in REAL_MODES:
            totals = [0.0, 0.0, 0.0]  # DistributedSampler, balanced, the steps' synchronization alone
            for step in range(max(len(plain), len(balanced))):
                for which, batches in enumerate((plain, balanced, None)):
                    if batches is not None and step >= len(batches):
                        continue
                    dist.all_reduce(token)  # every rank starts the step together
                    start = time.perf_counter()
                    if batches is None:
                        pass
                    elif mode == "padded batch":
                        run_padded(model, lengths, batches[step])
                    else:
                        run_batch(model, lengths, batches[step], packed=False)
                    dist.all_reduce(token)
                    totals[which] += time.perf_counter() - start
            if rank == 0:
                queue.put((mode, *totals))
    dist.destroy_process_group()


def real_run(lengths, processes: int, batch: int, megabatch, repeats: int) -> dict[str, dict[str, list[float]]]:
    """Part 3 with ``processes`` ranks: per mode, the epoch seconds of both samplers and their ratios."""
    queue = mp.get_context("spawn").SimpleQueue()
    port = free_port()
    args = (processes, port, lengths, batch, megabatch, repeats, queue)
    mp.spawn(real_worker, args=args, nprocs=processes)
    keys = ("distributed_s", "balanced_s", "sync_s", "ratios")
    out: dict[str, dict[str, list[float]]] = {m: {k: [] for k in keys} for m in REAL_MODES}
    while not queue.empty():
        mode, plain, balanced, sync = queue.get()
        for key, value in zip(keys, (plain, balanced, sync, balanced / plain)):
            out[mode][key].append(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="virtual ranks of parts 1 and 2")
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--megabatch", type=int, default=64, help="the balanced sampler's megabatch (0: none)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--processes", type=int, nargs="+", default=[2, 4], help="ranks of the real runs")
    add_subset_option(parser, "--parts", ["model", "replay", "real"], "the parts to run")
    add_out_option(parser)
    args = parser.parse_args()
    settings = {name: value for name, value in vars(args).items() if name != "out"}
    meta = run_meta(["torch", "numpy"], argv=sys.argv[1:], settings=settings)
    torch.set_num_threads(1)
    megabatch = args.megabatch or None
    lengths = skewed_lengths(args.samples)
    transcript = Transcript()
    say = transcript.say
    results: dict[str, dict] = {"modelled": {}, "replayed": {}, "real": {}}
    say(f"{args.samples} samples, lengths {lengths.min()}..{lengths.max()} "
        f"(median {int(np.median(lengths))}), batch {args.batch}, megabatch {megabatch}")  # fmt: skip

    if "model" in args.parts:
        say("\n1. modelled cost, sum over steps of the max over ranks (20 epochs)")
        for ranks in sorted({args.ranks, *args.processes}):
            for padded in (False, True):
                for power, name in ((1, "linear"), (2, "quadratic")):
                    label = f"{ranks} ranks, {name}{', padded' if padded else ''}"
                    ratios = [modelled(lengths, ranks, args.batch, e, power, padded, megabatch) for e in range(20)]
                    results["modelled"][label] = statistics.median(ratios)
                    say(f"   {label:30s} balanced/DistributedSampler = {statistics.median(ratios):.3f}x")

    if "replay" in args.parts:
        say(f"\n2. replayed compute, {args.ranks} virtual ranks, 1 thread ({args.repeats} repeats)")
        torch.manual_seed(0)
        for name, (model, packed) in models().items():
            ratios, dist_times = [], []
            for repeat in range(args.repeats):
                plain = distributed_batches(len(lengths), args.ranks, args.batch, repeat)
                balanced = balanced_batches(lengths, args.ranks, args.batch, repeat, megabatch)
                d, b = replayed(model, packed, lengths, plain, balanced)
                ratios.append(b / d)
                dist_times.append(d)
            results["replayed"][name] = {"distributed_s": statistics.median(dist_times), "ratios": ratios}
            say(f"   {name:22s} DistributedSampler {statistics.median(dist_times):6.2f} s/epoch, "
                f"balanced/DistributedSampler = {statistics.median(ratios):.3f}x "
                f"(repeats {', '.join(f'{r:.3f}' for r in ratios)})")  # fmt: skip

    if "real" in args.parts:
        say(f"\n3. real runs (gloo, 1 thread per process), transformer layer ({args.repeats} repeats)")
        for processes in args.processes:
            load = load_average()[0]
            runs = real_run(lengths, processes, args.batch, megabatch, args.repeats)
            results["real"][f"{processes} processes"] = runs
            for mode, run in runs.items():
                say(f"   {processes} processes, {mode:16s} DistributedSampler "
                    f"{statistics.median(run['distributed_s']):6.2f} s/epoch (of which the steps' all-reduces alone "
                    f"{statistics.median(run['sync_s']):.2f} s), balanced/DistributedSampler = "
                    f"{statistics.median(run['ratios']):.3f}x (repeats {', '.join(f'{r:.3f}' for r in run['ratios'])}; "
                    f"load average {load:.1f} at the start)")  # fmt: skip

    finish_meta(meta)
    markdown = transcript.markdown("Balanced sampler against DistributedSampler", meta)
    md_path, _ = write_results(args.out, "balance-cpu", markdown, {**meta, "results": results})
    print(f"\nwrote {md_path}")


if __name__ == "__main__":
    main()

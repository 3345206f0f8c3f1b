"""Synchronous step time with the balanced sampler against torch's DistributedSampler.

Sample lengths are skewed (log-normal, 16..512 tokens). Three parts, each repeated with the two
samplers interleaved, ratios reported (balanced / DistributedSampler, lower is better):

1. model: the epoch's sum over steps of the largest per-rank cost, cost = length or length^2;
2. replay: each virtual rank's batch really runs forward+backward in this process (one thread,
   the fastest of two timings), the step time is the largest of the ranks' measured times (only
   the synchrony is modelled), for a token-wise feed-forward layer on the rank's packed tokens
   (cost linear in length), per-sequence attention (quadratic) and a transformer encoder layer;
3. real: two processes (gloo), each step ends with an all-reduce; epoch wall time.

    python benchmarks/balance.py [--ranks 4] [--samples 256] [--batch 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.utils.data import DistributedSampler

from bagua_torch.data import BalancedBatchSampler

D_MODEL = 128
TIMINGS_PER_BATCH = 2  # the fastest of these is the batch's compute (the box is shared)


def skewed_lengths(n: int, seed: int = 0) -> np.ndarray:
    return np.clip(np.random.default_rng(seed).lognormal(4.3, 0.8, n), 16, 512).astype(
        int
    )


def distributed_batches(
    n: int, ranks: int, batch: int, epoch: int
) -> list[list[list[int]]]:
    """batches[rank][step] as DistributedSampler plus consecutive batching gives them."""
    out = []
    for rank in range(ranks):
        sampler = DistributedSampler(range(n), num_replicas=ranks, rank=rank, seed=1)
        sampler.set_epoch(epoch)
        indices = list(sampler)
        out.append([indices[i : i + batch] for i in range(0, len(indices), batch)])
    return out


def balanced_batches(
    lengths, ranks: int, batch: int, epoch: int
) -> list[list[list[int]]]:
    out = []
    for rank in range(ranks):
        sampler = BalancedBatchSampler(
            lengths, batch_size=batch, num_replicas=ranks, rank=rank
        )
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


class Attention(nn.Module):
    """Self-attention only: cost grows with length squared."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = x.view(x.shape[0], 4, -1).transpose(0, 1)
        return (
            nn.functional.scaled_dot_product_attention(q, q, q)
            .transpose(0, 1)
            .reshape(x.shape)
        )


def models() -> dict[str, nn.Module]:
    return {
        "linear (feed-forward)": nn.Sequential(
            nn.Linear(D_MODEL, 4 * D_MODEL), nn.GELU(), nn.Linear(4 * D_MODEL, D_MODEL)
        ),
        "quadratic (attention)": nn.Sequential(
            nn.Linear(D_MODEL, D_MODEL), Attention()
        ),
        "transformer layer": nn.TransformerEncoderLayer(
            D_MODEL, 4, 4 * D_MODEL, dropout=0.0
        ),
    }


def run_batch(model: nn.Module, lengths: np.ndarray, indices: list[int]) -> None:
    """Forward and backward of each sample of a batch at its own length (no padding)."""
    for i in indices:
        x = torch.randn(int(lengths[i]), D_MODEL)
        model(x).square().mean().backward()


def modelled(lengths, ranks, batch, epoch, power) -> float:
    def total(batches):
        cost = lengths.astype(float) ** power
        return sum(
            max(cost[b[s]].sum() for b in batches) for s in range(len(batches[0]))
        )

    dist_total = total(distributed_batches(len(lengths), ranks, batch, epoch))
    return total(balanced_batches(lengths, ranks, batch, epoch)) / dist_total


def replayed(model, packed, lengths, batches) -> float:
    total = 0.0
    for step in range(len(batches[0])):
        times = []
        for rank_batches in batches:
            fastest = float("inf")
            for _ in range(TIMINGS_PER_BATCH):
                start = time.perf_counter()
                run_batch(model, lengths, rank_batches[step], packed)
                fastest = min(fastest, time.perf_counter() - start)
            times.append(fastest)
        total += max(times)
    return total


def real_worker(
    rank: int, world: int, port: int, lengths, batch: int, repeats: int, queue
) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(D_MODEL, 4, 4 * D_MODEL, dropout=0.0)
    token = torch.zeros(1)
    for repeat in range(repeats):
        for name, make in (("dist", distributed_batches), ("balanced", None)):
            if make is None:
                mine = balanced_batches(lengths, world, batch, repeat)[rank]
            else:
                mine = make(len(lengths), world, batch, repeat)[rank]
            dist.barrier()
            start = time.perf_counter()
            for step in mine:
                run_batch(model, lengths, step, packed=False)
                dist.all_reduce(token)
            if rank == 0:
                queue.put((name, time.perf_counter() - start))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lengths = skewed_lengths(args.samples)
    print(f"{args.samples} samples, lengths {lengths.min()}..{lengths.max()} "
          f"(median {int(np.median(lengths))}), {args.ranks} ranks, batch {args.batch}")  # fmt: skip

    print("\n1. modelled cost, sum over steps of the max over ranks (20 epochs)")
    for power, name in ((1, "linear"), (2, "quadratic")):
        ratios = [
            modelled(lengths, args.ranks, args.batch, e, power) for e in range(20)
        ]
        print(
            f"   {name:10s} balanced/DistributedSampler = {statistics.median(ratios):.3f}x"
        )

    print(
        f"\n2. replayed compute, {args.ranks} virtual ranks, 1 thread ({args.repeats} repeats)"
    )
    torch.manual_seed(0)
    for name, (model, packed) in models().items():
        ratios, dist_times = [], []
        for repeat in range(args.repeats):
            d = replayed(
                model,
                lengths,
                distributed_batches(len(lengths), args.ranks, args.batch, repeat),
            )
            b = replayed(
                model,
                lengths,
                balanced_batches(lengths, args.ranks, args.batch, repeat),
            )
            ratios.append(b / d)
            dist_times.append(d)
        print(f"   {name:22s} DistributedSampler {statistics.median(dist_times):6.2f} s/epoch, "
              f"balanced/DistributedSampler = {statistics.median(ratios):.3f}x "
              f"(repeats {', '.join(f'{r:.3f}' for r in ratios)})")  # fmt: skip

    print(
        f"\n3. real run, 2 processes (gloo), transformer layer ({args.repeats} repeats)"
    )
    queue = mp.get_context("spawn").SimpleQueue()
    port = 29400 + os.getpid() % 500
    mp.spawn(
        real_worker, args=(2, port, lengths, args.batch, args.repeats, queue), nprocs=2
    )
    times: dict[str, list[float]] = {"dist": [], "balanced": []}
    while not queue.empty():
        name, seconds = queue.get()
        times[name].append(seconds)
    ratios = [b / d for b, d in zip(times["balanced"], times["dist"])]
    print(f"   DistributedSampler {statistics.median(times['dist']):.2f} s/epoch, "
          f"balanced/DistributedSampler = {statistics.median(ratios):.3f}x")  # fmt: skip


if __name__ == "__main__":
    main()

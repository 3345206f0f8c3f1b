"""Data-parallel training of an MLP on scikit-learn's digits with PyTorch, one process per rank.

The task, the flags and the output of ``train_digits_jax.py``, through ``bagua_torch``.
Start it with the launcher, which sets the rank variables and runs the processes under
MPI for the native communicator::

    bagua-launch --nproc-per-node 2 --mpi examples/train_digits_torch.py --algorithm bytegrad

Each rank trains on its own slice of every global batch; rank 0 prints the loss,
the throughput and, at the end, the test accuracy of every rank's model.
"""

from __future__ import annotations

import argparse
import time

import torch
from digits_data import add_arguments, init_mlp, load, rank_batches
from torch import nn

import bagua_torch
from bagua_torch.algorithms import available_algorithms, get_algorithm


class MLP(nn.Module):
    """The 64-hidden-10 ReLU MLP of ``digits_data.init_mlp``."""

    def __init__(self, hidden: int):
        super().__init__()
        for name, value in init_mlp(hidden).items():
            self.register_parameter(name, nn.Parameter(torch.from_numpy(value)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.w1 + self.b1) @ self.w2 + self.b2


def optimizer_and_algorithm(name: str, model: nn.Module, lr: float):
    """Adam and the algorithm ``name``; QAdam and 1-bit Adam are optimizers themselves."""
    if name in ("qadam", "onebit_adam"):
        from bagua_torch.algorithms.onebit_adam import OneBitAdamOptimizer
        from bagua_torch.algorithms.qadam import QAdamOptimizer

        optimizer_class = QAdamOptimizer if name == "qadam" else OneBitAdamOptimizer
        optimizer = optimizer_class(model.parameters(), lr=lr)
        return optimizer, get_algorithm(name, optimizer=optimizer)
    return torch.optim.Adam(model.parameters(), lr=lr), get_algorithm(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser, sorted(available_algorithms()))
    args = parser.parse_args()

    torch.set_num_threads(1)  # one process per core
    group = bagua_torch.init_process_group(timeout=120)
    rank, size = group.rank, group.size
    if args.batch % size:
        parser.error(f"--batch {args.batch} must split evenly across {size} ranks")
    model = MLP(args.hidden)
    optimizer, algorithm = optimizer_and_algorithm(args.algorithm, model, args.lr)
    wrapped = bagua_torch.with_bagua(model, [optimizer], algorithm)
    x, y, x_test, y_test = (torch.from_numpy(a) for a in load())

    if rank == 0:
        print(f"{args.algorithm}: {size} ranks, {args.steps} steps, global batch {args.batch}", flush=True)
    start = last = time.perf_counter()
    for step, index in enumerate(rank_batches(x, args.batch, args.steps, rank, size), 1):
        index = torch.from_numpy(index)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(wrapped(x[index]), y[index].long())
        loss.backward()
        optimizer.step()
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            now = time.perf_counter()
            rate = args.log_every * args.batch / (now - last)
            print(f"step {step:5d}  loss {loss.item():.4f}  {rate:9.0f} examples/s", flush=True)
            last = now
    wrapped.close()  # stops AsyncModelAverage's rounds on every rank
    elapsed = time.perf_counter() - start
    with torch.no_grad():
        accuracy = (model(x_test).argmax(-1) == y_test).float().mean().reshape(1)
    accuracies = group.world.allgather(accuracy).numpy().ravel()
    if rank == 0:
        print(
            f"done in {elapsed:.1f} s ({args.steps * args.batch / elapsed:.0f} examples/s); "
            f"test accuracy per rank: {', '.join(f'{a:.3f}' for a in accuracies)}",
            flush=True,
        )
    group.close()


if __name__ == "__main__":
    main()

"""Data-parallel training of an MLP on scikit-learn's digits, one process per rank.

Start it with the launcher, which sets the rank variables and runs the processes
under MPI for the native communicator::

    bagua-launch --nproc-per-node 2 --mpi examples/train_digits_jax.py --algorithm bytegrad

Each rank trains on its own slice of every global batch; rank 0 prints the loss (the mean over the ranks),
the throughput and, at the end, the test accuracy of every rank's model.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from digits_data import add_arguments, init_mlp, load, rank_batches

from bagua_jax import NativeCommunicator
from bagua_jax.algorithms import AsyncModelAverage, algorithm_names, make_algorithm
from bagua_jax.trainer import DataParallel


def logits(params, x):
    return jax.nn.relu(x @ params["w1"] + params["b1"]) @ params["w2"] + params["b2"]


def loss_fn(params, batch):
    return optax.softmax_cross_entropy_with_integer_labels(logits(params, batch["x"]), batch["y"]).mean()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser, sorted(algorithm_names()))
    args = parser.parse_args()

    comm = NativeCommunicator.world(timeout=120)
    rank, size = int(comm.rank()), comm.size
    if args.batch % size:
        parser.error(f"--batch {args.batch} must split evenly across {size} ranks")
    algorithm = make_algorithm(args.algorithm, learning_rate=args.lr)
    optimizer = None if args.algorithm in ("qadam", "onebit_adam") else optax.adam(args.lr)
    trainer = DataParallel(loss_fn, optimizer, algorithm, communicator=comm)
    x, y, x_test, y_test = load()
    state = trainer.init(init_mlp(args.hidden))
    averager = (
        algorithm.averager(state.params, NativeCommunicator.world(timeout=120))
        if isinstance(algorithm, AsyncModelAverage)
        else None
    )

    if rank == 0:
        print(f"{args.algorithm}: {size} ranks, {args.steps} steps, global batch {args.batch}", flush=True)
    start = last = time.perf_counter()
    for step, index in enumerate(rank_batches(x, args.batch, args.steps, rank, size), 1):
        state, loss = trainer.step(state, {"x": x[index], "y": y[index]})
        if averager is not None:
            state = state._replace(params=averager.apply(state.params))
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            now = time.perf_counter()
            rate = args.log_every * args.batch / (now - last)
            print(f"step {step:5d}  loss {float(loss):.4f}  {rate:9.0f} examples/s", flush=True)
            last = now
    if averager is not None:
        averager.abort()
    elapsed = time.perf_counter() - start
    accuracy = float(jnp.mean(jnp.argmax(logits(state.params, x_test), -1) == y_test))
    accuracies = np.asarray(comm.allgather(jnp.float32(accuracy)))
    if rank == 0:
        print(
            f"done in {elapsed:.1f} s ({args.steps * args.batch / elapsed:.0f} examples/s); "
            f"test accuracy per rank: {', '.join(f'{a:.3f}' for a in accuracies)}",
            flush=True,
        )


if __name__ == "__main__":
    main()

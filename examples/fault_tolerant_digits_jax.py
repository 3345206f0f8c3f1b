"""Data-parallel training of the digits MLP that goes on when a rank dies (JAX, the native TCP engine).

Start it with the launcher, which starts a replacement for each rank that dies::

    bagua-launch --fault-tolerant --nproc-per-node 3 examples/fault_tolerant_digits_jax.py

Kill a rank (``kill -9``): the others abandon the step in flight and go on without it from the last committed
step, over the samples it would have taken, and the launcher starts a replacement that compiles its step, joins the
running job and receives the state from a live member. The replicas are compared by hash after every change of
members and at the end. Checkpoints (``--checkpoints``) are for a restart of the whole job, when every rank is gone.
"""

from __future__ import annotations

import argparse
import os

import jax.numpy as jnp
import optax
from digits_data import init_mlp, load
from train_digits_jax import logits, loss_fn  # the same MLP and loss as the example without fault tolerance

from bagua_common.fault_tolerance import DataPosition, FaultToleranceSettings, Membership
from bagua_common.fault_tolerance.kv_store import advertised_host
from bagua_common.job.checkpoint import latest
from bagua_jax import DataParallel, NativeCommunicator
from bagua_jax.fault_tolerance import FaultTolerantTrainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-per-rank", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--checkpoints", default="checkpoints", help="where to save every 100 steps")
    args = parser.parse_args()

    x, y, x_test, y_test = load()
    data = DataPosition(len(x), batch_per_rank=args.batch_per_rank, seed=0)
    settings = FaultToleranceSettings.from_environment()
    master = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    joining = os.environ.get("BAGUA_FT_JOIN") == "1"  # a replacement started by the launcher
    if joining:  # alone until admitted: its step compiles before it asks to join
        alone = NativeCommunicator.tcp_self(advertised_host(master[0]))  # listening where the job can reach it
        trainer = DataParallel(loss_fn, optax.adam(args.lr), "gradient_allreduce", communicator=alone)
        ft = FaultTolerantTrainer.joiner(trainer, data, settings, master)
    else:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        membership = Membership.start(settings, rank, size, *master)
        comm = NativeCommunicator.tcp_through_store(membership.epoch.store, "world/", rank, size, membership.me.host)
        trainer = DataParallel(loss_fn, optax.adam(args.lr), "gradient_allreduce", communicator=comm)
        ft = FaultTolerantTrainer(trainer, membership, data)

    params = init_mlp(hidden=64)
    if not joining and latest(args.checkpoints):  # the whole job restarted: go on from its last save
        state = ft.restore(args.checkpoints, params)
    else:
        state = ft.init(params, example_batch={"x": x[: args.batch_per_rank], "y": y[: args.batch_per_rank]})
    while int(state.step) < args.steps:
        state, loss = ft.step(state, lambda indices: {"x": x[indices], "y": y[indices]})
        step = int(state.step)
        if ft.epoch.rank == 0 and step % args.log_every == 0:
            print(f"step {step:4d}  loss {float(loss):.4f}  ranks {ft.epoch.size}", flush=True)
        if step % 100 == 0:
            ft.save(args.checkpoints, state)
    ft.check_replicas(state, "at the end")  # raises ReplicaMismatch, naming the ranks, if any replica differs
    ft.finished()
    accuracy = float(jnp.mean(jnp.argmax(logits(state.params, x_test), -1) == y_test))
    print(f"test accuracy {accuracy:.3f} after {int(state.step)} steps", flush=True)
    ft.membership.close()


if __name__ == "__main__":
    main()

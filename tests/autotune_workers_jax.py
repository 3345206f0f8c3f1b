"""One rank of a native-engine job that tunes its knobs in DataParallel.init and prints the choice, the searched
settings and its communicator's ring threshold afterwards, and how many batches the same-batch guard saw (in init,
where the tuning probe steps, and after the first step). The data follow the test run's seed, ``BAGUA_TEST_SEED``."""

import json
import os

import numpy as np
import optax
from tuning_clock import cost_tuning_steps

import bagua_jax.trainer
from bagua_jax import NativeCommunicator
from bagua_jax.algorithms import GradientAllReduce
from bagua_jax.trainer import DataParallel


def loss_fn(params, batch):
    return ((batch @ params["w"]) ** 2).mean()


comm = NativeCommunicator.world()
# On a fake clock the always-ring threshold (0) costs half the others: every setting is timed whatever the load, and
# the winner is not the default.
cost_tuning_steps(lambda candidate: 2.0**-10 if comm.mpi_ring_min_bytes == 0 else 2.0**-9, setattr)
seed = int(os.environ["BAGUA_TEST_SEED"])
params = {"w": np.random.default_rng(seed).standard_normal((768, 768)).astype(np.float32)}  # the same on every rank
rng = np.random.default_rng([seed, int(comm.rank())])  # each rank its own batch
guarded_batches = []  # the batches the same-batch guard saw: the user's first, never the tuning probe's
same_batch_guard = bagua_jax.trainer.check_batches_differ


def counted_guard(batch, communicator):
    guarded_batches.append(batch)
    same_batch_guard(batch, communicator)


bagua_jax.trainer.check_batches_differ = counted_guard
trainer = DataParallel(loss_fn, optax.sgd(0.01), GradientAllReduce(), communicator=comm, autotune="once")
state = trainer.init(params)
print(f"guarded in init {len(guarded_batches)}", flush=True)
state, loss = trainer.step(state, rng.standard_normal((8, 768)).astype(np.float32))
print(f"guarded in the first step {len(guarded_batches)}", flush=True)
tuning = trainer.bucket_tuning
print(f"chosen {json.dumps(tuning.setting, sort_keys=True)} ring {comm.mpi_ring_min_bytes}", flush=True)
print(f"searched {json.dumps(sorted(tuning.medians_s))}", flush=True)

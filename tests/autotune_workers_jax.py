"""One rank of a native-engine job that tunes its bucket size in DataParallel.init and prints the choice."""

import numpy as np
import optax

from bagua_jax import NativeCommunicator
from bagua_jax.algorithms import GradientAllReduce
from bagua_jax.trainer import DataParallel


def loss_fn(params, batch):
    return ((batch @ params["w"]) ** 2).mean()


comm = NativeCommunicator.world()
rng = np.random.default_rng(0)
params = {"w": rng.standard_normal((768, 768)).astype(np.float32)}
trainer = DataParallel(loss_fn, optax.sgd(0.01), GradientAllReduce(), communicator=comm, autotune="once")
state = trainer.init(params)
state, loss = trainer.step(state, rng.standard_normal((8, 768)).astype(np.float32))
print(f"chosen {trainer.bucket_tuning.bucket_bytes} candidates {sorted(trainer.bucket_tuning.medians_s)}", flush=True)

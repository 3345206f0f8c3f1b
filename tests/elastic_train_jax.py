"""An elastic JAX training script (run by bagua-launch in test_elastic_agent.py): resume, train, checkpoint.

One CPU device per process under ``jax.distributed`` (gloo), a mesh over all of them and
gradient allreduce on a small MLP; each step's global batch comes from the step-indexed
sampler, each process passing its part. See elastic_job.py for the settings.
"""

from __future__ import annotations

import elastic_job as job
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from bagua_common.job.checkpoint import latest
from bagua_jax import DataParallel
from bagua_jax.algorithms import GradientAllReduce
from bagua_jax.checkpoint import restore, save
from bagua_jax.distributed import initialize


def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] + params["b2"] - batch["y"]) ** 2)


def main() -> None:
    initialize(timeout=15)
    rank, world = jax.process_index(), jax.process_count()
    mesh = Mesh(np.array(jax.devices()), ("ranks",))
    dp = DataParallel(loss_fn, optax.sgd(job.LR, momentum=0.9), GradientAllReduce(), mesh=mesh)
    params = job.initial_weights()
    state = restore(job.checkpoints(), dp, params) if latest(job.checkpoints()) is not None else dp.init(params)
    step = int(np.asarray(state.step.addressable_shards[0].data))
    job.log("start", step=step)
    x, y = job.dataset()
    while step < job.last_step():
        job.before_step(step)
        rows = job.SAMPLER.indices(step, rank, world)
        state, _ = dp.step(state, {"x": x[rows], "y": y[rows]})
        step += 1
        if rank == 0:
            job.log("step", step=step)
        if job.should_checkpoint(step):
            save(job.checkpoints(), state, dp)
    if rank == 0:
        final = {k: np.asarray(v.addressable_shards[0].data) for k, v in state.params.items()}
        np.savez(job.folder() / "final.npz", **final)
        job.log("done", step=step)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()

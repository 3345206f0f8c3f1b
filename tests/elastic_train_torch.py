"""An elastic torch training script (run by bagua-launch in test_elastic_agent.py): resume, train, checkpoint.

Gradient allreduce (or the algorithm the test names) over gloo on a small MLP; each step's
global batch comes from the step-indexed sampler, split across the ranks alive now. See elastic_job.py for the settings.
"""

from __future__ import annotations

import elastic_job as job
import numpy as np
import torch
from torch import nn

import bagua_torch
from bagua_common.job.checkpoint import latest
from bagua_torch.checkpoint import restore, save


def main() -> None:
    torch.set_num_threads(1)
    group = bagua_torch.init_process_group("gloo", timeout=15)
    weights = job.initial_weights()
    model = nn.Sequential(nn.Linear(*weights["w1"].shape), nn.Tanh(), nn.Linear(*weights["w2"].shape))
    with torch.no_grad():
        for layer, w, b in ((model[0], "w1", "b1"), (model[2], "w2", "b2")):
            layer.weight.copy_(torch.from_numpy(weights[w].T))
            layer.bias.copy_(torch.from_numpy(weights[b]))
    optimizer = torch.optim.SGD(model.parameters(), lr=job.LR, momentum=0.9)
    name, options = job.algorithm()
    model = bagua_torch.with_bagua(model, [optimizer], bagua_torch.algorithms.get_algorithm(name, **options))
    step = restore(job.checkpoints(), model, optimizer) if latest(job.checkpoints()) is not None else 0
    job.log("start", step=step)
    x, y = (torch.from_numpy(a) for a in job.dataset())
    while step < job.last_step():
        job.before_step(step)
        rows = torch.from_numpy(job.SAMPLER.indices(step, group.rank, group.size))
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        optimizer.step()
        step += 1
        if group.rank == 0:
            job.log("step", step=step)
        if job.should_checkpoint(step):
            save(job.checkpoints(), model, optimizer, step=step)
    if group.rank == 0:
        final = {name: p.detach().numpy() for name, p in model.module.named_parameters()}
        np.savez(job.folder() / "final.npz", **final)
        job.log("done", step=step)
    model.close()


if __name__ == "__main__":
    main()

"""What the elastic training scripts of test_elastic_agent.py share: the data, the schedule, the event log.

Settings come from the environment the test gives the launcher (inherited by every worker):
``BAGUA_TEST_SEED`` (the test run's seed: the data, the initial weights and the sampler's
order), ``BAGUA_TEST_DIR`` (checkpoints under ``ckpt/``, the event log ``events.jsonl``, the final
parameters ``final.npz``), ``BAGUA_TEST_STEPS`` (steps in all), ``BAGUA_TEST_STOP_AT`` (the
reference replay: save at this step and stop), ``BAGUA_TEST_STEP_SECONDS`` (a pause per step,
so that the test can act mid-run), ``BAGUA_TEST_KILL`` (``{"rank", "step", "restart"}``:
that worker kills itself with SIGKILL at that step of that attempt) and ``BAGUA_TEST_GROW_AT``
(a step at which a job of 2 workers waits until the agent restarts it with more, so that a
node started later joins before the job ends) and ``BAGUA_TEST_ALGORITHM`` (torch: the
algorithm as JSON, ``{"name": ..., **options}``; gradient allreduce when unset).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import numpy as np

from bagua_common.data.elastic_sampler import ElasticSampler

SAMPLES, FEATURES, OUTPUTS, HIDDEN = 64, 8, 2, 16
GLOBAL_BATCH = 8
CHECKPOINT_EVERY = 2
LR = 0.1
SEED = int(os.environ["BAGUA_TEST_SEED"])


def folder() -> Path:
    return Path(os.environ["BAGUA_TEST_DIR"])


def checkpoints() -> Path:
    return folder() / "ckpt"


def dataset() -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(SEED)
    x = g.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
    y = np.tanh(x @ g.standard_normal((FEATURES, OUTPUTS))).astype(np.float32)
    return x, y


def initial_weights() -> dict[str, np.ndarray]:
    g = np.random.default_rng(SEED + 1)
    return {
        "w1": (g.standard_normal((FEATURES, HIDDEN)) / np.sqrt(FEATURES)).astype(np.float32),
        "b1": np.zeros(HIDDEN, np.float32),
        "w2": (g.standard_normal((HIDDEN, OUTPUTS)) / np.sqrt(HIDDEN)).astype(np.float32),
        "b2": np.zeros(OUTPUTS, np.float32),
    }


SAMPLER = ElasticSampler(SAMPLES, GLOBAL_BATCH, seed=SEED)


def algorithm() -> tuple[str, dict]:
    """The algorithm's registry name and options, from ``BAGUA_TEST_ALGORITHM``."""
    options = json.loads(os.environ.get("BAGUA_TEST_ALGORITHM") or '{"name": "gradient_allreduce"}')
    return options.pop("name"), options


def last_step() -> int:
    """The step to stop after: the reference replay's stop, else the whole run."""
    return int(os.environ.get("BAGUA_TEST_STOP_AT") or os.environ["BAGUA_TEST_STEPS"])


def should_checkpoint(step: int) -> bool:
    """Whether to save after reaching ``step`` (every few steps, and at the end)."""
    return step % CHECKPOINT_EVERY == 0 or step == last_step()


def log(event: str, **fields) -> None:
    """Append one JSON line to the event log (one small O_APPEND write: lines of several workers never mix)."""
    record = {
        "event": event,
        "rank": int(os.environ["RANK"]),
        "world": int(os.environ["WORLD_SIZE"]),
        "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", -1)),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "time": time.time(),
        **fields,
    }
    fd = os.open(folder() / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def before_step(step: int) -> None:
    """The per-step pause, and the scheduled self-kill of ``BAGUA_TEST_KILL``."""
    kill = json.loads(os.environ.get("BAGUA_TEST_KILL") or "null")
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if kill and (kill["rank"], kill["step"], kill["restart"]) == (int(os.environ["RANK"]), step, restart):
        log("killed", step=step)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(float(os.environ.get("BAGUA_TEST_STEP_SECONDS", 0)))
    if os.environ.get("BAGUA_TEST_GROW_AT") == str(step) and int(os.environ["WORLD_SIZE"]) == 2:
        log("waiting", step=step)
        time.sleep(600)  # the agent stops this worker when the new node joins; the test's own deadline is shorter

"""benchmarks/lm_study.py: one rank of a job runs end to end (the ``tiny`` GPT, one process), and the study's
figures follow from the ranks' raw results as its docstring says (checked against sums written out here)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import lm_study  # noqa: E402
import lm_study_report  # noqa: E402


class _OneRankNetwork:
    """What PhaseControl needs of a network: one rank, a link left unshaped."""

    ranks, rate = 1, None


def test_one_rank_trains_evaluates_and_times(tmp_path, seed):
    from bagua_common.job.local_launch import free_port

    job = {
        "size": "tiny", "ranks": 1, "seed": seed, "steps": 4, "batch": 2, "lr": 3e-3, "weight_decay": 0.01,
        "eval_every": 2, "heldout_windows": 4, "async_link": "none", "front_end": "torch", "algorithm": "ddp",
        "options": {}, "links": ["none", "none", "none"], "timing_sync_every": 0, "timed_rounds": 2,
        "phase_wait_s": 120,
    }  # fmt: skip
    (tmp_path / "job.json").write_text(json.dumps(job))
    control = lm_study.PhaseControl(_OneRankNetwork(), [(tmp_path, job["links"])])
    control.start()
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    worker = [sys.executable, str(ROOT / "benchmarks" / "lm_study_worker.py"), str(tmp_path / "job.json")]
    done = subprocess.run(worker, env=env, capture_output=True, text=True, timeout=300)
    control.stop.set()
    assert done.returncode == 0, done.stderr[-2000:]
    summary = lm_study_report.summarize([json.loads((tmp_path / "rank0.json").read_text())], job)
    assert [step for step, _ in summary["curve"]] == [0, 2, 4]
    # GPT-2's initialization gives small logits: the untrained loss is close to a uniform guess over 256 bytes
    assert summary["curve"][0][1] == pytest.approx(math.log(256), abs=0.15)
    assert summary["final_loss"] < summary["curve"][0][1] - 0.05
    assert len(summary["timing"]["none"]["phase_ms"]) == 2 and summary["ms_per_step"]["none"] > 0


def _wait_for(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} did not appear"
        time.sleep(0.01)


def test_a_pair_runs_one_phase_at_a_time_alternating(tmp_path):
    """Two one-rank jobs: each phase starts only once the other job is idle, in the order A B, B A, A B."""
    folders = [tmp_path / "a", tmp_path / "b"]
    for folder in folders:
        folder.mkdir()
    links = ["none"] * 3
    control = lm_study.PhaseControl(_OneRankNetwork(), [(folder, links) for folder in folders])
    control.start()
    expected = [(0, 0), (1, 0), (0, 1), (1, 1), (1, 2), (0, 2)]
    try:
        for folder in folders:
            (folder / "ready-0-0").touch()
        for job, phase in expected:
            _wait_for(folders[job] / f"go-{phase}")
            time.sleep(0.15)  # three of the control's polls: nothing else may start while this phase runs
            started = sorted((f.name, p.name) for f in folders for p in f.glob("go-*"))
            assert len(started) == expected.index((job, phase)) + 1, started
            (folders[job] / ("rank0.json" if phase == 2 else f"ready-{phase + 1}-0")).touch()
    finally:
        control.stop.set()
        control.join()


def test_pair_ratio_per_repeat(rng):
    """A pair's JAX/torch ratio: median and range of the ratios of the phases that ran next to each other."""
    torch_ms, jax_ms = rng.uniform(100, 900, 5), rng.uniform(100, 900, 5)
    torch_row = {"name": "torch/x", "timing": {"none": {"phase_ms": torch_ms.tolist()}}, "interleaved_with": "jax/x"}
    jax_row = {"name": "jax/x", "timing": {"none": {"phase_ms": jax_ms.tolist()}}, "interleaved_with": "torch/x"}
    ratios = jax_ms / torch_ms
    got = lm_study_report.step_time_ratios(jax_row, torch_row, "none")
    assert got == pytest.approx((np.median(ratios), ratios.min(), ratios.max()))


def _ranks(rng: np.random.Generator, links: list[str], steps_per_phase: int, nranks: int) -> list[dict]:
    return [
        {
            "rank": r,
            "curve": [[0, 5.5], [10, 4.0]],
            "train_s": float(rng.uniform(1, 2)),
            "train_bytes": int(rng.integers(1_000, 10_000)),
            "phases": [
                {
                    "link": link,
                    "step_s": rng.uniform(0.1, 1.0, steps_per_phase).tolist(),
                    "bytes": int(rng.integers(1e5)),
                }
                for link in links
            ],
        }
        for r in range(nranks)
    ]


def test_diloco_time_per_step_from_whole_short_rounds(rng):
    links, h_t, sync_every = ["none", "100mbit", "none", "100mbit", "none", "100mbit"], 4, 50
    ranks = _ranks(rng, links, 2 * h_t, 3)
    job = {"steps": 10, "timing_sync_every": h_t, "options": {"sync_every": sync_every}}
    summary = lm_study_report.summarize(ranks, job)
    times = np.array([[p["step_s"] for p in r["phases"]] for r in ranks]).mean(0)  # phase x step, mean over ranks
    for offset, link in enumerate(["none", "100mbit"]):
        mine = times[offset::2]
        local, rounds = np.median(mine), np.median(mine.mean(1))
        expected = 1e3 * (local + (rounds - local) * h_t / sync_every)
        assert summary["ms_per_step"][link] == pytest.approx(expected, abs=0.01)
    assert summary["bytes_per_step"] == pytest.approx(np.mean([r["train_bytes"] for r in ranks]) / 10)


def test_steps_to_a_loss_between_evaluations(rng):
    l0, l1 = sorted(rng.uniform(2, 5, 2))[::-1]
    target = float(rng.uniform(l1, l0))
    curve = [[0, 5.6], [20, l0], [40, l1]]
    assert lm_study_report.steps_to(curve, target) == pytest.approx(20 + 20 * (l0 - target) / (l0 - l1))
    assert lm_study_report.steps_to(curve, l1 - 0.01) is None


def test_uncompressed_first_steps_take_ddps_time(rng):
    from bagua_common.algorithms.configs import OneBitAdamConfig

    warmup = OneBitAdamConfig(learning_rate=1e-3).warmup_steps
    fast, slow = sorted(rng.uniform(100, 2000, 2))
    reached = warmup + float(rng.uniform(10, 50))
    curve = [[0, 5.0], [int(reached), 3.0]]  # the target 3.0 is reached at ``reached`` steps
    base = {"ms_per_step": {"100mbit": slow}}
    row = {"algorithm": "onebit_adam", "options": {}, "curve": curve, "ms_per_step": {"100mbit": fast}}
    expected = (warmup * slow + (int(reached) - warmup) * fast) / 1e3
    assert lm_study_report._time_to(row, "100mbit", 3.0, base) == pytest.approx(expected)
    assert lm_study_report._time_to({**row, "algorithm": "bytegrad"}, "100mbit", 3.0, base) == pytest.approx(
        int(reached) * fast / 1e3
    )

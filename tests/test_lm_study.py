"""benchmarks/lm_study.py: one rank of a job trains and times end to end (the ``tiny`` GPT, one process), the study's
schedule is optax's, and the figures follow from the ranks' raw results as the study's docstring says (checked
against sums written out here)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import lm_study_report  # noqa: E402
from harness.load import LoadGate  # noqa: E402
from harness.phases import PhasedJob, PhaseRunner, kept  # noqa: E402
from lm_study_settings import Schedule, Settings  # noqa: E402


class _OneRankNetwork:
    """What PhaseRunner needs of a network: one rank, a link left unshaped."""

    ranks, rate = 1, None


def _settings(steps: int) -> dict:
    schedule = Schedule(3e-3, 1, steps)
    return Settings("tiny", 2, steps, schedule, schedule, eval_every=2, heldout_windows=4).as_dict()


def _run_worker(tmp_path: Path, job: dict) -> subprocess.CompletedProcess:
    from bagua_common.job.local_launch import free_port

    (tmp_path / "job.json").write_text(json.dumps({**job, "result": str(tmp_path / "result")}))
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    worker = [sys.executable, str(ROOT / "benchmarks" / "lm_study_worker.py"), str(tmp_path / "job.json")]
    return subprocess.run(worker, env=env, capture_output=True, text=True, timeout=300)


def test_one_rank_trains_and_evaluates(tmp_path):
    job = {"settings": _settings(4), "front_end": "torch", "algorithm": "ddp", "options": {}, "mode": "train",
           "steps": 4, "study_pid": os.getpid()}  # fmt: skip
    done = _run_worker(tmp_path, job)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = lm_study_report.summarize_training([json.loads((tmp_path / "result.rank0").read_text())])
    assert [step for step, _ in summary["curve"]] == [0, 2, 4]
    # GPT-2's initialization gives small logits: the untrained loss is close to a uniform guess over 256 bytes
    assert summary["curve"][0][1] == pytest.approx(math.log(256), abs=0.15)
    assert summary["final_loss"] < summary["curve"][0][1] - 0.05
    assert [step for step, _ in summary["sent"]] == [0, 2, 4]


def test_one_rank_times_its_phases_behind_the_gate(tmp_path):
    links, timed = ["none", "none", "none"], [False, True, True]
    job = {"settings": _settings(4), "front_end": "torch", "algorithm": "ddp", "options": {}, "mode": "time",
           "timing_round": 0, "timed_rounds": 3, "links": links, "timed": timed, "phase_wait_s": 120}  # fmt: skip
    runner = PhaseRunner(_OneRankNetwork(), [PhasedJob(tmp_path, links, timed)], LoadGate(limit=1e9))
    runner.start()
    done = _run_worker(tmp_path, job)
    runner.stop.set()
    runner.join()
    runner.gate.close()
    assert done.returncode == 0, done.stderr[-2000:]
    rank = json.loads((tmp_path / "result.rank0").read_text())
    phases = kept(rank["phases"], runner.records, 0)
    assert [len(p["step_s"]) for p in phases] == [0, 3, 3] and [p["load"] is None for p in phases] == [1, 0, 0]
    summary = lm_study_report.summarize_timing([{**rank, "phases": phases}], {"timing_round": 0})
    expected = sorted(1e3 * np.mean(p["step_s"]) for p in phases[1:])
    assert sorted(summary["links"]["none"]["ms_per_step"]["values"]) == pytest.approx(expected, abs=1e-3)


@pytest.mark.parametrize("kind", ["cosine", "constant"])
def test_the_schedule_is_optaxs(kind):
    schedule = Schedule(3e-3, 7, 40, kind, final_ratio=0.1)
    steps = np.arange(60)
    expected = np.asarray(schedule.optax()(steps))
    assert [schedule.peak * schedule.factor(int(s)) for s in steps] == pytest.approx(expected, rel=1e-6, abs=1e-12)


def _phase(step_s: list[float], link: str, nbytes: int, published: bool = True) -> dict:
    return {"link": link, "step_s": step_s, "bytes": nbytes, "load": {"published": published}, "set_aside": []}


def test_diloco_time_per_step_from_whole_short_rounds(rng):
    links, h_t, sync_every = ["none", "100mbit"] * 3, 4, 50
    ranks = [
        {"rank": r, "phases": [_phase(rng.uniform(0.1, 1.0, 2 * h_t).tolist(), link, 1000) for link in links]}
        for r in range(3)
    ]
    row = {"timing_round": h_t, "options": {"sync_every": sync_every}, "algorithm": "diloco"}
    summary = lm_study_report.summarize_timing(ranks, row)
    times = np.array([[p["step_s"] for p in r["phases"]] for r in ranks]).mean(0)  # phase x step, mean over ranks
    for offset, link in enumerate(["none", "100mbit"]):
        mine = times[offset::2]
        local, rounds = np.median(mine, axis=1), mine.mean(1)
        expected = 1e3 * (local + (rounds - local) * h_t / sync_every)
        assert summary["links"][link]["ms_per_step"]["median"] == pytest.approx(np.median(expected), abs=1e-3)
        assert summary["links"][link]["bytes_per_step"] == pytest.approx(1000 / (2 * h_t))


def test_a_phase_over_the_load_limit_is_left_out(rng):
    fast, slow = [0.1] * 4, [0.9] * 4
    ranks = [{"rank": 0, "phases": [_phase(fast, "none", 0), _phase(slow, "none", 0, published=False)]}]
    summary = lm_study_report.summarize_timing(ranks, {"timing_round": 0})
    assert list(summary["links"]["none"]["ms_per_step"]["values"]) == [pytest.approx(100.0)]


def test_steps_to_a_loss_between_evaluations(rng):
    l0, l1 = sorted(rng.uniform(2, 5, 2))[::-1]
    target = float(rng.uniform(l1, l0))
    curve = [[0, 5.6], [20, l0], [40, l1]]
    assert lm_study_report.steps_to(curve, target) == pytest.approx(20 + 20 * (l0 - target) / (l0 - l1))
    assert lm_study_report.steps_to(curve, l1 - 0.01) is None
    assert lm_study_report.loss_at(curve, 30) == pytest.approx((l0 + l1) / 2)


def test_uncompressed_first_steps_take_gradient_allreduces_time(rng):
    from bagua_common.algorithms.configs import OneBitAdamConfig

    warmup = OneBitAdamConfig(learning_rate=1e-3).warmup_steps
    fast, slow = sorted(rng.uniform(100, 2000, 2))
    reached = warmup + float(rng.uniform(10, 50))
    curve = [[0, 5.0], [int(reached), 3.0]]  # the target 3.0 is reached at ``reached`` steps

    def timed(ms: float) -> dict:
        return {"status": "ok", "links": {"100mbit": {"ms_per_step": {"median": ms, "min": ms, "max": ms}}}}

    data = {
        "settings": {"steps": int(reached)},
        "train": {"torch/onebit_adam": {"status": "ok", "curve": curve, "final_loss": 3.0, "steps": int(reached)}},
        "timing": {
            "torch/onebit_adam": {"algorithm": "onebit_adam", "front_end": "torch", "options": {}, **timed(fast)},
            "torch/gradient_allreduce": timed(slow),
        },
    }
    got = lm_study_report.time_to(data, "torch/onebit_adam", "100mbit", 3.0)
    assert got.seconds.median == pytest.approx((warmup * slow + (int(reached) - warmup) * fast) / 1e3)
    assert "not reached (final 3.000)" == lm_study_report.time_to(data, "torch/onebit_adam", "100mbit", 2.0).format()
    # a run that stopped before the end of its schedule (train --steps) says so
    data["settings"]["steps"] = 2 * int(reached)
    expected = f"not reached in the {int(reached)} steps trained (3.000)"
    assert lm_study_report.time_to(data, "torch/onebit_adam", "100mbit", 2.0).format() == expected


def test_a_run_at_the_link_reads_its_own_clock(rng):
    # Asynchronous averaging's curve is [step, seconds, loss]: the target is crossed between two evaluations, and the
    # time is its clock there, interpolated the same way.
    seconds = sorted(rng.uniform(1, 100, 2))
    curve = [[0, 0.0, 5.0], [100, seconds[0], 3.0], [200, seconds[1], 2.0]]
    data = {"settings": {"steps": 200}, "train": {},
            "timing": {"torch/async": {"links": {"100mbit": {"phases": [{"curve": curve}]}}}}}  # fmt: skip
    got = lm_study_report.time_to(data, "torch/async", "100mbit", 2.5)
    assert got.seconds.median == pytest.approx((seconds[0] + seconds[1]) / 2)
    assert lm_study_report.time_to(data, "torch/async", "100mbit", 1.0).format() == "not reached (final 2.000)"


def test_merge_takes_finished_rows_of_studies_with_the_same_settings(tmp_path):
    import argparse

    import lm_study

    def study(folder: str, rows: dict, settings: dict) -> Path:
        path = tmp_path / folder / "lm-study.json"
        path.parent.mkdir()
        data = {"settings": settings, "train": rows, "timing": {}, "commands": [{"command": folder}]}
        path.write_text(json.dumps(data))
        return path

    ok, failed = {"status": "ok", "final_loss": 1.6}, {"status": "failed"}
    same = lm_study.STUDY.as_dict()
    a = study("a", {"torch/ddp": ok, "torch/bytegrad": failed}, same)
    b = study("b", {"torch/powersgd": ok, "torch/ddp": {**ok, "final_loss": 1.5}}, same)
    merged = {"settings": same, "train": {}, "timing": {}, "commands": []}
    lm_study.merge(argparse.Namespace(sources=[a, b], out=tmp_path, name="merged"), merged, lambda: None)
    assert sorted(merged["train"]) == ["torch/ddp", "torch/powersgd"]
    assert merged["train"]["torch/ddp"]["final_loss"] == 1.5  # the later file's row
    assert [c["command"] for c in merged["commands"]] == ["a", "b"]
    other = study("c", {"torch/qadam": ok}, {**same, "steps": same["steps"] + 1})
    with pytest.raises(SystemExit, match="other settings"):
        lm_study.merge(argparse.Namespace(sources=[other], out=tmp_path, name="merged"), merged, lambda: None)


def test_the_merge_command_keeps_the_load_the_studies_recorded(tmp_path, monkeypatch):
    import lm_study

    meta = {"command": "train", "date": "then", "load_average_after": [0.25, 0.5, 0.75]}
    row = {"status": "ok", "final_loss": 1.6}
    for name, rows in (("study", {}), ("part", {"torch/ddp": row})):
        data = {"meta": meta, "settings": lm_study.STUDY.as_dict(), "train": rows, "timing": {}, "commands": []}
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    monkeypatch.setattr(lm_study.lm_study_report, "write", lambda *args: None)
    lm_study.main(["merge", "--from", str(tmp_path / "part.json"), "--name", "study", "--out", str(tmp_path)])
    merged = json.loads((tmp_path / "study.json").read_text())
    assert merged["train"] == {"torch/ddp": row}
    assert merged["meta"]["load_average_after"] == [0.25, 0.5, 0.75]  # a merge measures nothing


def test_a_jax_variant_uses_its_twins_curve_when_checked_and_its_own_over_the_whole_budget():
    torch_curve = [[0, 5.0], [100, 3.0], [200, 2.0]]
    near = [[0, 5.0], [100, 3.0 + lm_study_report.CHECK_TOLERANCE / 2]]
    far = [[0, 5.0], [100, 3.0 + 2 * lm_study_report.CHECK_TOLERANCE], [200, 2.2]]

    def data(jax_curve: list, steps: int) -> dict:
        rows = {"torch/bytegrad": {"status": "ok", "curve": torch_curve, "steps": 200}}
        rows["jax/bytegrad"] = {"status": "ok", "curve": jax_curve, "steps": steps}
        return {"settings": {"steps": 200}, "train": rows}

    row, how = lm_study_report.curve_of(data(near, 100), "jax/bytegrad")
    assert row["curve"] == torch_curve and how.startswith("torch/bytegrad's, checked")
    assert lm_study_report.curve_of(data(far[:2], 100), "jax/bytegrad")[0] is None  # the check failed
    row, how = lm_study_report.curve_of(data(far, 200), "jax/bytegrad")  # trained the whole budget: its own
    assert row["curve"] == far and how == "own run"

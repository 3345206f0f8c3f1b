"""benchmarks/scale_model.py: each collective's cost against its formula worked out here, the traffic counted on 2
ranks carried to 4 against a count on 4, and the step's parts (compute shared by cores, DiLoCo's exchange every H
steps, asynchronous averaging off the step), and the whole model run on the committed studies."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import scale_model  # noqa: E402

from bagua_jax import LaxCommunicator  # noqa: E402
from bagua_jax.advisor import algorithm_traffic  # noqa: E402

PARAMS = [jax.ShapeDtypeStruct((64, 48), jnp.float32), jax.ShapeDtypeStruct((48,), jnp.float32)]
MODEL_BYTES = 4 * (64 * 48 + 48)


def test_collective_costs():
    link = scale_model.Link(latency_s=1e-3, bytes_per_s=1e9)
    big, small = 1e9, 1e3
    # 8 ranks, a large payload: the ring (14 steps, each 1/8 of it) beats the tree's twice the payload
    assert scale_model.collective_s("allreduce", big, 8, link) == pytest.approx(14 * (1e-3 + big / 8 / 1e9))
    # 1024 ranks, a small payload: the tree's 2 x 10 latencies beat the ring's 2 x 1023
    assert scale_model.collective_s("allreduce", small, 1024, link) == pytest.approx(20e-3 + 2 * small / 1e9)
    assert scale_model.collective_s("alltoall", big, 4, link) == pytest.approx(3e-3 + 0.75 * big / 1e9)
    assert scale_model.collective_s("allgather", big, 4, link) == pytest.approx(2e-3 + 0.75 * big / 1e9)
    # 1024 ranks, a small payload: Bruck's 10 rounds beat a pairwise exchange's 1023 latencies
    assert scale_model.collective_s("alltoall", small, 1024, link) == pytest.approx(10 * (1e-3 + small / 2e9))
    assert scale_model.collective_s("allgather", small, 1024, link) == pytest.approx(10e-3 + 1023 / 1024 * small / 1e9)
    assert scale_model.collective_s("send_recv", big, 64, link) == pytest.approx(1e-3 + big / 1e9)
    assert scale_model.collective_s("broadcast", big, 64, link) == pytest.approx(6e-3 + big / 1e9)


def _counted(n: int) -> dict:
    mesh = Mesh(np.array(jax.devices()[:n]), ("ranks",))
    comm = LaxCommunicator("ranks", n)
    out = {}
    for name in ("gradient_allreduce", "bytegrad", "decentralized_shift_one", "low_precision_decentralized"):
        algorithm, options = scale_model.ALGORITHMS[name]
        traffic = algorithm_traffic(algorithm, options, PARAMS, comm, mesh=mesh).wire["world"]
        out[name] = {"by_op": {op: list(c) for op, c in traffic.by_op.items()}, "codec_bytes": {}, "blocking": True}
    return {"ranks": n, "parameters": MODEL_BYTES // 4, "algorithms": out}


def _sent(step: scale_model.Step, n: int) -> float:
    return sum(calls * payload * scale_model.PAYLOAD_FACTOR[op](n) for op, calls, payload in step.collectives)


def test_traffic_counted_on_two_ranks_carried_to_four_matches_a_count_on_four():
    carried, counted = scale_model.payload_steps(_counted(2)), _counted(4)
    for name, step in carried.items():
        expected = sum(sent for _, sent in counted["algorithms"][name]["by_op"].values())
        assert _sent(step, 4) == pytest.approx(expected, rel=0.02), name
    assert _sent(carried["gradient_allreduce"], 4) == pytest.approx(2 * 3 / 4 * MODEL_BYTES)


def test_step_parts():
    link = scale_model.Link(1e-4, 1e8)
    allreduce = scale_model.Step((("allreduce", 1, 4e6),), {})
    wire = scale_model.collective_s("allreduce", 4e6, 4, link)
    assert scale_model.step_s(allreduce, 0.1, 4, link, {}) == pytest.approx(0.1 + wire)
    assert scale_model.step_s(allreduce, 0.1, 4, link, {}, cores=2) == pytest.approx(0.2 + wire)
    every = scale_model.Step((("allreduce", 1, 4e6),), {"minmax": 2e9}, every=50)
    assert scale_model.step_s(every, 0.1, 4, link, {"minmax": 1e10}) == pytest.approx(0.1 + (wire + 0.2) / 50)
    background = scale_model.Step((("allreduce", 1, 4e6),), {}, blocks=False)
    assert scale_model.step_s(background, 0.1, 1024, link, {}) == 0.1
    hidden = scale_model.Step((("allreduce", 1, 4e6),), {}, every=10, overlap_steps=1)
    assert scale_model.step_s(hidden, 0.1, 4, link, {}) == pytest.approx(0.1 + max(0.0, wire - 0.1) / 10)
    assert math.isclose(scale_model.step_s(hidden, 1.0, 4, link, {}), 1.0)


def test_the_committed_studies_give_a_model_and_a_recommendation(tmp_path):
    # The README's command, on the committed inputs: every input it reads still has the fields it reads.
    assert scale_model.main(["--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "scale-model.json").read_text())
    lm = json.loads((scale_model.results.RESULTS / "lm-study-4000-steps.json").read_text())
    # The target is DDP's held-out loss at 80% of its 4000 steps: step 3200, an evaluation of its curve.
    ddp = {step: loss for step, loss, *_ in lm["train"]["torch/ddp"]["curve"]}
    assert written["target"] == ddp[3200]
    for name, (steps, _, _) in written["targets"].items():
        lowest = min(loss for _, loss, *_ in lm["train"][f"torch/{name}"]["curve"])
        assert (steps is None) == (lowest > written["target"]), name
    assert {p["model"] for p in written["points"] if p["study"] == "lm"} == {"gpt-mini"}
    assert len(written["recommendation"]) == 4 * 4 * 4
    assert "## Which algorithm to pick: the GPT mini" in (tmp_path / "scale-model.md").read_text()

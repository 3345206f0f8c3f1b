"""The advisor's ranking against the committed network study, and its parts against known answers.

Traffic is counted by tracing one step of every algorithm for the study's model (the synthetic
MLP, 1.84M float32 parameters) on 2 and 4 ranks; each (framework, ranks, bandwidth) group of
``benchmarks/results/network-study.json`` is then predicted and compared with the measured step
times by Kendall's tau. The study holds no separate compute time, so each group's asynchronous
row (its steps wait for no communication) stands in for it; the link's bandwidth is what the
probe measures, the time of a full-precision allreduce of the model on that link (the group's
gradient allreduce row). The study recorded no kernel throughput either: :data:`STUDY_CODECS` is
what :func:`~bagua_jax.advisor.measure_codec_throughput` measured on the study's machine (the median of six
runs, rounded down). The bar, fixed before the first run: mean tau over the groups >= 0.7.
On a two-level job (a 2x2 mesh) each level's traffic is counted on its own communicator and
predicted on its own link.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from bagua_common.tuning.advisor import (
    INTER,
    INTRA,
    WORLD,
    Link,
    Traffic,
    Wire,
    fit_link,
    kendall_tau,
    predict_step_s,
    rank_algorithms,
)
from bagua_jax import LaxCommunicator
from bagua_jax.advisor import CANDIDATES, measure_traffic
from bagua_jax.algorithms.base import Communicators

ROOT = Path(__file__).resolve().parent.parent
STUDY = ROOT / "benchmarks" / "results" / "network-study.json"
# The study's baselines send what gradient allreduce sends.
BASELINES = {"ddp": "gradient_allreduce", "pmean": "gradient_allreduce"}
# The synthetic MLP of the study: 32x32x3 images, two hidden layers of 512, 10 classes.
MLP = {
    "w1": jax.ShapeDtypeStruct((3072, 512), jnp.float32),
    "b1": jax.ShapeDtypeStruct((512,), jnp.float32),
    "w2": jax.ShapeDtypeStruct((512, 512), jnp.float32),
    "b2": jax.ShapeDtypeStruct((512,), jnp.float32),
    "w3": jax.ShapeDtypeStruct((512, 10), jnp.float32),
    "b3": jax.ShapeDtypeStruct((10,), jnp.float32),
}
# ``python -c "from bagua_jax.advisor import measure_codec_throughput as m; print(m())"``, six runs on the study's
# 2-core machine under the load of other builds (minmax 20-38 GB/s, sign 4.5-47 GB/s).
STUDY_CODECS = {"minmax": 2e10, "sign": 1.8e10}


def study_traffic(n: int) -> dict[str, Traffic]:
    mesh = Mesh(np.array(jax.devices()[:n]), ("ranks",))
    return {name: measure_traffic(name, MLP, LaxCommunicator("ranks", n), mesh=mesh) for name in CANDIDATES}


def test_counted_traffic_matches_the_cost_model():
    traffic = study_traffic(4)
    allreduce = 2 * 3 / 4 * 4 * 1_841_162
    assert traffic["gradient_allreduce"].bytes_sent == pytest.approx(allreduce)
    assert traffic["bytegrad"].bytes_sent / allreduce == pytest.approx(1 / 4, abs=2e-3)
    assert traffic["qadam"].bytes_sent / allreduce == pytest.approx(1 / 4, abs=2e-3)
    assert traffic["onebit_adam"].bytes_sent / allreduce == pytest.approx(1 / 32, abs=2e-3)
    assert not traffic["async"].blocking and traffic["async"].bytes_sent == 0
    for name, counted in traffic.items():  # each collective's share adds up to the level's figures
        for wire in counted.wire.values():
            assert sum(calls for calls, _ in wire.by_op.values()) == wire.messages, name
            assert sum(sent for _, sent in wire.by_op.values()) == pytest.approx(wire.bytes_sent), name
    by_op = traffic["bytegrad"].wire[WORLD].by_op
    # an eighth, plus the min-max headers: 16 bytes a chunk and a group of 8192 elements (0.2%)
    assert set(by_op) == {"alltoall", "allgather"} and by_op["alltoall"][1] == pytest.approx(allreduce / 8, rel=4e-3)
    assert set(traffic["gradient_allreduce"].wire[WORLD].by_op) == {"allreduce"}


def two_level_job() -> tuple[Communicators, Mesh]:
    """A job of 2 nodes of 2 ranks on a 2x2 mesh: its communicators and the mesh they name."""
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("inter", "intra"))
    comms = Communicators(
        world=LaxCommunicator(("inter", "intra"), 4),
        intra=LaxCommunicator("intra", 2),
        inter=LaxCommunicator("inter", 2),
    )
    return comms, mesh


def test_counted_traffic_of_a_two_level_job_is_split_by_level():
    comms, mesh = two_level_job()
    names = ("gradient_allreduce", "gradient_allreduce_hierarchical", "bytegrad_hierarchical", "qadam_hierarchical")
    traffic = {name: measure_traffic(name, MLP, comms, mesh=mesh).wire for name in names}
    model = 4 * 1_841_162
    assert set(traffic["gradient_allreduce"]) == {WORLD}
    assert traffic["gradient_allreduce"][WORLD].bytes_sent == pytest.approx(2 * 3 / 4 * model)
    full = traffic["gradient_allreduce_hierarchical"]
    assert set(full) == {INTRA, INTER}
    # In the node a reduce-scatter and an allgather, half the model each; between nodes an allreduce of a half.
    assert full[INTRA].bytes_sent == pytest.approx(model, rel=1e-4)
    assert full[INTER].bytes_sent == pytest.approx(model / 2, rel=1e-4)
    assert full[INTRA].messages == 2 * full[INTER].messages
    for compressed in ("bytegrad_hierarchical", "qadam_hierarchical"):
        assert traffic[compressed][INTRA].bytes_sent == pytest.approx(full[INTRA].bytes_sent, rel=1e-3), compressed
        assert traffic[compressed][INTER].bytes_sent / full[INTER].bytes_sent == pytest.approx(1 / 4, abs=5e-3)


def test_a_two_level_prediction_puts_each_levels_traffic_on_its_own_link():
    traffic = Traffic({INTRA: Wire(bytes_sent=4e6, messages=2), INTER: Wire(bytes_sent=1e6, messages=1)})
    topology = {WORLD: Link(50e-6, 1.25e8), INTRA: Link(2e-6, 1e10), INTER: Link(50e-6, 1.25e8)}
    expected = 0.01 + (2 * 2e-6 + 4e6 / 1e10) + (50e-6 + 1e6 / 1.25e8)
    assert predict_step_s(traffic, topology, compute_s=0.01, codec_bytes_per_s={}) == pytest.approx(expected)
    with pytest.raises(ValueError, match="no link measured"):
        predict_step_s(traffic, {WORLD: topology[WORLD]}, compute_s=0.01, codec_bytes_per_s={})


def test_predicted_ranking_agrees_with_the_network_study():
    rows = json.loads(STUDY.read_text())["rows"]
    groups: dict[tuple, dict[str, float]] = {}
    for row in rows:
        if row["status"] == "ok":
            groups.setdefault((row["framework"], row["ranks"], row["rate"]), {})[row["algorithm"]] = row["step_s"]
    traffic = {n: study_traffic(n) for n in sorted({key[1] for key in groups})}
    taus = {}
    for (framework, n, rate), measured in groups.items():
        unknown = set(measured) - set(CANDIDATES) - set(BASELINES)
        assert not unknown, f"the study has rows the advisor cannot model: {unknown}"
        compute_s = measured["async"]
        allreduce = traffic[n]["gradient_allreduce"].bytes_sent
        link = Link(latency_s=0.0, bytes_per_s=allreduce / (measured["gradient_allreduce"] - compute_s))
        names = sorted(measured)
        predicted = [
            predict_step_s(traffic[n][BASELINES.get(a, a)], {WORLD: link}, compute_s, STUDY_CODECS) for a in names
        ]
        taus[(framework, n, rate)] = kendall_tau(predicted, [measured[a] for a in names])
    for key, tau in sorted(taus.items()):
        print(f"{key}: tau {tau:.2f}")
    mean = float(np.mean(list(taus.values())))
    print(f"mean Kendall tau over {len(taus)} groups: {mean:.3f}")
    assert mean >= 0.7


def test_fit_link_recovers_latency_and_bandwidth():
    sizes = np.array([1e4, 1e5, 1e6, 1e7])
    link = fit_link(sizes, 20e-6 + sizes / 1.25e8)
    assert link.latency_s == pytest.approx(20e-6, rel=1e-6) and link.bytes_per_s == pytest.approx(1.25e8)
    with pytest.raises(ValueError, match="does not grow"):
        fit_link([1e4, 1e6], [2e-3, 1e-3])


def test_ranking_puts_compression_first_on_a_slow_link_and_last_on_a_fast_one():
    traffic = {
        "gradient_allreduce": Traffic({WORLD: Wire(bytes_sent=8e6, messages=2)}),
        "bytegrad": Traffic({WORLD: Wire(bytes_sent=2e6, messages=8)}, codec_bytes={"minmax": 3.2e7}),
    }
    codecs = {"minmax": 1e9}
    slow = rank_algorithms(traffic, {WORLD: Link(0.0, 12.5e6)}, compute_s=0.05, codec_bytes_per_s=codecs)
    fast = rank_algorithms(traffic, {WORLD: Link(0.0, 12.5e9)}, compute_s=0.05, codec_bytes_per_s=codecs)
    assert [p.algorithm for p in slow] == ["bytegrad", "gradient_allreduce"] and slow[0].speedup > 2.5
    assert [p.algorithm for p in fast] == ["gradient_allreduce", "bytegrad"]


def test_kendall_tau_against_known_values():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)

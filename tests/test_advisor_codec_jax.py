"""The advisor's codec term: the bytes each algorithm's step codes through the compression kernels, counted from
its traced program, and the kernels' throughput, timed on this rank.

The counts are checked against the model's bytes (the parameters' ``nbytes``) times the kernel passes
each pipeline makes per bucket of ``B`` bytes on ``n`` ranks: ByteGrad, QAdam and 1-bit Adam encode
``B``, decode-and-reduce ``n`` chunks of ``B/n``, encode their ``B/n`` again and decode the gathered
``B``: ``(3 + 1/n) B``; low-precision decentralized encodes ``B`` and decodes its own and each
neighbour's (one neighbour on 2 ranks, two on more).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import _bagua_ffi
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from test_advisor_jax import MLP, study_traffic, two_level_job

import bagua_jax.advisor as advisor
from bagua_common.tuning.advisor import INTER, INTRA, WORLD, Link, format_ranking, predict_step_s, rank_algorithms
from bagua_jax import ops

MODEL_BYTES = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in MLP.values())
# The parameters of every bucket are padded to a multiple of the ranks: a few bytes per bucket.
PADDING = 1e-4


@pytest.mark.parametrize("n", [2, 4])
def test_each_algorithms_coded_bytes_are_its_kernel_passes_over_the_model(n):
    traffic = study_traffic(n)
    passes = {
        "bytegrad": {"minmax": 3 + 1 / n},
        "qadam": {"minmax": 3 + 1 / n},
        "onebit_adam": {"sign": 3 + 1 / n},
        "low_precision_decentralized": {"minmax": 1 + min(n - 1, 2) + 1},
    }
    for name, t in traffic.items():
        expected = passes.get(name, {})
        assert set(t.codec_bytes) == set(expected), name
        for codec, count in expected.items():
            assert t.codec_bytes[codec] == pytest.approx(count * MODEL_BYTES, rel=PADDING), (name, codec)


def test_warmup_branch_codes_nothing_and_the_compressed_branch_counts_once():
    # QAdam's and 1-bit Adam's steps trace the full-precision warm-up and the compressed exchange as the two
    # branches of one cond: the warm-up alone codes nothing, so the step's count is the compressed branch's.
    traffic = study_traffic(4)
    assert traffic["gradient_allreduce"].codec_bytes == {}
    bytegrad = traffic["bytegrad"].codec_bytes["minmax"]
    assert traffic["qadam"].codec_bytes == {"minmax": bytegrad}
    assert traffic["onebit_adam"].codec_bytes == {"sign": bytegrad}


def test_a_two_level_job_codes_only_this_ranks_slice_between_nodes():
    comms, mesh = two_level_job()
    for name, codec in (("bytegrad_hierarchical", "minmax"), ("onebit_adam_hierarchical", "sign")):
        coded = advisor.measure_traffic(name, MLP, comms, mesh=mesh).codec_bytes
        # Half the model per rank after the intra-node reduce-scatter, exchanged over 2 nodes.
        assert coded == {codec: pytest.approx((3 + 1 / 2) * MODEL_BYTES / 2, rel=PADDING)}, name


def test_codec_bytes_walks_nested_programs():
    x = jnp.ones(1024, jnp.float32)  # 4096 bytes

    @jax.custom_vjp
    def encoded_sum(y):
        return ops.sign_compress_ef(y, jnp.zeros_like(y), 2)[0].astype(jnp.float32).sum()

    encoded_sum.defvjp(lambda y: (encoded_sum(y), None), lambda _, g: (jnp.zeros(1024, jnp.float32) * g,))
    mesh = Mesh(np.array(jax.devices()[:2]), ("ranks",))

    def program(x, pick):
        nested = jax.jit(lambda y: ops.minmax_uint8_decompress(ops.minmax_uint8_compress(y, 4), 1024, 4))(x)
        branch = jax.lax.cond(
            pick,
            lambda y: ops.minmax_uint8_decompress_reduce(ops.minmax_uint8_compress(y, 4), 256, 4),
            lambda y: ops.sign_decompress(ops.sign_compress(y, 4), 1024, 4)[:256],
            nested,
        )
        sharded = jax.shard_map(
            lambda y: ops.sign_decompress(ops.sign_compress(y, 1), 512, 1),
            mesh=mesh,
            in_specs=P("ranks"),
            out_specs=P("ranks"),
        )(x)
        return branch.sum() + sharded.sum() + encoded_sum(x)

    counted = advisor.codec_bytes(jax.make_jaxpr(program)(x, True).jaxpr)
    # minmax: compress and decompress of 4096 bytes under jit; in the cond, a compress of 4096 and a decompress-reduce
    # of 4 buffers of 1024 bytes. sign: the other branch's 2 x 4096; the shard_map's 2 x 2048 per shard; the custom
    # derivative's compress with error feedback of 4096.
    assert counted == {"minmax": 4 * 4096, "sign": 2 * 4096 + 2 * 2048 + 4096}


def test_every_compression_kernel_the_native_module_registers_is_counted():
    registered = {name for targets in _bagua_ffi.registrations().values() for name in targets}
    kernels = {name for name in registered if "compress" in name}
    # four kernels (compress, compress_ef, decompress, decompress_reduce) for each of the three codecs
    assert len(kernels) == 12, registered
    x = jnp.ones(1024, jnp.float32)
    for name in kernels:
        call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((1024,), jnp.float32))
        counted = advisor.codec_bytes(jax.make_jaxpr(lambda y, call=call: call(y, k=np.int64(1)))(x).jaxpr)
        assert list(counted.values()) == [4096], name


def test_codec_throughput_is_the_counted_round_trip_over_its_median_time(monkeypatch):
    # Each codec's three timed calls last 1, 5 and 2 ms: the median is 2 ms.
    durations = np.array([1e-3, 5e-3, 2e-3] * 2)
    ends = np.cumsum(durations)
    ticks = iter(np.column_stack([ends - durations, ends]).ravel())
    monkeypatch.setattr(advisor, "time", SimpleNamespace(perf_counter=lambda: next(ticks)))
    throughput = advisor.measure_codec_throughput(repeats=3)
    # A compress and a decompress of 4 MiB in 2 ms.
    assert throughput == {"minmax": pytest.approx(2 * 4 * 2**20 / 2e-3), "sign": pytest.approx(2 * 4 * 2**20 / 2e-3)}


def test_the_kernels_throughput_on_this_rank_is_finite_and_positive():
    throughput = advisor.measure_codec_throughput(repeats=2)
    assert set(throughput) == {"minmax", "sign"}
    assert all(math.isfinite(rate) and rate > 0 for rate in throughput.values()), throughput


def test_a_slower_codec_slows_the_compressed_algorithms_only():
    traffic = study_traffic(4)
    topology = {WORLD: Link(20e-6, 1.25e8)}
    measured = {"minmax": 2e10, "sign": 2e10}
    fake = {"minmax": 2e8, "sign": 2e9}
    before = {p.algorithm: p.step_s for p in rank_algorithms(traffic, topology, 0.02, measured)}
    after = {p.algorithm: p.step_s for p in rank_algorithms(traffic, topology, 0.02, fake)}
    for name, t in traffic.items():
        slower = sum(coded / fake[codec] - coded / measured[codec] for codec, coded in t.codec_bytes.items())
        assert after[name] - before[name] == pytest.approx(slower, abs=1e-12), name
        assert (after[name] > before[name]) == (
            name in {"bytegrad", "qadam", "onebit_adam", "low_precision_decentralized"}
        )


def test_a_codec_without_a_measured_throughput_is_an_error_and_the_table_shows_each_codec():
    traffic = study_traffic(2)
    with pytest.raises(ValueError, match=r"codec bytes of \['sign'\] but no throughput"):
        predict_step_s(traffic["onebit_adam"], {WORLD: Link(0.0, 1e9)}, 0.01, {"minmax": 1e9})
    topology = {WORLD: Link(0.0, 1e9)}
    codecs = {"minmax": 2.5e9, "sign": 4e9}
    table = format_ranking(rank_algorithms(traffic, topology, 0.01, codecs), topology, 0.01, codecs)
    assert "codec minmax: 2.5 GB/s" in table and "codec sign: 4 GB/s" in table, table
    assert INTRA not in table and INTER not in table

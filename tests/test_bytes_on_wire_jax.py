"""Bytes each algorithm sends per step, relative to an fp32 gradient allreduce.

One step of each algorithm is traced (not run) on 4 ranks with a 1M-parameter
float32 model, its world communicator wrapped in a CountingCommunicator. The test
asserts each ratio against its analytic value and prints the table the README shows
(run with ``-s`` to see it).
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from bagua_jax import LaxCommunicator
from bagua_jax.algorithms import make_algorithm
from bagua_jax.algorithms.base import Communicators
from bagua_jax.counting import CountingCommunicator

N = 4
PARAMS = {"w": jax.ShapeDtypeStruct((1000, 1000), jnp.float32), "b": jax.ShapeDtypeStruct((1000,), jnp.float32)}


def bytes_per_step(name: str, **options) -> dict[str, float]:
    """Trace one step of ``name`` (with ``options``) on N ranks and return the bytes it sends, by operation."""
    counter = CountingCommunicator(LaxCommunicator("ranks", N))
    algorithm = make_algorithm(name, learning_rate=1e-3, **options)
    optimizer = None if name in ("qadam", "onebit_adam") else optax.sgd(0.1)
    tx = algorithm.transformation(optimizer, Communicators(world=counter))

    def step(params, grads):
        state = tx.init(params)
        return tx.update(grads, state, params)[0]

    mesh = Mesh(np.array(jax.devices()[:N]), ("ranks",))
    sharded = jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P("ranks"), check_vma=False)
    jax.eval_shape(sharded, PARAMS, PARAMS)
    return counter.bytes_by_op


FP32_ALLREDUCE = 2 * (N - 1) / N * 4 * 1_001_000

# name: (bytes that count for the steady state, expected ratio, tolerance)
EXPECTED = {
    "gradient_allreduce": (("allreduce",), 1.0, 1e-9),
    "bytegrad": (("alltoall", "allgather"), 1 / 4, 1e-3),
    "decentralized": (("allreduce",), 1.0, 1e-9),
    "low_precision_decentralized": (("send_recv",), 2 * N / (4 * 2 * (N - 1)), 1e-3),
    # QAdam and 1-bit Adam trace both phases (lax.cond); after warm-up only the compressed
    # exchange of the momentum (alltoall + allgather) runs.
    "qadam": (("alltoall", "allgather"), 1 / 4, 1e-3),
    "onebit_adam": (("alltoall", "allgather"), 1 / 32, 2e-3),
    # AsyncModelAverage sends nothing inside the step after warm-up (warm-up is an allreduce);
    # its background rounds each cost one fp32 allreduce of the weights.
    "async": (("alltoall",), 0.0, 1e-9),
}


@pytest.mark.parametrize("name", EXPECTED)
def test_bytes_relative_to_fp32_allreduce(name):
    ops, expected, tolerance = EXPECTED[name]
    by_op = bytes_per_step(name)
    ratio = sum(by_op.get(op, 0.0) for op in ops) / FP32_ALLREDUCE
    print(f"\n{name:28s} {ratio:.4f} x fp32 allreduce  ({by_op})")
    assert ratio == pytest.approx(expected, abs=tolerance)


def test_shift_one_sends_one_copy_of_the_weights():
    counter = CountingCommunicator(LaxCommunicator("ranks", N))
    tx = make_algorithm("decentralized", peer_selection_mode="shift_one").transformation(
        optax.sgd(0.1), Communicators(world=counter)
    )

    def step(params, grads):
        return tx.update(grads, tx.init(params), params)[0]

    mesh = Mesh(np.array(jax.devices()[:N]), ("ranks",))
    jax.eval_shape(jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P("ranks"), check_vma=False), PARAMS, PARAMS)
    ratio = counter.bytes_sent / FP32_ALLREDUCE
    print(f"\nshift_one {ratio:.4f} x fp32 allreduce")
    assert ratio == pytest.approx(N / (2 * (N - 1)))


# DiLoCo's traced step holds a synchronization (lax.cond): the bytes of one every sync_every steps.
DILOCO_SYNC = {
    "fp32": (("allreduce",), 1.0),
    "bf16": (("alltoall", "allgather"), 1 / 2),
    "uint8": (("alltoall", "allgather"), 1 / 4),
    "uint4": (("alltoall", "allgather"), 1 / 8),
}


@pytest.mark.parametrize("wire", DILOCO_SYNC)
def test_a_diloco_synchronization_sends_the_model_once_in_its_wire_format(wire):
    ops, expected = DILOCO_SYNC[wire]
    by_op = bytes_per_step("diloco", outer_exchange=wire)
    ratio = sum(by_op.get(op, 0.0) for op in ops) / FP32_ALLREDUCE
    print(f"\ndiloco {wire:5s} {ratio:.4f} x fp32 allreduce per synchronization ({by_op})")
    assert ratio == pytest.approx(expected, abs=1e-3) and sum(by_op.values()) == pytest.approx(ratio * FP32_ALLREDUCE)

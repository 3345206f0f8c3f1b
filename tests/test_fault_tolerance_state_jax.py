"""What a change of members does to a fault-tolerant JAX job's state (bagua_jax/state_rules.py), and the
algorithms FaultTolerantTrainer refuses (they fall back to the elastic restart), and DiLoCo's roles.

In one process on a mesh of 2 CPU devices: ByteGrad with error feedback trains until its residuals are not
zero; after a change the residuals (found by their type, ByteGradState, not by the rule's name matching) come
from a fresh state and every other leaf is kept bit for bit; the replica check hashes all but the residuals.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

from bagua_common.fault_tolerance import DataPosition, FaultToleranceSettings
from bagua_jax import DataParallel
from bagua_jax.algorithms import ByteGrad, DiLoCo, GradientAllReduce
from bagua_jax.algorithms.bytegrad import ByteGradState
from bagua_jax.fault_tolerance import FaultTolerantTrainer
from bagua_jax.state_rules import (
    OWN,
    REPLICATED,
    RESET,
    carried_algorithms,
    carry_over,
    replicated_leaves,
    ring_copies_resumed,
    roles,
)
from bagua_jax.train_state import TrainState


def loss_fn(params, batch):
    x, y = batch
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


def mesh() -> Mesh:
    return Mesh(jax.devices()[:2], ("r",))


def residual_flags(state: TrainState) -> list[bool]:
    """Per leaf of ``state`` in tree order: whether it is a ByteGrad residual (found by its container's type)."""
    is_bytegrad = lambda node: isinstance(node, ByteGradState)  # noqa: E731
    flags = []
    for field in TrainState._fields:
        for node in jax.tree.leaves(getattr(state, field), is_leaf=is_bytegrad):
            flags += [True] * len(jax.tree.leaves(node.residuals)) if is_bytegrad(node) else [False]
    return flags


def test_a_change_resets_the_error_feedback_residuals_and_keeps_the_rest():
    trainer = DataParallel(loss_fn, optax.adam(0.05), ByteGrad(error_feedback=True, hierarchical=False), mesh=mesh())
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(300,)), jnp.float32), "b": jnp.zeros((), jnp.float32)}
    state = trainer.init(params)
    for _ in range(2):
        batch = (rng.normal(size=(8, 300)).astype(np.float32), rng.normal(size=(8,)).astype(np.float32))
        state, _ = trainer.step(state, batch)
    is_residual = residual_flags(state)
    leaves = jax.tree.leaves(state)
    assert 0 < sum(is_residual) < len(leaves)
    assert all(np.any(np.asarray(leaf) != 0) for leaf, r in zip(leaves, is_residual) if r)

    role_tree = roles(trainer, state)
    assert jax.tree.leaves(role_tree) == [RESET if r else REPLICATED for r in is_residual]
    fresh = trainer.init(params)
    carried = carry_over(role_tree, state, fresh)
    for leaf, new, start, residual in zip(leaves, jax.tree.leaves(carried), jax.tree.leaves(fresh), is_residual):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(start if residual else leaf))
    hashed = replicated_leaves(role_tree, state)
    kept = [np.asarray(leaf) for leaf, r in zip(leaves, is_residual) if not r]
    assert len(hashed) == len(kept) and all(np.array_equal(h, k) for (_, h), k in zip(hashed, kept))
    assert {part for part, _ in hashed} == {"parameters", "optimizer", "step"}

    shrunk = jax.tree.map(lambda leaf: leaf[:1] if jnp.ndim(leaf) else leaf, fresh)  # a kept leaf changes shape
    with pytest.raises(ValueError, match="would have to become"):
        carry_over(role_tree, state, shrunk)


class YourOwn(GradientAllReduce):
    """A user's own algorithm: it declares no rule for its state."""

    fault_tolerant = False


@pytest.mark.parametrize(
    ("algorithm", "refusal"),
    [
        (YourOwn(), r"^FaultTolerantTrainer cannot continue YourOwn after a change of members yet \(it can: .*async"),
        (DiLoCo(sync_every=4, fragments=2, fragment_sync_delay=1, outer_exchange="uint8"), "uint8"),
    ],
    ids=["your-own", "streaming-diloco-overlapped-uint8"],
)
def test_algorithms_that_cannot_continue_are_refused_naming_the_elastic_restart(algorithm, refusal):
    trainer = DataParallel(loss_fn, optax.sgd(0.1), algorithm, mesh=mesh())
    with pytest.raises(ValueError, match=r"elastic restart instead \(bagua-launch --nnodes MIN:MAX") as refused:
        FaultTolerantTrainer(trainer, None, DataPosition(16, 2, seed=0))
    assert re.search(refusal, str(refused.value)), str(refused.value)
    carried = ["async", "bytegrad", "decentralized", "diloco", "gradient_allreduce", "low_precision_decentralized"]
    carried += ["onebit_adam", "powersgd", "qadam"]
    assert sorted(carried_algorithms()) == carried


@pytest.mark.parametrize("algorithm", ["decentralized", "low_precision_decentralized"])
def test_decentralized_keeps_each_members_parameters_and_optimizer_state_and_hashes_the_step(algorithm):
    # Every step drifts the replicas: only the step is the same on every member. Low-precision decentralized
    # training's copies of its own and its neighbours' weights restart (then ring_copies_resumed refills them).
    trainer = DataParallel(loss_fn, optax.sgd(0.1, momentum=0.9), algorithm, mesh=mesh())
    params = {"w": jnp.ones(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    state, _ = trainer.step(trainer.init(params), (np.ones((4, 3), np.float32), np.arange(4, dtype=np.float32)))
    role_tree = roles(trainer, state)
    momentum, averaging = role_tree.opt_state
    assert set(jax.tree.leaves((role_tree.params, momentum, averaging.step))) == {OWN}
    if algorithm == "low_precision_decentralized":
        assert set(jax.tree.leaves((averaging.weights, averaging.left, averaging.right))) == {RESET}
    assert role_tree.step == REPLICATED
    assert [leaf for _, leaf in replicated_leaves(role_tree, state)] == [np.asarray(state.step)]


def test_ring_copies_resumed_takes_each_neighbours_weights_and_leaves_other_states_as_they_are():
    params = {"w": jnp.arange(3, dtype=jnp.float32), "b": jnp.zeros((), jnp.float32)}
    for size in (3, 2, 1):
        members = [{"w": params["w"] + 10 * r, "b": params["b"] + r} for r in range(size)]
        states = [
            DataParallel(loss_fn, optax.sgd(0.1), "low_precision_decentralized", mesh=mesh()).init(p) for p in members
        ]
        own = [np.asarray(s.opt_state[1].weights[0]) for s in states]  # each member's own weights, one bucket
        asked = []

        def exchange(w, peers, rank):  # what send_recv gives: row j is peers[j]'s weights
            np.testing.assert_array_equal(w, own[rank])
            asked.append((rank, list(peers)))
            return np.stack([own[p] for p in peers])

        for rank, state in enumerate(states):
            resumed = ring_copies_resumed(state, lambda w, peers, rank=rank: exchange(w, peers, rank), rank, size)
            copies = resumed.opt_state[1]
            np.testing.assert_array_equal(copies.weights[0], own[rank])
            np.testing.assert_array_equal(copies.left[0], own[(rank - 1) % size])
            np.testing.assert_array_equal(copies.right[0], own[(rank + 1) % size])
        # only the neighbours send, each once (with two, the other member is both); a ring of one sends nothing
        expected = {3: [(0, [2, 1]), (1, [0, 2]), (2, [1, 0])], 2: [(0, [1]), (1, [0])], 1: []}
        assert asked == expected[size]
    other = DataParallel(loss_fn, optax.sgd(0.1), "decentralized", mesh=mesh()).init(params)
    kept = ring_copies_resumed(other, lambda w, peers: pytest.fail("exchanged"), 0, 3)
    assert jax.tree.structure(kept) == jax.tree.structure(other)
    assert all(a is b for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(other)))


def test_autotune_is_refused_naming_the_bucket_size_to_pass_instead():
    # A joiner initializes alone (over its own tcp_self or mpi_self communicator) and would tune its buckets alone.
    trainer = DataParallel(loss_fn, optax.sgd(0.1), "gradient_allreduce", mesh=mesh(), autotune="once")
    for make in (
        lambda: FaultTolerantTrainer(trainer, None, DataPosition(16, 2, seed=0)),
        lambda: FaultTolerantTrainer.joiner(trainer, DataPosition(16, 2, seed=0), FaultToleranceSettings(), ("", 1)),
    ):
        with pytest.raises(ValueError, match=r"cannot autotune.*bucket_tuning\.bucket_bytes"):
            make()


def test_a_joiner_needs_a_communicator_of_its_own_and_its_own_constructor():
    trainer = DataParallel(loss_fn, optax.sgd(0.1), "gradient_allreduce", mesh=mesh())
    needs = r"joiner needs a DataParallel over NativeCommunicator\.tcp_self\(host\) or mpi_self\(\)"
    with pytest.raises(ValueError, match=needs):
        FaultTolerantTrainer.joiner(trainer, DataPosition(16, 2, seed=0), FaultToleranceSettings(), ("127.0.0.1", 1))
    joining = SimpleNamespace(epoch=SimpleNamespace(is_joiner=lambda: True))  # a Membership.join's
    with pytest.raises(ValueError, match=r"make it with FaultTolerantTrainer\.joiner"):
        FaultTolerantTrainer(trainer, joining, DataPosition(16, 2, seed=0))
    ft = object.__new__(FaultTolerantTrainer)  # a joiner's, before it asks: init refuses before joining
    ft.trainer, ft.membership = trainer, None
    with pytest.raises(ValueError, match=r"joiner compiles its step before it asks to join.*pass example_batch"):
        ft.init({"w": jnp.zeros(3, jnp.float32)})


def test_a_restart_is_refused_a_checkpoint_without_a_data_position_and_a_joiner_any(tmp_path):
    from bagua_jax import checkpoint

    trainer = DataParallel(loss_fn, optax.sgd(0.1), "gradient_allreduce", mesh=mesh())
    params = {"w": jnp.zeros(3, jnp.float32), "b": jnp.zeros((), jnp.float32)}
    checkpoint.save(tmp_path, trainer.init(params), trainer)  # not FaultTolerantTrainer.save's: no data position
    ft = object.__new__(FaultTolerantTrainer)  # restore refuses before it uses the job's members
    ft.trainer, ft.membership, ft.data = trainer, SimpleNamespace(), DataPosition(16, 2, seed=0)
    with pytest.raises(
        ValueError, match=r"records no data position: it was not written by a fault-tolerant job's save"
    ):
        ft.restore(tmp_path, params)
    ft.membership = None  # a joiner's, before it asked
    with pytest.raises(ValueError, match=r"a joiner receives the members' state: call init"):
        ft.restore(tmp_path, params)


def test_an_nnx_model_is_refused_with_what_to_pass_instead():
    from flax import nnx

    ft = object.__new__(FaultTolerantTrainer)  # init refuses before it uses the job's members
    with pytest.raises(TypeError, match=r"NNX model changes in place.*nnx\.split"):
        ft.init(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))


def test_diloco_keeps_each_members_parameters_and_inner_state_and_hashes_its_round_start_and_outer_state():
    config = DiLoCo(sync_every=2, outer_exchange="uint8", error_feedback=True)
    trainer = DataParallel(loss_fn, optax.adam(0.05), config, mesh=mesh())
    rng = np.random.default_rng(1)
    params = {"w": jnp.asarray(rng.normal(size=(300,)), jnp.float32), "b": jnp.zeros((), jnp.float32)}
    state = trainer.init(params)
    for _ in range(3):  # one exchange: the residuals are not zero, and the round start has moved
        batch = (rng.normal(size=(8, 300)).astype(np.float32), rng.normal(size=(8,)).astype(np.float32))
        state, _ = trainer.step(state, batch)
    inner, diloco = state.opt_state
    role_tree = roles(trainer, state)
    assert set(jax.tree.leaves(role_tree.params)) == set(jax.tree.leaves(role_tree.opt_state[0])) == {OWN}
    kinds = role_tree.opt_state[1]
    assert set(jax.tree.leaves((kinds.step, kinds.round_start, kinds.outer_states))) == {REPLICATED}
    assert set(jax.tree.leaves(kinds.residuals)) == {RESET} and set(jax.tree.leaves(kinds.pending)) <= {OWN}
    assert kinds.trained == OWN  # 0 while a joiner sits a round out: never compared
    assert role_tree.step == REPLICATED
    assert any(np.any(np.asarray(leaf) != 0) for leaf in jax.tree.leaves(diloco.residuals))

    hashed = [leaf for _, leaf in replicated_leaves(role_tree, state)]
    expected = [state.step, diloco.step, *jax.tree.leaves((diloco.round_start, diloco.outer_states))]
    assert sorted(h.tobytes() for h in hashed) == sorted(np.asarray(e).tobytes() for e in expected)
    fresh = trainer.init(params)
    carried = carry_over(role_tree, state, fresh)
    for leaf, new, start, kind in zip(*map(jax.tree.leaves, (state, carried, fresh, role_tree))):
        np.testing.assert_array_equal(np.asarray(new), np.asarray(start if kind == RESET else leaf))

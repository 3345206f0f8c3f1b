"""bagua_jax.orbax_checkpoint: DataParallel state through orbax's CheckpointManager.

One process, simulated CPU devices as the ranks of a mesh. Checked: plain orbax (no project
code) reads a saved step back leaf for leaf; a run resumed from an asynchronously saved step
continues bit for bit (ByteGrad with error feedback, decentralized, DiLoCo mid-round); a
restore into another world size equals the project's own format's (whose rules
test_checkpoint_jax checks against NumPy); a step with a truncated, emptied or foreign data
file is refused naming the file, and one without its manifest is never restored. Two processes
under ``jax.distributed``: no process returns from a save before process 0 has sealed the step.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from fresh_interpreter import run_json
from jax.sharding import Mesh
from multiprocess import ONE_CPU_DEVICE, run_ranks
from test_checkpoint_jax import LR, batch, host, initial_params, loss_fn

from bagua_common.job.checkpoint import DamagedCheckpointError
from bagua_jax import DataParallel, orbax_checkpoint
from bagua_jax.algorithms import ByteGrad, Decentralized, DiLoCo, GradientAllReduce
from bagua_jax.checkpoint import restore, save
from bagua_jax.distributed import initialize
from bagua_jax.orbax_checkpoint import STATE, OrbaxCheckpoints

ALGORITHMS = {
    "bytegrad_error_feedback": (lambda: ByteGrad(error_feedback=True, hierarchical=False), optax.adam(LR)),
    "decentralized": (lambda: Decentralized(hierarchical=False), optax.adam(LR)),
    "diloco": (lambda: DiLoCo(sync_every=3, round_start_memory="device"), optax.sgd(LR)),
}


def trainer(name: str, ranks: int) -> DataParallel:
    make, optimizer = ALGORITHMS[name]
    return DataParallel(loss_fn, optimizer, make(), mesh=Mesh(np.array(jax.devices()[:ranks]), ("ranks",)))


def trained(dp: DataParallel, rng, steps: int):
    state = dp.init(initial_params(rng))
    for _ in range(steps):
        state, _ = dp.step(state, batch(rng))
    return state


def assert_trees_equal(got, want):
    got_leaves, want_leaves = jax.tree.leaves(host(got)), jax.tree.leaves(host(want))
    assert len(got_leaves) == len(want_leaves)
    for a, b in zip(got_leaves, want_leaves):
        np.testing.assert_array_equal(a, b)


def by_name(tree) -> dict:
    """Non-empty leaves by their path as names (orbax stores named tuples as dicts), as nested lists."""
    return {
        tuple(str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k)))) for k in path): np.asarray(leaf).tolist()
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
        if np.size(leaf)
    }


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_resume_is_bit_for_bit_and_plain_orbax_reads_it(name, tmp_path, rng):
    dp = trainer(name, 2)
    state = trained(dp, rng, 4)  # DiLoCo: mid-round (round of 3, step 4)
    checkpoints = OrbaxCheckpoints(tmp_path, dp)
    assert checkpoints.save(state) == 4
    batches = [batch(rng) for _ in range(3)]
    want = state
    for data in batches:  # trains on while orbax writes
        want, _ = dp.step(want, data)
    checkpoints.close()

    # orbax's own API, no project code: the saved leaves as they were.
    plain = ocp.CheckpointManager(tmp_path, item_names=(STATE,))
    assert plain.latest_step() == 4
    plain.close()
    with ocp.StandardCheckpointer() as checkpointer:
        raw = checkpointer.restore(tmp_path / "4" / STATE)
    assert by_name(raw) == by_name(state._asdict())

    resumed_dp = trainer(name, 2)
    reader = OrbaxCheckpoints(tmp_path, resumed_dp)
    resumed = reader.restore(initial_params(rng))
    reader.close()
    for data in batches:
        resumed, _ = resumed_dp.step(resumed, data)
    assert_trees_equal(resumed, want)


def saved_in_both_formats(tmp_path, rng):
    """3 decentralized steps on 4 devices, saved under ``tmp_path`` by orbax and in the project's format."""
    dp = trainer("decentralized", 4)
    state = trained(dp, rng, 3)
    checkpoints = OrbaxCheckpoints(tmp_path / "orbax", dp)
    checkpoints.save(state)
    checkpoints.close()
    save(tmp_path / "own", state, dp)
    return state


def test_another_world_size_follows_the_rule_like_the_projects_format(tmp_path, rng):
    state = saved_in_both_formats(tmp_path, rng)
    smaller = trainer("decentralized", 2)
    reader = OrbaxCheckpoints(tmp_path / "orbax", smaller)
    got = host(reader.restore(initial_params(rng)))
    reader.close()
    want = host(restore(tmp_path / "own", smaller, initial_params(rng)))
    assert_trees_equal(got, want)
    saved_w = np.asarray(host(state).params["w"])
    np.testing.assert_array_equal(got.params["w"][1], (saved_w.astype(np.float64).sum(0) / 4).astype(np.float32))


def test_damaged_step_is_refused_naming_the_file(tmp_path, rng):
    dp = trainer("bytegrad_error_feedback", 2)
    state = dp.init(initial_params(rng))
    checkpoints = OrbaxCheckpoints(tmp_path / "intact", dp)
    for _ in range(2):
        state, _ = dp.step(state, batch(rng))
        checkpoints.save(state)
    checkpoints.close()

    def truncate(path):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    def foreign(path):  # step 1's state in place of step 2's: orbax alone loads it as step 2
        shutil.rmtree(path.parent.parent)
        shutil.copytree(tmp_path / "intact" / "1" / STATE, path.parent.parent)

    damages = {"truncated": truncate, "empty": lambda path: path.write_bytes(b""), "another checkpoint": foreign}
    for what, damage in damages.items():
        root = tmp_path / what.replace(" ", "_")
        shutil.copytree(tmp_path / "intact", root)
        data = sorted((root / "2" / STATE).rglob("d/*"))[0]
        damage(data)
        named = root / "2" / STATE if damage is foreign else data
        reader = OrbaxCheckpoints(root, dp)
        with pytest.raises(DamagedCheckpointError) as raised:
            reader.restore(initial_params(rng))
        message = str(raised.value)
        assert str(named) in message and what in message, message
        (root / "2" / "manifest.json").unlink()  # unsealed: the newest sealed step is restored
        assert reader.latest_step() == 1
        np.testing.assert_array_equal(reader.restore(initial_params(rng)).step, 1)
        with pytest.raises(FileNotFoundError, match="manifest.json is missing"):
            reader.restore(initial_params(rng), step=2)
        reader.close()
    empty = OrbaxCheckpoints(tmp_path / "none", dp)
    with pytest.raises(FileNotFoundError, match="no committed orbax checkpoint"):
        empty.restore(initial_params(rng))
    empty.close()


def save_on_two_processes(root: str, seed: int) -> dict:
    """One rank of a two-process mesh job: a step, saved with process 0 sealing it slowly, then restored."""
    initialize(timeout=60)
    rank = jax.process_index()
    if rank == 0:  # a seal that takes a while (a large checkpoint's digests): the others must wait for it
        commit = orbax_checkpoint.commit
        orbax_checkpoint.commit = lambda *args, **kwargs: (time.sleep(1.0), commit(*args, **kwargs))
    dp = DataParallel(loss_fn, optax.sgd(LR), GradientAllReduce(), mesh=Mesh(np.array(jax.devices()), ("ranks",)))
    state, _ = dp.step(
        dp.init(initial_params(np.random.default_rng(seed))), batch(np.random.default_rng([seed, rank]), 4)
    )
    checkpoints = OrbaxCheckpoints(root, dp)
    step = checkpoints.save(state)
    checkpoints.wait_until_finished()
    sealed = (Path(root) / str(step) / "manifest.json").exists()
    restored = checkpoints.restore(initial_params(np.random.default_rng(seed)))
    checkpoints.close()
    return {"sealed": sealed, "saved": host(state.params), "restored": host(restored.params)}


def test_no_process_returns_from_a_save_before_it_is_sealed(tmp_path, rng):
    results = run_ranks(
        "test_orbax_checkpoint_jax:save_on_two_processes",
        2,
        str(tmp_path),
        int(rng.integers(2**31)),
        timeout=300,
        env=ONE_CPU_DEVICE,
    )
    for result in results:
        assert result.value["sealed"], f"rank {result.rank} returned from the save before the step was sealed"
        assert_trees_equal(result.value["restored"], result.value["saved"])


READ_ON_ONE_DEVICE = """
import json, sys
import jax, numpy as np, orbax.checkpoint as ocp
from bagua_jax.checkpoint import read_state as read_own
from bagua_jax.orbax_checkpoint import read_state

orbax_root, own_root = sys.argv[1], sys.argv[2]
try:
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.restore(f"{orbax_root}/3/state")
    plain = "read"
except ValueError as error:
    plain = str(error)
name = lambda k: str(getattr(k, "name", getattr(k, "key", getattr(k, "idx", k))))
leaves = jax.tree_util.tree_leaves_with_path(read_state(orbax_root))
print(json.dumps({
    "devices": jax.device_count(),
    "plain orbax": plain,
    "orbax": {"/".join(map(name, path)): np.asarray(leaf).tolist() for path, leaf in leaves},
    "own": [{key: value.tolist() for key, value in rank.items()} for rank in read_own(own_root)],
}))
"""


def test_a_four_device_state_is_read_in_a_one_device_process(tmp_path, rng):
    """The documented route (docs/guides/checkpoints.md): ``read_state`` of either format, in a process with one
    device, gives the arrays a 4-device mesh job saved; orbax's own restore there refuses the topology."""
    state = saved_in_both_formats(tmp_path, rng)
    read = run_json(READ_ON_ONE_DEVICE, str(tmp_path / "orbax"), str(tmp_path / "own"), env=ONE_CPU_DEVICE)
    assert read["devices"] == 1 and "Topology mismatch" in read["plain orbax"], read["plain orbax"]
    assert read["orbax"] == {"/".join(path): value for path, value in by_name(state._asdict()).items()}
    assert len(read["own"]) == 4
    for rank, arrays in enumerate(read["own"]):
        for leaf in ("w", "b"):
            assert arrays[f".params['{leaf}']"] == np.asarray(state.params[leaf][rank]).tolist(), (rank, leaf)

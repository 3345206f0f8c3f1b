"""A damaged checkpoint of the project's own format is refused with an error naming the file and what is wrong.

Two committed checkpoints of a 2-rank mesh (steps 1 and 2); one file of step 2 is then
truncated, emptied, replaced by step 1's shard of the same rank, or the manifest is deleted,
and restoring step 2 must raise naming that file, where numpy would raise a bare
``BadZipFile``/``EOFError`` or load another step's state silently.
"""

from __future__ import annotations

import shutil

import jax
import optax
import pytest
from jax.sharding import Mesh
from test_checkpoint_jax import LR, batch, initial_params, loss_fn

from bagua_common.job.checkpoint import MANIFEST, DamagedCheckpointError, Manifest, commit
from bagua_jax import DataParallel
from bagua_jax.algorithms import ByteGrad
from bagua_jax.checkpoint import restore, save


def damage_truncate(step_dir, other_dir):
    shard = step_dir / "rank_1.npz"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    return shard, "truncated"


def damage_empty(step_dir, other_dir):
    shard = step_dir / "rank_0.npz"
    shard.write_bytes(b"")
    return shard, "empty"


def damage_other_step(step_dir, other_dir):
    shard = step_dir / "rank_1.npz"
    shutil.copyfile(other_dir / "rank_1.npz", shard)
    return shard, "another checkpoint"


def damage_manifest(step_dir, other_dir):
    manifest = step_dir / MANIFEST
    manifest.unlink()
    return manifest, "missing"


def test_damaged_shard_is_refused_naming_the_file(tmp_path, rng):
    dp = DataParallel(
        loss_fn, optax.adam(LR), ByteGrad(error_feedback=True, hierarchical=False), mesh=Mesh(jax.devices()[:2], ("r",))
    )
    state = dp.init(initial_params(rng))
    state, _ = dp.step(state, batch(rng))
    first = save(tmp_path, state, dp)
    state, _ = dp.step(state, batch(rng))
    second = save(tmp_path, state, dp)
    restore(second, dp, initial_params(rng))  # intact: loads
    for damage in (damage_truncate, damage_empty, damage_other_step, damage_manifest):
        copy = tmp_path / damage.__name__ / second.name
        shutil.copytree(second, copy)
        path, what = damage(copy, first)
        error = FileNotFoundError if damage is damage_manifest else DamagedCheckpointError
        with pytest.raises(error) as raised:
            restore(copy, dp, initial_params(rng))
        message = str(raised.value)
        assert str(path) in message and what in message, message


def test_a_commit_missing_a_ranks_shard_says_the_folder_must_be_shared(tmp_path):
    # A multi-node job saving into a folder each node has its own copy of: rank 0 finds only its own shard.
    (tmp_path / "rank_0.npz").write_bytes(b"rank 0's part")
    manifest = Manifest(step=10, world_size=2, local_world_size=1, algorithm="gradient_allreduce", config={}, model=[])
    with pytest.raises(RuntimeError, match=r"shards of ranks \[1\] are missing.*filesystem they all share"):
        commit(tmp_path, manifest)
    assert not (tmp_path / MANIFEST).exists()

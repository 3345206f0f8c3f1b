"""The cached dataset under torch DataLoader workers (fork and spawn) and ranks of one node."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from cache_datasets import CountingDataset, epoch_reads

from bagua_common.data.cache_stores import ENV_CACHE_DIR, ENV_CACHE_URL, LmdbStore
from bagua_torch.data import CachedDataset

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX, if another test loaded it
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_lmdb_cache_shared_by_dataloader_workers(tmp_path, context):
    log = str(tmp_path / "reads")
    dataset = CachedDataset(
        CountingDataset(96, log), LmdbStore(str(tmp_path / "lmdb"), capacity_bytes=1 << 24), name="dl"
    )
    first, second = epoch_reads(dataset, log, num_workers=2, context=context)
    assert first == 96
    assert second <= 0.01 * 96  # hit rate of epoch 2 >= 0.99
    np.testing.assert_array_equal(dataset[5], np.random.default_rng(5).standard_normal(64).astype(np.float32))


RANK_SCRIPT = """
    import json, os, sys, time
    sys.path.insert(0, {tests!r})
    from torch.utils.data import DataLoader
    from cache_datasets import CountingDataset, reads
    from bagua_torch.data import BalancedBatchSampler, CachedDataset

    rank, world, costs = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    log = os.path.join({tmp!r}, f"reads-{{rank}}")
    dataset = CachedDataset(CountingDataset(len(costs), log), name="node")  # the default store
    batches = BalancedBatchSampler(costs, batch_size=4, num_replicas=world, rank=rank)
    loader = DataLoader(dataset, batch_sampler=batches, num_workers=2, multiprocessing_context="fork", timeout=120)
    result = []
    for epoch in range(2):
        batches.set_epoch(epoch)
        before = reads(log)
        seen = sorted(i for batch in batches for i in batch)
        assert sum(len(b) for b in loader) == len(seen)
        result.append({{"reads": reads(log) - before, "samples": seen}})
        open(os.path.join({tmp!r}, f"done-{{epoch}}-{{rank}}"), "w").close()
        deadline = time.monotonic() + 120  # every rank ends the epoch before any reads the next
        while not all(os.path.exists(os.path.join({tmp!r}, f"done-{{epoch}}-{{r}}")) for r in range(world)):
            assert time.monotonic() < deadline, "another rank did not finish its epoch"
            time.sleep(0.05)
    print("RESULT", json.dumps(result))
"""


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_ranks_of_a_node_share_one_cache_under_the_balanced_sampler(tmp_path, rng):
    """2 ranks x 2 DataLoader workers: the sampler deals each rank other samples in epoch 2, all cached."""
    world, costs = 2, rng.integers(1, 100, 64).tolist()
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT.format(tests=str(ROOT / "tests"), tmp=str(tmp_path))))
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{ENV_CACHE_DIR: str(tmp_path / "node")})
    env.pop(ENV_CACHE_URL, None)
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(world), json.dumps(costs)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in range(world)
    ]
    results = []
    for proc in ranks:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.split("RESULT", 1)[1]))
    assert sum(r[0]["reads"] for r in results) == len(costs)  # epoch 1 reads each sample once
    moved = [set(r[1]["samples"]) - set(r[0]["samples"]) for r in results]
    assert all(moved)  # each rank has samples another rank read in epoch 1
    assert [r[1]["reads"] for r in results] == [0] * world
    assert len(os.listdir(tmp_path / "node")) == 1  # one environment for the dataset

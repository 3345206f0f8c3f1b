"""A dataset whose source changed is never served from the cache (its fingerprint: class, length, sampled items).

The issue's scenario: a script wraps ``CachedDataset(ds, name="my-dataset")`` with the default store, runs, and runs
again after the dataset's values changed (a fixed label); the second run must get the new values, and say once that
it dropped the old ones.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time

import numpy as np
from cache_datasets import CountingDataset, reads
from fresh_interpreter import ROOT, source_tree_env

from bagua_common.data.cache_stores import ENV_CACHE_DIR, ENV_CACHE_URL, LmdbStore, MemoryStore
from bagua_common.data.cached_dataset import CachedDataset, dataset_fingerprint, fingerprint_positions

DROPPED = "changed since its values were cached"

RUN = """
import json, sys
from bagua_common.data.cached_dataset import CachedDataset

class Labelled:
    def __init__(self, label): self.label = label
    def __len__(self): return 3
    def __getitem__(self, i): return (i, self.label)

data = CachedDataset(Labelled(int(sys.argv[1])), name="my-dataset")
values = [data[i] for i in range(3)]
print(json.dumps({"values": values, "hits": data.stats()["hits"]}))
"""


def run_script(label: int, cache_dir: str) -> tuple[dict, str]:
    env = source_tree_env() | {ENV_CACHE_DIR: cache_dir}
    env.pop(ENV_CACHE_URL, None)
    done = subprocess.run(
        [sys.executable, "-c", RUN, str(label)], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_a_second_run_after_the_values_changed_gets_the_new_values(tmp_path):
    cache = str(tmp_path / "cache")
    first, said = run_script(1, cache)
    assert first == {"values": [[0, 1], [1, 1], [2, 1]], "hits": 0} and said == ""
    second, said = run_script(2, cache)
    assert second == {"values": [[0, 2], [1, 2], [2, 2]], "hits": 0}
    assert said.count(DROPPED) == 1 and "dropped 3 cached values" in said, said
    assert len(said.strip().splitlines()) == 1, said
    third, said = run_script(2, cache)  # unchanged since: served from the cache, silently
    assert third == {"values": [[0, 2], [1, 2], [2, 2]], "hits": 3} and said == ""


class Shifted(CountingDataset):
    """CountingDataset's samples plus ``shift``: the same class and length, other values."""

    def __init__(self, n: int, log_path: str, shift: float) -> None:
        super().__init__(n, log_path)
        self.shift = shift

    def __getitem__(self, index: int) -> np.ndarray:
        return super().__getitem__(index) + np.float32(self.shift)


def test_same_length_other_values_are_dropped_and_rebuilt(tmp_path, caplog):
    store = LmdbStore(str(tmp_path / "lmdb"), capacity_bytes=1 << 24)
    log = str(tmp_path / "reads")
    old = CachedDataset(Shifted(100, log, 0.0), store, name="shifted")
    for i in range(100):
        old[i]
    kept = CachedDataset(Shifted(100, log, 0.0), store, name="shifted")
    assert all(np.array_equal(kept[i], old.dataset[i]) for i in range(100)) and kept.stats()["hits"] == 100
    assert DROPPED not in caplog.text
    new = CachedDataset(Shifted(100, log, 1.0), store, name="shifted")
    assert caplog.text.count(DROPPED) == 1 and "dropped 100 cached values" in caplog.text
    for i in range(100):
        np.testing.assert_array_equal(new[i], old.dataset[i] + 1)
    assert new.stats()["hits"] == 0 and new.stats()["puts"] == 100
    # Only the new fingerprint's values and its record are left in the environment.
    with store._open().begin() as txn:
        assert txn.stat()["entries"] == 101
    caplog.clear()
    again = CachedDataset(Shifted(100, log, 1.0), store, name="shifted")
    assert again[5] is not None and again.stats()["hits"] == 1 and DROPPED not in caplog.text


def test_the_fingerprint_reads_a_few_fixed_items(tmp_path):
    log = str(tmp_path / "reads")
    positions = fingerprint_positions(1_000_000)
    assert positions == fingerprint_positions(1_000_000) and len(positions) == 8
    assert positions[0] == 0 and positions[-1] == 999_999
    assert fingerprint_positions(3) == [0, 1, 2]
    before = reads(log)
    CachedDataset(CountingDataset(1_000_000, log), MemoryStore(1 << 20), name="large")
    assert reads(log) - before == 8
    with open(log) as lines:
        assert sorted(int(line.split()[1]) for line in lines) == positions


def test_what_the_fingerprint_covers(tmp_path):
    log = str(tmp_path / "reads")
    base = dataset_fingerprint(Shifted(20, log, 0.0))
    assert dataset_fingerprint(Shifted(20, log, 0.0)) == base
    assert dataset_fingerprint(Shifted(21, log, 0.0)) != base  # length
    assert dataset_fingerprint(Shifted(20, log, 0.5)) != base  # values
    assert dataset_fingerprint(CountingDataset(20, log)) != dataset_fingerprint(Shifted(20, log, 0.0))  # class
    # An item no sample reads is not seen: a new version is the explicit way.
    store = MemoryStore(1 << 20)

    class OneChanged(Shifted):
        def __getitem__(self, index: int) -> np.ndarray:
            return super().__getitem__(index) + np.float32(index == 1)

    assert 1 not in fingerprint_positions(20) and dataset_fingerprint(OneChanged(20, log, 0.0)) != base
    assert CachedDataset(Shifted(20, log, 0.0), store, name="v", version="1")[1] is not None
    changed = CachedDataset(OneChanged(20, log, 0.0), store, name="v", version="2")
    np.testing.assert_array_equal(changed[1], Shifted(20, log, 0.0)[1] + 1)


OPEN_AT_ONCE = """
import json, os, sys, time
import numpy as np
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
from test_cache_fingerprint import Shifted
from bagua_common.data.cache_stores import LmdbStore
from bagua_common.data.cached_dataset import CachedDataset

path, log, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
time.sleep(max(0.0, start - time.time()))
data = CachedDataset(Shifted(40, log, 2.0), LmdbStore(path, capacity_bytes=1 << 24), name="shared")
ok = all(np.array_equal(data[i], Shifted(40, log, 2.0)[i]) for i in range(40))
print(json.dumps({"ok": ok}))
"""


def test_ranks_opening_a_changed_store_at_once_drop_it_once(tmp_path, caplog):
    """Four processes (the ranks and loader workers of a node) open a changed dataset's store at the same moment:
    one drops the old values and says so, every one reads the new values."""
    path, log = str(tmp_path / "lmdb"), str(tmp_path / "reads")
    old = CachedDataset(Shifted(40, log, 0.0), LmdbStore(path, capacity_bytes=1 << 24), name="shared")
    for i in range(40):
        old[i]
    start = str(time.time() + 2.0)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", OPEN_AT_ONCE, path, log, start],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=source_tree_env(),
            cwd=ROOT,
        )
        for _ in range(4)
    ]
    outputs = [rank.communicate(timeout=300) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), outputs
    assert all(json.loads(out.strip().splitlines()[-1])["ok"] for out, _ in outputs), outputs
    told = [err for _, err in outputs if DROPPED in err]
    assert len(told) == 1 and "dropped 40 cached values" in told[0], outputs
    with caplog.at_level(logging.WARNING):
        CachedDataset(Shifted(40, log, 2.0), LmdbStore(path, capacity_bytes=1 << 24), name="shared")
    assert DROPPED not in caplog.text

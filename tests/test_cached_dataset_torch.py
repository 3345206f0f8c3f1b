"""The cached dataset under torch DataLoader workers (fork and spawn): epoch 2 is served cached."""

import numpy as np
import pytest
from cache_datasets import CountingDataset, epoch_reads

from bagua_common.data.cache_stores import LmdbStore
from bagua_torch.data import CachedDataset


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # JAX, if another test loaded it
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_lmdb_cache_shared_by_dataloader_workers(tmp_path, context):
    log = str(tmp_path / "reads")
    dataset = CachedDataset(CountingDataset(96, log), LmdbStore(capacity_bytes=1 << 24), name="dl")
    first, second = epoch_reads(dataset, log, num_workers=2, context=context)
    assert first == 96
    assert second <= 0.01 * 96  # hit rate of epoch 2 >= 0.99
    np.testing.assert_array_equal(dataset[5], np.random.default_rng(5).standard_normal(64).astype(np.float32))

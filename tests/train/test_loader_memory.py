"""Memory stays flat: the PSS of the process tree (trainer + 2 workers) over 20 epochs.

PSS counts each shared page once across the forked workers, so per-sample Python objects (whose
refcount writes copy pages into every worker, epoch after epoch) would show up as growth here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import fsspec
import pytest
from conftest import wait_for, write_parquet_dataset

from epochcache import EpochCachedLoader, SyncDaemon
from epochcache.config import Config
from epochcache.tools.pss import process_tree, tree_pss_bytes

EPOCHS = 20
MEASURE_AT = 2  # a batch early in each epoch


@pytest.mark.slow
def test_process_tree_pss_grows_under_2_percent_from_epoch_2_to_20(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    remote = str(tmp_path / "remote")
    write_parquet_dataset(fsspec.filesystem("file"), remote, files=4, rows_per_file=1000, rows_per_group=250)
    config = make_config(remote, **{"cache.max_bytes": "40MB", "cache.shard_bytes": "1MB"})
    SyncDaemon(config, progress=False).run(once=True)
    pss = []
    with EpochCachedLoader(config.cache.dir, batch_size=64, num_workers=2) as loader:
        for _ in range(EPOCHS):
            for number, batch in enumerate(loader):
                assert batch["image"].shape[0] <= 64
                if number == MEASURE_AT:
                    # the loader and its 2 worker processes, kept across epochs
                    wait_for(lambda: len(process_tree(os.getpid())) == 3, timeout=30)
                    pss.append(tree_pss_bytes())
    print("PSS per epoch (MiB):", [round(p / 2**20, 1) for p in pss])
    growth = pss[-1] / pss[1] - 1
    assert growth < 0.02, f"PSS grew {growth:.1%} from epoch 2 to {EPOCHS}: {[p >> 20 for p in pss]} MiB"

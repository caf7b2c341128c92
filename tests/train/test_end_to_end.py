"""The whole path on a real S3-protocol server: remote Parquet -> daemon -> shards -> three epochs."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import s3fs
from conftest import DaemonThread, UnitLog, make_table, wait_for, write_parquet_dataset

from epochcache import EpochCachedLoader, Ledger
from epochcache.cache.layout import CacheLayout
from epochcache.cache.shards import open_shard
from epochcache.config import Config
from epochcache.sources import KEY_COLUMN
from epochcache.sync.daemon import StopReason

FILES, ROWS_PER_FILE, ROWS_PER_GROUP = 8, 1024, 128
UNITS = FILES * ROWS_PER_FILE // ROWS_PER_GROUP


class DiskWatcher:
    """Samples the bytes of every file under a folder, every few milliseconds, keeping the maximum."""

    def __init__(self, root: Path) -> None:
        self.root, self.peak, self.samples = root, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            total = 0
            for dirpath, _, names in os.walk(self.root):
                for name in names:
                    try:
                        total += os.stat(os.path.join(dirpath, name)).st_size
                    except FileNotFoundError:  # deleted between listing and stat
                        pass
            self.peak, self.samples = max(self.peak, total), self.samples + 1

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _cached_keys(config: Config) -> list[str]:
    layout = CacheLayout(Path(config.cache.dir))
    ledger = Ledger(layout.ledger)
    keys = [key for r in ledger.shards() for key in open_shard(layout.shards / r.filename)[KEY_COLUMN].to_pylist()]
    ledger.close()
    return keys


@pytest.mark.slow
def test_remote_to_three_epochs_within_budget_and_resumable(
    s3: s3fs.S3FileSystem, bucket: str, s3_options: dict[str, Any], make_config: Callable[..., Config]
) -> None:
    write_parquet_dataset(s3, f"{bucket}/data", FILES, ROWS_PER_FILE, ROWS_PER_GROUP)
    dataset_bytes = FILES * ROWS_PER_FILE * make_table(1).nbytes  # as cached: decoded Arrow
    budget = 2_000_000
    assert budget < dataset_bytes / 2, "the budget must be much smaller than the dataset"
    config = make_config(f"s3://{bucket}/data", **{
        "source.storage_options": s3_options, "cache.max_bytes": budget, "cache.shard_bytes": "250KB",
        "sampler.max_bytes_per_s": "400KB",
    })
    ledger = Ledger(CacheLayout.create(config.cache.dir).ledger)
    watcher = DiskWatcher(Path(config.cache.dir))
    first_run = UnitLog()
    runner = DaemonThread(first_run.daemon(config))

    def grew_or_full(shards: int) -> bool:
        usage = ledger.usage()
        return usage.shards > shards or usage.total + int(config.cache.shard_bytes) > budget

    epochs = []
    with EpochCachedLoader(config.cache.dir, batch_size=16) as loader:
        for _ in range(3):
            seen: list[int] = []
            for i, batch in enumerate(loader):
                if i == 0:  # let the daemon publish more (or fill the budget) before the next snapshot
                    current = loader.last_epoch.shards
                    wait_for(lambda: grew_or_full(current) or runner.error, timeout=60)
                seen.extend(int(x) for x in batch["id"])
            epochs.append(loader.last_epoch)
            assert sorted(seen) == sorted(set(seen)) and len(seen) == loader.last_epoch.samples
    runner.stop()
    peak = watcher.stop()

    counts = [e.shards for e in epochs]
    assert counts == sorted(counts) and counts[-1] > counts[0], f"the shard set grew: {epochs}"
    # Coverage: the first epoch trains only distinct samples, out of the remote's 8,192 (every footer
    # of the 8 files was read with the first group); later epochs add new samples and repeat old ones.
    assert epochs[0].echo == 1.0 and epochs[0].coverage == pytest.approx(epochs[0].samples / (FILES * ROWS_PER_FILE))
    assert [e.coverage for e in epochs] == sorted(e.coverage for e in epochs) and epochs[-1].coverage <= 1
    assert epochs[-1].echo > 1.0, "epochs re-read cached samples"
    assert watcher.samples > 10 and 0 < peak <= budget, f"bytes under the cache dir peaked at {peak} > {budget}"
    keys = _cached_keys(config)
    assert keys and len(keys) == len(set(keys)), "no sample appears twice in the cache"

    # A restarted daemon (a roomier budget, so it can finish the pass) fetches nothing published before.
    roomy = config.model_copy(update={"cache": config.cache.model_copy(update={"max_bytes": 50_000_000})})
    second_run = UnitLog()
    assert second_run.daemon(roomy).run(once=True).reason is StopReason.EXHAUSTED
    assert first_run.published and set(second_run.fetched).isdisjoint(first_run.published)
    published = first_run.published + second_run.published
    assert len(published) == len(set(published)) == UNITS, "the pass covered every unit exactly once"
    keys = _cached_keys(config)
    assert len(keys) == len(set(keys))
    assert pa.array(keys).unique().to_pylist() == keys
    ledger.close()

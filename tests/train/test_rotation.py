"""A loader's per-shard state stays bounded by the cache while the daemon rotates it.

A long run sees every shard the daemon ever publishes: state kept by shard id for the loader's life
(shards found present, shards queued for checksumming) must shrink with the cache as shards are
evicted, or it grows with the remote fetched, not with the cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import fsspec
import pyarrow.parquet as pq
import pytest
from conftest import DaemonThread, make_table, wait_for, write_parquet_dataset

from epochcache import EpochCachedLoader, SyncDaemon
from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger
from epochcache.config import Config

ROUNDS = 3
ROWS = 200


@pytest.fixture
def synced(synced_cache: Callable[..., Config]) -> Config:
    return synced_cache(files=2, rows_per_file=ROWS, rows_per_group=50, shard_bytes="128KiB")


def _rotate(config: Config, ledger: Ledger, round_: int) -> set[str]:
    """The daemon's rotation, one step: new objects on the remote are synced into new shards, and
    every shard before them is retired (later snapshots leave them out). Returns the retired ids."""
    before = {record.id for record in ledger.shards()}
    remote = Path(config.sources[0].url)
    pq.write_table(make_table(ROWS, start=(round_ + 10) * ROWS), remote / f"new-{round_:03d}.parquet",
                   row_group_size=50)
    SyncDaemon(config, progress=False).run(once=True)
    retire = lambda shards, short: [s for s in shards if s.id in before]  # noqa: E731
    assert ledger.make_room(1, budget=1, choose=retire) is None  # leased by the prepared epoch: retiring
    return before


def _evict(layout: CacheLayout, ledger: Ledger, retired: set[str]) -> None:
    """Delete the retired shards once no lease holds them, as the daemon's eviction does."""
    wait_for(lambda: not any(retired & set(lease["shards"]) for lease in ledger.leases.live()), timeout=30)
    records = [record for record in ledger.shards() if record.id in retired]
    ledger.drop([record.id for record in records])
    for record in records:
        layout.remove(record.filename)


def test_shards_found_present_are_forgotten_once_evicted(synced: Config) -> None:
    layout = CacheLayout(Path(synced.cache.dir))
    ledger = Ledger(layout.ledger)
    with EpochCachedLoader(synced.cache.dir, batch_size=32, progress=False) as loader:
        assert len(list(loader)) > 0
        for round_ in range(ROUNDS):
            retired = _rotate(synced, ledger, round_)
            assert len(list(loader)) > 0  # prepared before the rotation: reads the retired shards
            assert len(list(loader)) > 0  # the new shards only
            _evict(layout, ledger, retired)
        cached = {record.id for record in ledger.shards()}
        assert loader.last_epoch is not None and loader.last_epoch.shards == len(cached)  # it read the cache as it is
        # (private: no public view shows it; it held every shard ever leased, 4 more per round)
        known = loader._builder._present_ids
        assert known <= cached, f"{len(known - cached)} evicted shards still remembered ({len(cached)} cached)"
    ledger.close()


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_an_epoch_whose_every_shard_the_daemon_retired_does_not_hold_the_next_one_up(
    tmp_path: Path, make_config: Callable[..., Config], workers: int
) -> None:
    """A full cache and a daemon that, to make room, retires every shard the running epoch leases
    (``low_watermark`` near 0): the next epoch's snapshot has none, and the daemon can publish only
    once that epoch's lease lets them go. The lease goes as the next epoch is waited for, not after
    its first batch (which would never come: both sides waited until ``wait_timeout_s``)."""
    write_parquet_dataset(fsspec.filesystem("file"), str(tmp_path / "remote"), files=6, rows_per_file=256,
                          rows_per_group=32)
    config = make_config(str(tmp_path / "remote"), **{"cache.max_bytes": 1_500_000, "cache.shard_bytes": "64KiB",
                                                       "cache.low_watermark": 0.01, "cache.min_uses": 1})
    daemon = DaemonThread(SyncDaemon(config, progress=False))
    ledger = Ledger(CacheLayout.create(config.cache.dir).ledger)
    try:
        # the budget full of shards no epoch used yet: the first epoch's snapshot takes every one
        wait_for(lambda: (ledger.daemon.status() or {}).get("state") == "waiting for training")
        with EpochCachedLoader(config.cache.dir, batch_size=16, progress=False, wait_timeout_s=20,
                               num_workers=workers) as loader:
            for epoch in range(3):
                ids = []
                for number, batch in enumerate(loader):
                    if number == 1 and epoch == 0:  # the epoch recorded, its shards used: the daemon retires them all
                        wait_for(lambda: ledger.usage().retiring_bytes == ledger.usage().shard_bytes > 0)
                    ids.extend(batch["id"].tolist())
                assert ids and len(ids) == len(set(ids)) == loader.last_epoch.samples
    finally:
        ledger.close()
        daemon.stop()

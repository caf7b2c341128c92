"""A loader's per-shard state stays bounded by the cache while the daemon rotates it.

A long run sees every shard the daemon ever publishes: state kept by shard id for the loader's life
(shards found present, shards queued for checksumming) must shrink with the cache as shards are
evicted, or it grows with the remote fetched, not with the cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import make_table, wait_for

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

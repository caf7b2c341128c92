"""A shard that leaves the cache is unmapped in the trainer and its workers once no epoch reads it.

The daemon deletes an evicted shard's file once no lease holds it, but a file still mapped keeps its
blocks on disk: mappings kept across epochs would hold the disk the budget counts as freed (up to
``max_open_shards`` shards per process)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import wait_for

from epochcache import EpochCachedLoader
from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger
from epochcache.config import Config
from epochcache.tools.pss import process_tree


@pytest.fixture
def synced(synced_cache: Callable[..., Config]) -> Config:
    return synced_cache(files=3, rows_per_file=200, rows_per_group=50, shard_bytes="128KiB")


def _mapped(name: str) -> list[int]:
    """The processes of this process tree (this one and its workers) that map a file named ``name``."""
    found = []
    for pid in process_tree(os.getpid()):
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except FileNotFoundError:  # a process that just ended
            continue
        if name in maps:
            found.append(pid)
    return found


@pytest.mark.parametrize("workers", [0, 2])
def test_an_evicted_shard_is_unmapped_once_the_epochs_that_read_it_are_done(synced: Config, workers: int) -> None:
    layout = CacheLayout(Path(synced.cache.dir))
    ledger = Ledger(layout.ledger)
    victim = ledger.shards()[0]
    transform = (lambda batch: batch) if workers else None
    with EpochCachedLoader(synced.cache.dir, batch_size=32, num_workers=workers, transform=transform,
                           progress=False, prepare_next_at=0.5) as loader:
        assert len(list(loader)) > 0  # epoch 0 maps every shard; epoch 1, prepared meanwhile, leases them all
        assert _mapped(victim.filename)
        # the daemon's eviction picks it: retiring, later snapshots leave it out (no room is made yet)
        picks_victim = lambda shards, short: [s for s in shards if s.id == victim.id]  # noqa: E731
        assert ledger.make_room(1, budget=1, choose=picks_victim) is None
        epoch1_ids = [i for batch in loader for i in batch["id"].tolist()]  # prepared before: still reads it
        epoch2 = iter(loader)
        next(epoch2)
        next(epoch2)  # back from epoch 2's first batch: epoch 1's lease is released in the background
        wait_for(lambda: all(victim.id not in lease["shards"] for lease in ledger.leases.live()), timeout=30)
        layout.remove(victim.filename)  # as the daemon does once no lease holds it
        rest = [i for batch in epoch2 for i in batch["id"].tolist()]
        assert len(list(loader)) > 0  # epoch 3
        assert len(epoch1_ids) == 600 and rest, "epoch 1 read every row, the victim's included"
        wait_for(lambda: not _mapped(victim.filename), timeout=30)  # (deleted: its blocks are free once unmapped)
    ledger.close()


def test_a_closed_loader_maps_no_shard(synced: Config) -> None:
    ledger = Ledger(CacheLayout(Path(synced.cache.dir)).ledger)
    names = [record.filename for record in ledger.shards()]
    ledger.close()
    loader = EpochCachedLoader(synced.cache.dir, batch_size=32, progress=False)
    assert len(list(loader)) > 0
    assert all(_mapped(name) for name in names)
    loader.close()  # the loader is still referenced: closing alone must release its mappings
    assert not any(_mapped(name) for name in names)

"""The trainer's heap is frozen while worker processes run, never longer.

Forking the workers freezes the heap (``gc.freeze``: no collection copies the pages they share), and
frozen objects are never collected: cyclic garbage alive at that moment (a dropped model, a traceback)
would stay in the trainer for good, once more at each pool started (every loader, every epoch left
early) unless the heap is unfrozen once the workers are gone."""

from __future__ import annotations

import gc
from collections.abc import Callable

import pytest
from conftest import dropped_cycle

from epochcache import EpochCachedLoader
from epochcache.config import Config


@pytest.fixture
def synced(synced_cache: Callable[..., Config]) -> Config:
    return synced_cache(files=3, rows_per_file=200, rows_per_group=50, shard_bytes="128KiB")


@pytest.mark.usefixtures("collector_off")
def test_garbage_alive_when_workers_fork_is_collected_once_the_loader_is_closed(synced: Config) -> None:
    loader = EpochCachedLoader(synced.cache.dir, batch_size=32, num_workers=2, transform=lambda b: b,
                               progress=False)
    garbage = dropped_cycle()
    assert len(list(loader)) > 0  # the first epoch forks the workers
    gc.collect(0)  # (frees the garbage, young since no collection ran, unless it is frozen)
    assert garbage() is not None, "the heap is frozen while the workers run"
    loader.close()
    gc.collect()
    assert garbage() is None, "cyclic garbage frozen with the workers' fork outlived them"


@pytest.mark.slow  # (several seconds: run by .ci/run, out of plain pytest's 3 minutes)
@pytest.mark.usefixtures("collector_off")
def test_each_epoch_left_early_lets_go_of_the_heap_it_froze(synced: Config) -> None:
    with EpochCachedLoader(synced.cache.dir, batch_size=32, num_workers=2, transform=lambda b: b,
                           progress=False) as loader:
        dropped = []
        for _ in range(3):
            dropped.append(dropped_cycle())
            for number, _batch in enumerate(loader):
                if number == 2:
                    break  # closes the pool: the next epoch forks a new one
            del _batch
            gc.collect()
        assert all(ref() is None for ref in dropped), f"{sum(r() is not None for r in dropped)} of 3 kept"

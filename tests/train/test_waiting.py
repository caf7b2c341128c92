"""epochcache.train.waiting: a wait learns of the daemon's publish from a probe of the ledger (a commit
by another connection), not at the next poll of the cache's state; and the loader's wait for an empty
cache's first shard ends with that shard in its epoch."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import make_table

from epochcache import EpochCachedLoader, Ledger
from epochcache.cache.layout import CacheLayout
from epochcache.cache.lockfile import exclusive
from epochcache.cache.publisher import Publisher
from epochcache.config import CacheConfig
from epochcache.train.waiting import LedgerChanges, wait_for_samples


@pytest.fixture
def layout(tmp_path: Path) -> CacheLayout:
    return CacheLayout.create(tmp_path / "cache")


@pytest.fixture
def ledger(layout: CacheLayout) -> Iterator[Ledger]:
    opened = Ledger(layout.ledger)
    yield opened
    opened.close()


@pytest.fixture
def daemons_ledger(layout: CacheLayout) -> Iterator[Ledger]:
    """The daemon's side: a connection of its own."""
    opened = Ledger(layout.ledger)
    yield opened
    opened.close()


def publish(layout: CacheLayout, ledger: Ledger, rows: int, unit: str) -> None:
    cache = CacheConfig.model_validate({"dir": str(layout.root), "max_bytes": "50MB", "shard_bytes": "1MB"})
    assert Publisher(layout, ledger, cache, threading.Event()).publish(make_table(rows), [unit], None) is not None


def test_a_commit_by_another_connection_is_a_change(ledger: Ledger, daemons_ledger: Ledger) -> None:
    changes = LedgerChanges(ledger)
    daemons_ledger.counters.incr("units_skipped")
    assert changes.wait(threading.Event(), timeout_s=30)
    assert not changes.wait(threading.Event(), timeout_s=0.05)  # seen once: no change since


def test_its_own_commits_are_no_change(ledger: Ledger) -> None:
    changes = LedgerChanges(ledger)
    ledger.counters.incr("units_skipped")
    assert not changes.wait(threading.Event(), timeout_s=0.05)


def test_a_commit_before_the_wait_begins_is_not_missed(ledger: Ledger, daemons_ledger: Ledger) -> None:
    changes = LedgerChanges(ledger)  # made before the state is looked at
    daemons_ledger.counters.incr("units_skipped")  # between the look and the wait
    assert changes.wait(threading.Event(), timeout_s=30)


def test_a_stopped_wait_ends_without_a_change(ledger: Ledger) -> None:
    stop = threading.Event()
    stop.set()
    assert not LedgerChanges(ledger).wait(stop, timeout_s=600)  # at once: a 600 s wait would time the test out


def test_waiting_for_samples_ends_once_the_daemon_published_them(
    layout: CacheLayout, ledger: Ledger, daemons_ledger: Ledger
) -> None:
    with exclusive(layout.lock), ThreadPoolExecutor(1) as pool:  # the lock: what a running daemon holds
        waited = pool.submit(wait_for_samples, layout, ledger, 10, 600.0, threading.Event(), False)
        publish(layout, daemons_ledger, 4, "a#0")
        assert not waited.done()  # 4 of 10 samples: still waiting
        publish(layout, daemons_ledger, 6, "b#0")
        assert waited.result(timeout=30) is None
    assert ledger.usage().rows == 10


def test_an_empty_caches_first_epoch_holds_the_shard_the_daemon_publishes(
    layout: CacheLayout, daemons_ledger: Ledger
) -> None:
    with exclusive(layout.lock), ThreadPoolExecutor(1) as pool:
        with EpochCachedLoader(layout.root, batch_size=8, num_workers=0, wait_timeout_s=600, progress=False) as loader:
            loaders_commits = LedgerChanges(daemons_ledger)
            first = pool.submit(lambda: next(iter(loader)))
            assert loaders_commits.wait(threading.Event(), timeout_s=30)  # its first snapshot: of an empty cache
            assert not first.done()
            publish(layout, daemons_ledger, 8, "a#0")
            batch = first.result(timeout=30)
            assert sorted(batch["id"].tolist()) == list(range(8))
            assert loader.last_epoch is not None and loader.last_epoch.samples == 8

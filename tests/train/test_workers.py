"""Worker processes kept across epochs: the same processes read every epoch's own snapshot, and an
epoch left early costs the next epochs nothing but a new pool."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from epochcache import EpochCachedLoader
from epochcache.cache.ledger_leases import Leases
from epochcache.config import Config
from epochcache.tools.pss import process_tree


@pytest.fixture
def synced(synced_cache: Callable[..., Config]) -> Config:
    return synced_cache(files=3, rows_per_file=200, rows_per_group=50, shard_bytes="128KiB")


def _ids(batches: list[dict]) -> list[list[int]]:
    return [batch["id"].tolist() for batch in batches]


def _reference(config: Config, epochs: int) -> list[list[list[int]]]:
    """Each epoch's batches (as id lists) from the in-process batch thread, same seed."""
    with EpochCachedLoader(config.cache.dir, batch_size=32, seed=3, num_workers=0, progress=False) as loader:
        return [_ids(list(loader)) for _ in range(epochs)]


def test_the_same_worker_processes_read_every_epoch(synced: Config) -> None:
    expected = _reference(synced, 3)
    got, workers = [], []
    with EpochCachedLoader(synced.cache.dir, batch_size=32, seed=3, num_workers=2, progress=False) as loader:
        for _ in range(3):
            epoch = []
            for batch in loader:
                epoch.append(batch["id"].tolist())
                if len(epoch) == 2:
                    workers.append(sorted(set(process_tree(os.getpid())) - {os.getpid()}))
            got.append(epoch)
    assert got == expected, "each epoch: its own order, every batch once, across the boundaries"
    assert sorted(i for batch in got[2] for i in batch) == list(range(600))
    assert len(workers[0]) == 2 and workers[1] == workers[0] and workers[2] == workers[0], workers


def test_an_epoch_left_early_with_workers_leaves_the_next_epochs_whole(synced: Config) -> None:
    expected = _reference(synced, 3)
    with EpochCachedLoader(synced.cache.dir, batch_size=32, seed=3, num_workers=2, progress=False) as loader:
        first = []
        for batch in loader:
            first.append(batch["id"].tolist())
            if len(first) == 3:
                break
        rest = [_ids(list(loader)) for _ in range(2)]
    assert first == expected[0][:3]
    assert rest == expected[1:], "no batch of the epoch left early leaks into the next ones"


def test_workers_fork_before_the_epoch_waits_for_its_snapshot(synced: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    children_at_snapshot: list[int] = []
    snapshot = Leases.snapshot

    def watched(leases: Leases, *args: object, **kwargs: object) -> object:
        children_at_snapshot.append(len(set(process_tree(os.getpid())) - {os.getpid()}))
        return snapshot(leases, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Leases, "snapshot", watched)
    with EpochCachedLoader(synced.cache.dir, batch_size=32, seed=3, num_workers=2, progress=False) as loader:
        ids = sorted(i for batch in loader for i in batch["id"].tolist())
    assert children_at_snapshot[0] == 2, "the workers run while the first epoch takes its snapshot"
    assert ids == list(range(600)), "their slots, sized after they forked, carry every row once"

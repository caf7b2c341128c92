"""Worker processes kept across epochs: the same processes read every epoch's own snapshot, and an
epoch left early costs the next epochs nothing but a new pool."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import wait_for

from epochcache import EpochCachedLoader
from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger
from epochcache.cache.ledger_leases import Leases
from epochcache.cache.quarantine import quarantine_shard
from epochcache.cache.shards import open_shard
from epochcache.config import Config
from epochcache.tools.pss import process_tree
from epochcache.train.slots import SlotRing
from epochcache.train.turnover import EpochTurnover


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


@pytest.fixture
def prepared(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Set once the epoch a loader with workers prepares ahead is built (its future done, not merely
    its build returned): a test that waits for it mid-epoch has the next epoch queued on the worker
    pool at the batch after, well before the epoch's last batch. (Loaders without workers, such as
    :func:`_reference`'s, run to their epoch's end and prepare ahead too: they never set it.)"""
    done = threading.Event()
    prepare_ahead = EpochTurnover.prepare_ahead

    def prepare_ahead_then_tell(turnover: EpochTurnover, epoch: int) -> None:
        prepare_ahead(turnover, epoch)
        if turnover.unstarted is not None:  # (with workers only; None once closed)
            turnover.unstarted.add_done_callback(lambda _: done.set())

    monkeypatch.setattr(EpochTurnover, "prepare_ahead", prepare_ahead_then_tell)
    return done


def test_next_epochs_first_batch_is_received_before_the_last_one_is_handed_out_and_dropped_on_quarantine(
    synced: Config, prepared: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = _reference(synced, 1)[0]
    received: list[int] = []
    receive = SlotRing.receive
    monkeypatch.setattr(SlotRing, "receive",
                        lambda ring, message, number, pinned=False:
                        received.append(1) or receive(ring, message, number, pinned))
    layout = CacheLayout(Path(synced.cache.dir))
    ledger = Ledger(layout.ledger)
    with EpochCachedLoader(synced.cache.dir, batch_size=32, seed=3, num_workers=2, progress=False,
                           prepare_next_at=0.1) as loader:
        first, count = [], len(expected)
        for number, batch in enumerate(loader):
            first.append(batch["id"].tolist())
            if number == 2:  # the next epoch is being prepared (from batch 1 on)
                wait_for(prepared.is_set, timeout=30)
            if number == count - 1:
                assert len(received) == count + 1, "the next epoch's first batch is here as the last is handed out"
        assert first == expected
        bad = ledger.shards()[0]
        bad_ids = set(open_shard(layout.shards / bad.filename).column("id").to_pylist())
        assert quarantine_shard(layout, ledger, bad, "found damaged after the next epoch's first batch came")
        second = [i for batch in loader for i in batch["id"].tolist()]
        assert bad_ids and sorted(second) == sorted(set(range(600)) - bad_ids), "the batch received ahead is dropped"
        assert not loader.last_epoch.prepared_ahead, "built again at its start"
    ledger.close()


def test_an_error_building_the_next_epochs_first_batch_is_raised_there_not_at_this_epochs_last(
    synced: Config, prepared: threading.Event
) -> None:
    expected = _reference(synced, 2)
    poisoned = expected[1][0][:2]  # the start of the second epoch's first batch, and of no batch of the first
    assert all(ids[:2] != poisoned for ids in expected[0])

    def transform(batch: dict) -> dict:
        if batch["id"][:2].tolist() == poisoned:
            raise ValueError("poisoned batch")
        return batch

    with EpochCachedLoader(synced.cache.dir, batch_size=32, seed=3, num_workers=2, progress=False,
                           prepare_next_at=0.1, transform=transform) as loader:
        first = []
        for number, batch in enumerate(loader):
            first.append(batch["id"].tolist())
            if number == 2:
                wait_for(prepared.is_set, timeout=30)
        assert first == expected[0], "the first epoch ends whole"
        with pytest.raises(ValueError, match="poisoned batch") as raised:
            next(iter(loader))
    # (the traceback held here reaches the DataLoader's iterator: close() stops the workers all the same)
    assert raised.value.__traceback__ is not None
    assert set(process_tree(os.getpid())) == {os.getpid()}, "close() left no worker running"


def test_a_worker_killed_mid_epoch_is_raised_in_the_trainer(synced: Config) -> None:
    with EpochCachedLoader(synced.cache.dir, batch_size=32, seed=3, num_workers=2, progress=False) as loader:
        with pytest.raises(RuntimeError, match="worker"):
            for _ in range(3):
                for number, _batch in enumerate(loader):
                    if number == 1:
                        workers = sorted(set(process_tree(os.getpid())) - {os.getpid()})
                        assert len(workers) == 2
                        os.kill(workers[0], signal.SIGKILL)


def _slot_memory(pid: int) -> dict[int, int]:
    """The slot-ring memory files process ``pid`` holds open: inode -> bytes allocated."""
    held = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if "epochcache-slots" in os.readlink(f"/proc/{pid}/fd/{fd}"):
                info = os.stat(f"/proc/{pid}/fd/{fd}")
                held[info.st_ino] = info.st_blocks * 512
        except OSError:  # closed meanwhile
            continue
    return held


def test_a_closed_pools_slot_memory_is_freed_though_another_pools_workers_inherited_it(synced: Config) -> None:
    before = _slot_memory(os.getpid())  # (earlier pools' rings, still mapped until collected)
    first = EpochCachedLoader(synced.cache.dir, batch_size=32, num_workers=2, transform=lambda b: b, progress=False)
    assert len(list(first)) > 0
    [(inode, allocated)] = [(i, size) for i, size in _slot_memory(os.getpid()).items() if i not in before]
    firsts = set(process_tree(os.getpid()))
    assert allocated > 0
    with EpochCachedLoader(synced.cache.dir, batch_size=32, num_workers=2, transform=lambda b: b,
                           progress=False) as second:  # its workers fork while the first pool's memory is open
        assert len(list(second)) > 0
        seconds = set(process_tree(os.getpid())) - firsts
        assert len(seconds) == 2 and all(inode in _slot_memory(pid) for pid in seconds), "inherited by the fork"
        first.close()
        # (the trainer's mapping of the closed ring holds the file open too, until the loader is collected)
        holders = [pid for pid in [os.getpid(), *seconds] if inode in _slot_memory(pid)]
        assert holders and all(_slot_memory(pid)[inode] == 0 for pid in holders), "freed though held open"

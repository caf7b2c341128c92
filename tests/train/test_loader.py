"""EpochCachedLoader: epochs from ledger snapshots, leases, prepare-ahead, shuffling, bad shards."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from conftest import DaemonThread, wait_for, write_parquet_dataset

from epochcache import CacheEmptyError, ConfigError, EpochCachedLoader, Ledger, SyncDaemon
from epochcache.cache.layout import CacheLayout
from epochcache.cache.lockfile import exclusive
from epochcache.cache.quarantine import quarantine_shard
from epochcache.cache.shards import open_shard
from epochcache.config import Config
from epochcache.errors import LoaderError
from epochcache.train import waiting
from epochcache.train.waiting import daemon_running

ROWS = 6 * 4 * 32  # files x groups x rows


@pytest.fixture
def remote(tmp_path: Path) -> str:
    import fsspec

    write_parquet_dataset(
        fsspec.filesystem("file"), str(tmp_path / "remote"), files=6, rows_per_file=128, rows_per_group=32
    )
    return str(tmp_path / "remote")


@pytest.fixture
def synced(synced_cache: Callable[..., Config]) -> Config:
    """A cache holding a whole remote shaped like ``remote`` (written afresh at the same path)."""
    return synced_cache(files=6, rows_per_file=128, rows_per_group=32, shard_bytes="64KiB")


def _epoch_ids(loader: EpochCachedLoader) -> list[int]:
    return [int(i) for batch in loader for i in batch["id"]]


def test_epoch_yields_every_cached_sample_once_as_tensors(synced: Config) -> None:
    with EpochCachedLoader(synced.cache.dir, batch_size=50) as loader:
        batches = list(loader)
        assert all(isinstance(b["image"], torch.Tensor) and b["image"].dtype == torch.uint8 for b in batches)
        ids = [int(i) for b in batches for i in b["id"]]
        assert sorted(ids) == list(range(ROWS))
        assert ids != sorted(ids), "shuffle is on by default"
        info = loader.last_epoch
        assert (info.epoch, info.samples, info.batches) == (0, ROWS, -(-ROWS // 50))


def test_shuffle_is_seeded_by_seed_and_epoch(synced: Config) -> None:
    with EpochCachedLoader(synced.cache.dir, batch_size=64, seed=3) as a, \
         EpochCachedLoader(synced.cache.dir, batch_size=64, seed=3) as b, \
         EpochCachedLoader(synced.cache.dir, batch_size=64, seed=4) as c:
        a0, a1 = _epoch_ids(a), _epoch_ids(a)
        assert a0 == _epoch_ids(b), "same (seed, epoch): same order"
        assert a0 != a1, "a new epoch: a new order"
        assert a0 != _epoch_ids(c), "another seed: another order"


def test_no_shuffle_and_drop_last(synced: Config) -> None:
    with EpochCachedLoader(synced.cache.dir, batch_size=100, shuffle=False, drop_last=True) as loader:
        batches = list(loader)
        assert len(batches) == ROWS // 100 and all(len(b["id"]) == 100 for b in batches)


def test_lease_held_during_epoch_and_released_after(synced: Config) -> None:
    ledger = Ledger(CacheLayout(Path(synced.cache.dir)).ledger)
    loader = EpochCachedLoader(synced.cache.dir, batch_size=32, prepare_next_at=1.0)
    try:
        for i, _ in enumerate(loader):
            if i == 0:
                leases = ledger.leases.live()
                assert len(leases) == 1 and len(leases[0]["shards"]) == loader.last_epoch.shards
                finished = leases[0]["id"]
        # after the epoch, its lease is kept (its batch source is stopped later, off the next epoch's
        # first batch) beside the next epoch's, prepared in the background (built: an epoch still being
        # built when it is taken retires the last one at once, see Turnover.take)
        prepared = loader._turnover.next
        assert prepared is not None
        wait_for(prepared[1].done, timeout=10)
        next_epoch = prepared[1].result().lease.id
        assert {lease["id"] for lease in ledger.leases.live()} == {finished, next_epoch}
        epoch = iter(loader)
        next(epoch)
        assert finished in [lease["id"] for lease in ledger.leases.live()]  # kept while the first batch is in use
        next(epoch)
        # once the trainer comes back from the next epoch's first batch, the finished epoch's lease is released
        wait_for(lambda: [lease["id"] for lease in ledger.leases.live()] == [next_epoch], timeout=10)
        epoch.close()
    finally:
        loader.close()
    assert ledger.leases.live() == []
    ledger.close()


def test_a_shard_quarantined_after_the_next_epoch_was_prepared_is_not_read_by_it(synced: Config) -> None:
    layout = CacheLayout(Path(synced.cache.dir))
    ledger = Ledger(layout.ledger)
    with EpochCachedLoader(synced.cache.dir, batch_size=32, shuffle=False, prepare_next_at=0.1) as loader:
        assert sorted(_epoch_ids(loader)) == list(range(ROWS))  # every shard mapped, kept open for the next
        wait_for(lambda: len(ledger.leases.live()) == 2, timeout=10)  # the next epoch's snapshot is taken
        bad = ledger.shards()[0]
        bad_ids = set(open_shard(layout.shards / bad.filename).column("id").to_pylist())
        assert quarantine_shard(layout, ledger, bad, "found damaged after the next epoch was prepared")
        second = _epoch_ids(loader)
        assert sorted(second) == sorted(set(range(ROWS)) - bad_ids) and bad_ids
        assert not loader.last_epoch.prepared_ahead, "built again at its start"
    ledger.close()


def test_breaking_out_of_an_epoch_releases_its_lease(synced: Config) -> None:
    ledger = Ledger(CacheLayout(Path(synced.cache.dir)).ledger)
    with EpochCachedLoader(synced.cache.dir, batch_size=32) as loader:
        for _ in loader:
            break
        assert ledger.leases.live() == []
    ledger.close()


def test_next_epoch_is_prepared_ahead_and_sees_new_shards(remote: str, make_config: Callable[..., Config]) -> None:
    config = make_config(remote, **{"cache.max_bytes": "20MB", "cache.shard_bytes": "64KiB"})
    stop = threading.Event()  # a first sync that stops after its first shard
    SyncDaemon(config, progress=False, on_publish=lambda _: stop.set()).run(once=True, stop=stop)
    with EpochCachedLoader(config.cache.dir, batch_size=16, prepare_next_at=0.8) as loader:
        for i, _ in enumerate(loader):
            if i == 0:  # the daemon publishes more before the next epoch's snapshot is taken
                assert SyncDaemon(config, progress=False).run(once=True).shards_published > 0
        first = loader.last_epoch
        second_ids = _epoch_ids(loader)
        second = loader.last_epoch
    assert first.shards == 1 and not first.prepared_ahead
    assert second.prepared_ahead and second.shards > first.shards
    assert sorted(second_ids) == list(range(ROWS))
    assert second.first_batch_wait_s is not None


def test_workers_mode_yields_every_sample(synced: Config) -> None:
    with EpochCachedLoader(synced.cache.dir, batch_size=40, num_workers=2) as loader:
        assert sorted(_epoch_ids(loader)) == list(range(ROWS))
        assert sorted(_epoch_ids(loader)) == list(range(ROWS))


def test_truncated_shard_is_skipped_and_epoch_completes(synced: Config) -> None:
    # (bit flips in a shard verified at write are `epochcache verify`'s to find: see test_integrity)
    layout = CacheLayout(Path(synced.cache.dir))
    ledger = Ledger(layout.ledger)
    victim = ledger.shards()[0]
    ledger.close()
    path = layout.shards / victim.filename
    path.write_bytes(path.read_bytes()[:-100])
    with EpochCachedLoader(synced.cache.dir, batch_size=64) as loader:
        ids = _epoch_ids(loader)
        assert loader.last_epoch.skipped_shards == 1
    assert len(ids) == ROWS - victim.rows and len(set(ids)) == len(ids)


def test_empty_cache_times_out_with_a_clear_error(tmp_path: Path) -> None:
    CacheLayout.create(tmp_path / "empty")
    with EpochCachedLoader(tmp_path / "empty", wait_timeout_s=0.3) as loader:
        with pytest.raises(CacheEmptyError, match="epochcache sync"):
            next(iter(loader))


def test_a_missing_cache_dir_is_an_error_at_once_and_is_not_created(tmp_path: Path) -> None:
    with pytest.raises(LoaderError, match=r"no cache at .*typo.*check cache.dir") as caught:
        EpochCachedLoader(tmp_path / "typo")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("min_samples", [0, 10])
def test_an_empty_cache_without_a_daemon_fails_after_the_grace_not_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, min_samples: int
) -> None:
    monkeypatch.setattr(waiting, "NO_DAEMON_GRACE_S", 0.5)
    CacheLayout.create(tmp_path / "cache")
    started = time.monotonic()
    with EpochCachedLoader(tmp_path / "cache", wait_timeout_s=600, min_samples=min_samples, progress=False) as loader:
        with pytest.raises(CacheEmptyError, match="no sync daemon runs on it: start `epochcache sync`"):
            next(iter(loader))
    assert 0.5 <= time.monotonic() - started < 5


def test_an_empty_cache_with_a_daemon_running_is_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(waiting, "NO_DAEMON_GRACE_S", 0.2)
    layout = CacheLayout.create(tmp_path / "cache")
    started = time.monotonic()
    with exclusive(layout.lock):  # what a running `epochcache sync` holds
        with EpochCachedLoader(layout.root, wait_timeout_s=1.0) as loader:
            with pytest.raises(CacheEmptyError, match="while `epochcache sync` runs on it"):
                next(iter(loader))
    assert time.monotonic() - started >= 1.0, "waited the full timeout, past the no-daemon grace"


def test_bad_loader_argument_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        EpochCachedLoader(tmp_path, batch_size=0)


def test_epoch_samples_fixes_the_epoch_length_with_or_without_replacement(synced: Config) -> None:
    with EpochCachedLoader(synced.cache.dir, batch_size=100, epoch_samples=250) as loader:
        ids = _epoch_ids(loader)
        assert len(ids) == 250 and len(set(ids)) == 250, "fewer than cached: no repeats"
    with EpochCachedLoader(synced.cache.dir, batch_size=100, epoch_samples=2 * ROWS + 10) as loader:
        ids = _epoch_ids(loader)
        assert len(ids) == 2 * ROWS + 10 and set(ids) == set(range(ROWS)), "more than cached: whole rounds"
        assert loader.last_epoch.batches == -(-(2 * ROWS + 10) // 100)
    with EpochCachedLoader(synced.cache.dir, batch_size=100, epoch_samples=300, replacement=True) as loader:
        ids = _epoch_ids(loader)
        assert len(ids) == 300 and len(set(ids)) < 300 and set(ids) <= set(range(ROWS))


def test_mode_is_chosen_by_transform_and_overridable(synced: Config) -> None:
    def double(batch: dict) -> dict:
        return {**batch, "id": batch["id"] * 2}

    with EpochCachedLoader(synced.cache.dir) as plain:
        assert plain.num_workers == 0
    with EpochCachedLoader(synced.cache.dir, batch_size=64, transform=double) as workers:
        assert workers.num_workers == 2
        assert sorted(_epoch_ids(workers)) == [2 * i for i in range(ROWS)]
    with EpochCachedLoader(synced.cache.dir, batch_size=64, transform=double, num_workers=0) as threaded:
        assert threaded.num_workers == 0
        assert sorted(_epoch_ids(threaded)) == [2 * i for i in range(ROWS)]


def test_sample_transform_sees_one_sample_and_results_are_collated(synced: Config) -> None:
    def label(sample: dict) -> dict:
        assert sample["image"].shape == (3, 16, 16)
        return {"id": sample["id"], "mean": sample["image"].float().mean()}

    with EpochCachedLoader(synced.cache.dir, batch_size=64, sample_transform=label) as loader:
        batches = list(loader)
    assert all(set(b) == {"id", "mean"} and b["mean"].shape == b["id"].shape for b in batches)
    assert all(torch.equal(b["mean"], (b["id"] % 251).float()) for b in batches)


def test_device_cpu_and_pin_memory_without_cuda_leave_batches_on_the_cpu(synced: Config) -> None:
    with EpochCachedLoader(synced.cache.dir, batch_size=64, device="cpu", pin_memory=True) as loader:
        batches = list(loader)
    assert all(b["image"].device.type == "cpu" for b in batches)
    assert sorted(int(i) for b in batches for i in b["id"]) == list(range(ROWS))


def test_bad_device_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="device"):
        EpochCachedLoader(tmp_path, device="gpu0")


def test_min_samples_without_a_daemon_fails_with_a_clear_message(tmp_path: Path) -> None:
    CacheLayout.create(tmp_path / "c")
    with EpochCachedLoader(tmp_path / "c", min_samples=10, wait_timeout_s=0.3, progress=False) as loader:
        with pytest.raises(CacheEmptyError, match="fewer than loader.min_samples=10, and no sync daemon runs"):
            next(iter(loader))


@pytest.mark.slow  # (1.3 s: a daemon filling the cache)
def test_min_samples_waits_for_a_running_daemon(remote: str, make_config: Callable[..., Config]) -> None:
    config = make_config(remote, **{"cache.max_bytes": "20MB", "cache.shard_bytes": "64KiB",
                                    "sampler.max_bytes_per_s": 400_000, "sampler.concurrency": 1})
    daemon = DaemonThread(SyncDaemon(config, progress=False))
    layout = CacheLayout(Path(config.cache.dir))
    try:
        wait_for(lambda: daemon_running(layout), timeout=30)
        with EpochCachedLoader(config.cache.dir, batch_size=64, min_samples=300, progress=False) as loader:
            next(iter(loader))
            assert loader.last_epoch.samples >= 300
        with EpochCachedLoader(config.cache.dir, min_samples=10**6, wait_timeout_s=0.3, progress=False) as loader:
            with pytest.raises(CacheEmptyError, match="its sync daemon is running"):
                next(iter(loader))
    finally:
        daemon.stop()
    assert not daemon_running(layout)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned memory, side streams)")


def _intact(batch: dict[str, torch.Tensor]) -> bool:
    """Every pixel of every image is its row's ``id % 251`` (how the remote was written)."""
    expected = (batch["id"] % 251).to(torch.uint8)
    return bool((batch["image"] == expected.view(-1, *[1] * (batch["image"].dim() - 1))).all())


@needs_cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_cuda_device_batches_arrive_on_the_gpu_intact(synced: Config, workers: int) -> None:
    with EpochCachedLoader(synced.cache.dir, batch_size=50, device="cuda", pin_memory=True,
                           num_workers=workers) as loader:
        epochs = [list(loader) for _ in range(2)]
    for batches in epochs:
        assert all(b["image"].is_cuda and b["id"].is_cuda for b in batches)
        assert sorted(int(i) for b in batches for i in b["id"].cpu()) == list(range(ROWS))
        assert all(_intact(b) for b in batches)


@needs_cuda
@pytest.mark.parametrize("workers", [0, 2])
def test_pinned_batches_are_copied_into_page_locked_memory_without_torchs_pin_memory(
    synced: Config, workers: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(tensor: torch.Tensor) -> torch.Tensor:
        raise AssertionError("torch's pin_memory() copies on every intra-op thread: not for these columns")

    monkeypatch.setattr(torch.Tensor, "pin_memory", refused)
    # (batches of 50: the epoch's last batch is short)
    with EpochCachedLoader(synced.cache.dir, batch_size=50, pin_memory=True, num_workers=workers) as loader:
        batches = [batch for _ in range(2) for batch in loader]
    assert all(b["image"].is_pinned() and b["id"].is_pinned() for b in batches)
    assert sorted(int(i) for b in batches for i in b["id"]) == sorted(list(range(ROWS)) * 2)
    assert all(_intact(b) for b in batches)


def test_a_shuffled_batch_draws_from_many_shards(synced: Config) -> None:
    layout = CacheLayout(Path(synced.cache.dir))
    ledger = Ledger(layout.ledger)
    shard_of = {
        int(i): record.id
        for record in ledger.shards()
        for i in open_shard(layout.shards / record.filename)["id"].to_numpy()
    }
    ledger.close()
    with EpochCachedLoader(synced.cache.dir, batch_size=64) as loader:
        first = next(iter(loader))
    touched = {shard_of[int(i)] for i in first["id"]}
    assert len(set(shard_of.values())) > 2 and len(touched) > 2


def test_an_error_while_building_a_batch_reaches_the_training_loop(synced: Config) -> None:
    def broken(batch: dict) -> dict:
        raise ValueError("bad sample")

    with EpochCachedLoader(synced.cache.dir, batch_size=64, transform=broken, num_workers=0) as loader:
        with pytest.raises(ValueError, match="bad sample"):
            next(iter(loader))


def test_batch_threads_are_reused_across_epochs(synced: Config) -> None:
    """A thread that ends stalls the consumer at the epoch boundary, so epochs share two threads."""
    before = set(threading.enumerate())  # (another test's loader left unclosed keeps its threads)
    with EpochCachedLoader(synced.cache.dir, batch_size=64, num_workers=0) as loader:
        seen: set[threading.Thread] = set()  # the objects themselves: an ended thread's ident is reused
        for _ in range(5):
            for _batch in loader:
                seen |= {t for t in threading.enumerate() if t.name.startswith("epochcache-batches")} - before
        assert 1 <= len(seen) <= 2


def test_an_abandoned_loader_collected_mid_epoch_never_hangs_the_collection(synced: Config) -> None:
    """A loader left unclosed after its first batch, then garbage: the collector finalizes its epoch
    (which hands the epoch's record to the cleanup thread and waits for it) while it clears the
    loader's thread pools. The finalizing must end: the pool that records runs its task, not a
    thread that the pool's collection told to exit (the next test's gc.collect() hung for good)."""
    import gc

    def abandon() -> None:
        loader = EpochCachedLoader(synced.cache.dir, batch_size=32)
        for _ in loader:  # a whole epoch: the cleanup thread is running
            pass
        epoch = iter(loader)
        next(epoch)
        cycle: dict[str, object] = {"loader": loader, "epoch": epoch}  # (as a failed test's traceback holds them)
        cycle["cycle"] = cycle

    abandon()
    collected = threading.Thread(target=gc.collect, daemon=True)
    collected.start()
    collected.join(timeout=30)
    assert not collected.is_alive(), "gc.collect() hung finalizing the abandoned loader's epoch"

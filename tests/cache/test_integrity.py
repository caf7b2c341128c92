"""Corrupt shards are quarantined and the epoch goes on; a full disk publishes nothing and is waited out."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import fsspec
import pyarrow as pa
import pytest
import torch
from conftest import DaemonThread, UnitLog, make_table, wait_for, write_parquet_dataset

import epochcache.cache.shards as shards
from epochcache import EpochCachedLoader, Ledger, SyncDaemon
from epochcache.cache.layout import TMP_SUFFIX, CacheLayout
from epochcache.cache.ledger import ShardRecord
from epochcache.cache.repair import check
from epochcache.config import Config
from epochcache.errors import CacheEmptyError, LoaderError
from epochcache.train import waiting

FILES, GROUPS, ROWS_PER_GROUP = 4, 4, 128  # 2048 samples of ~800 bytes


@pytest.fixture
def remote(tmp_path: Path) -> str:
    root = str(tmp_path / "remote")
    write_parquet_dataset(fsspec.filesystem("file"), root, FILES, GROUPS * ROWS_PER_GROUP, ROWS_PER_GROUP)
    return root


def _ids(batches: list[dict]) -> list[int]:
    return sorted(int(i) for batch in batches for i in batch["id"])


def test_corrupt_shards_are_quarantined_and_the_epoch_completes(
    remote: str, make_config: Callable[..., Config]
) -> None:
    config = make_config(remote, **{"cache.max_bytes": "20MB", "cache.shard_bytes": "200KB"})
    SyncDaemon(config, progress=False).run(once=True)
    layout = CacheLayout(Path(config.cache.dir))
    ledger = Ledger(layout.ledger)
    records = ledger.shards()
    assert len(records) >= 5 and all(r.verified for r in records), "the publisher checksummed what it wrote"
    flipped, truncated, garbled = records[1], records[2], records[3]
    data = bytearray((layout.shards / flipped.filename).read_bytes())
    data[len(data) // 3] ^= 0x10
    (layout.shards / flipped.filename).write_bytes(bytes(data))
    ledger.adopt([replace(flipped, verified=False)])  # e.g. adopted after a crash: not checked on this host
    path = layout.shards / truncated.filename
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    path = layout.shards / garbled.filename
    path.write_bytes(path.read_bytes()[:-64] + b"\0" * 64)  # same size, its footer gone: no longer Arrow

    with EpochCachedLoader(config.cache.dir, batch_size=100, shuffle=False, wait_timeout_s=10) as loader:
        first = list(loader)
        info = loader.last_epoch
        # the unverified shard is checksummed after the first batch, off the batch path, and quarantined
        wait_for(lambda: flipped.id in {q.record.id for q in ledger.quarantine.entries()}, timeout=10)
        second = _ids(list(loader))
        assert loader.last_epoch is not None and loader.last_epoch.skipped_shards == 0

    assert info is not None and info.skipped_shards == 1 and info.shards == len(records) - 1  # the truncated one
    # the flipped shard's rows are in it unless the verifier quarantined it before the epoch mapped it
    readable = FILES * GROUPS * ROWS_PER_GROUP - truncated.rows - garbled.rows
    assert sum(len(b["id"]) for b in first) in (readable, readable - flipped.rows)
    bad_rows = flipped.rows + truncated.rows + garbled.rows
    assert len(second) == FILES * GROUPS * ROWS_PER_GROUP - bad_rows == len(set(second))
    assert {q.record.id for q in ledger.quarantine.entries()} == {flipped.id, truncated.id, garbled.id}
    assert sorted(p.name for p in layout.quarantine.iterdir()) == sorted(
        [flipped.filename, truncated.filename, garbled.filename]
    )
    assert ledger.counters.all()["quarantined"] == 3
    assert ledger.usage().quarantined_bytes == flipped.nbytes + truncated.nbytes + garbled.nbytes  # in the budget
    assert check(layout, ledger, checksums=True).problems == 0
    ledger.close()


def test_shards_are_checksummed_after_the_first_batch_once_per_host(
    remote: str, make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(remote, **{"cache.max_bytes": "20MB", "cache.shard_bytes": "200KB"})
    SyncDaemon(config, progress=False).run(once=True)
    ledger = Ledger(CacheLayout(Path(config.cache.dir)).ledger)
    records = ledger.shards()
    ledger.adopt([replace(r, verified=False) for r in records])  # as if written by an older version
    first_batch_out = threading.Event()
    checked: list[tuple[str, bool]] = []  # (file, whether the first batch was out when it was checked)
    real_verify = shards.verify_shard

    def recording_verify(path: Path, checksum: str) -> None:
        # Waits (bounded) for the test to see the first batch: a check made before that batch would
        # find the event unset after the wait and be recorded as too early.
        checked.append((path.name, first_batch_out.wait(timeout=5)))
        real_verify(path, checksum)

    monkeypatch.setattr("epochcache.cache.verifier.verify_shard", recording_verify)
    with EpochCachedLoader(config.cache.dir, batch_size=100, wait_timeout_s=10) as loader:
        batches = iter(loader)
        next(batches)
        first_batch_out.set()
        next(batches)  # the trainer is back from the first batch: the shards are queued for checking
        wait_for(lambda: all(r.verified for r in ledger.shards()), timeout=10)
        list(batches)
        list(loader)  # a second epoch checks nothing again
    assert sorted(name for name, _ in checked) == sorted(r.filename for r in records)
    assert all(after for _, after in checked), "no checksum before the first batch"
    with EpochCachedLoader(config.cache.dir, batch_size=100, wait_timeout_s=10) as loader:
        list(loader)
    assert len(checked) == len(records), "verified once per host: a later loader checks nothing"
    ledger.close()


@pytest.mark.slow  # (1.5 s of back-off)
def test_disk_full_publishes_nothing_backs_off_and_resumes(
    remote: str, make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(remote, **{"cache.max_bytes": "20MB", "cache.shard_bytes": "200KB"})
    layout = CacheLayout.create(config.cache.dir)
    ledger = Ledger(layout.ledger)
    disk_full = threading.Event()
    disk_full.set()
    failures: list[Path] = []
    leftovers: list[bool] = []  # per failed attempt: whether a temp file of an attempt before it was still there
    real_write = shards._write_file

    def write_or_fail(path: Path, table: pa.Table) -> None:
        if disk_full.is_set():
            leftovers.append(any(p.exists() for p in failures))
            path.write_bytes(b"ARROW1\x00\x00" + b"\x00" * 8192)  # some bytes reach the temp file first
            failures.append(path)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, table)

    monkeypatch.setattr(shards, "_write_file", write_or_fail)
    units = UnitLog()
    daemon = DaemonThread(units.daemon(config))
    state = wait_for(lambda: (s := ledger.daemon.status()) and s["state"] == "disk full, backing off" and s)
    assert "No space left" in state["error"]
    wait_for(lambda: len(failures) >= 2, timeout=10)  # it retried after backing off
    assert ledger.shards() == [] and ledger.counters.all().get("published", 0) == 0
    assert ledger.usage().reserved_bytes == 0
    # each failed temp file removed before the next attempt (checked there: the attempt in flight now
    # may hold its own, under the same name, as the retry writes the same shard)
    assert leftovers[:2] == [False, False]

    disk_full.clear()
    wait_for(lambda: len(ledger.shards()) >= 3, timeout=30)
    wait_for(lambda: ledger.daemon.status()["state"] == "running", timeout=10)
    daemon.stop()
    assert check(layout, ledger, checksums=True).problems == 0
    assert not list(layout.shards.glob("*" + TMP_SUFFIX))
    published = [u for r in ledger.shards() for u in r.units]
    assert len(published) == len(set(published)) == len(units.published)
    ledger.close()


# -- one schema per epoch (issue 9, item 1) ----------------------------------------------------------


def _publish(layout: CacheLayout, ledger: Ledger, shard_id: str, table: pa.Table, known_schema: bool) -> None:
    """Write ``table`` as a published shard of ``layout``; its record carries the schema fingerprint
    when ``known_schema`` (as the publisher records it), else "" (a cache from before fingerprints)."""
    table = table.combine_chunks()
    checksum = shards.write_shard(table, layout.tmp_path(shard_id), lambda c: layout.shard_path(shard_id, c))
    path = layout.shard_path(shard_id, checksum)
    ledger.adopt([ShardRecord(
        id=shard_id, filename=path.name, nbytes=path.stat().st_size, rows=table.num_rows, created=0.0,
        checksum=checksum, units=(shard_id,), schema=shards.schema_fingerprint(table.schema) if known_schema else "",
        verified=True,
    )])


def _mixed_cache(tmp_path: Path, later: pa.Table, known_schema: bool) -> Path:
    """A cache of two shards of ``make_table`` rows followed by one shard of ``later``."""
    layout = CacheLayout.create(tmp_path / "cache")
    ledger = Ledger(layout.ledger)
    _publish(layout, ledger, "a0", make_table(50, 0), known_schema)
    _publish(layout, ledger, "a1", make_table(50, 50), known_schema)
    _publish(layout, ledger, "b0", later, known_schema)
    ledger.close()
    return layout.root


def test_a_cache_refilled_with_fewer_columns_is_refused_not_invented(tmp_path: Path) -> None:
    # issue 9 item 1: filled with [image, id], synced on with [image]: batches drew "id" from no shard
    root = _mixed_cache(tmp_path, make_table(50, 100).select(["image"]), known_schema=True)
    with EpochCachedLoader(root, batch_size=40, shuffle=False, wait_timeout_s=5) as loader:
        with pytest.raises(LoaderError, match=r"2 schemas.*id: int64.*epochcache clear") as caught:
            next(iter(loader))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("later", [
    make_table(50, 100).select(["image"]),  # a column missing
    make_table(50, 100).set_column(1, "id", pa.array([str(i) for i in range(100, 150)])),  # another type
], ids=["fewer-columns", "other-type"])
def test_shards_of_unknown_schema_that_differ_give_a_loader_error(tmp_path: Path, later: pa.Table) -> None:
    # Records without fingerprints (older caches): the dataset checks each shard as it maps it.
    root = _mixed_cache(tmp_path, later, known_schema=False)
    seen: list[int] = []
    with EpochCachedLoader(root, batch_size=40, shuffle=False, wait_timeout_s=5) as loader:
        with pytest.raises(LoaderError, match=r"two schemas.*epochcache clear"):
            for batch in loader:
                seen.extend(batch["id"].tolist())
    assert seen == list(range(len(seen))) and len(seen) < 150, "only values read from shards, never invented"


def test_one_schema_gathers_every_column_from_every_shard(tmp_path: Path) -> None:
    root = _mixed_cache(tmp_path, make_table(50, 100), known_schema=True)
    with EpochCachedLoader(root, batch_size=64, shuffle=True, wait_timeout_s=5) as loader:
        batches = list(loader)
    ids = torch.cat([b["id"] for b in batches])
    assert sorted(ids.tolist()) == list(range(150))
    pixels = torch.cat([b["image"] for b in batches])[:, 0, 0, 0]
    assert torch.equal(pixels, (ids % 251).to(torch.uint8))


def test_zero_row_shards_alone_are_an_empty_cache_not_an_empty_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # issue 9 item 7: 0-row shards made an epoch of 0 batches, silently
    monkeypatch.setattr(waiting, "NO_DAEMON_GRACE_S", 0.2)
    layout = CacheLayout.create(tmp_path / "cache")
    ledger = Ledger(layout.ledger)
    _publish(layout, ledger, "empty", make_table(1, 0).slice(0, 0), known_schema=True)
    ledger.close()
    with EpochCachedLoader(layout.root, wait_timeout_s=600) as loader:
        with pytest.raises(CacheEmptyError, match="no sync daemon runs"):
            next(iter(loader))

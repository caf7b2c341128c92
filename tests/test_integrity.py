"""Corrupt shards are quarantined and the epoch goes on; a full disk publishes nothing and is waited out."""

from __future__ import annotations

import errno
import threading
from collections.abc import Callable
from pathlib import Path

import fsspec
import pyarrow as pa
import pytest

import epochcache.shards as shards
from conftest import DaemonThread, UnitLog, wait_for, write_parquet_dataset
from epochcache import EpochCachedLoader, Ledger, SyncDaemon
from epochcache.config import Config
from epochcache.layout import TMP_SUFFIX, CacheLayout
from epochcache.repair import check

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
    assert len(records) >= 4
    flipped, truncated = records[1], records[2]
    data = bytearray((layout.shards / flipped.filename).read_bytes())
    data[len(data) // 3] ^= 0x10
    (layout.shards / flipped.filename).write_bytes(bytes(data))
    path = layout.shards / truncated.filename
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    with EpochCachedLoader(config.cache.dir, batch_size=100, shuffle=False, wait_timeout_s=10) as loader:
        first = _ids(list(loader))
        info = loader.last_epoch
        second = _ids(list(loader))
        assert loader.last_epoch is not None and loader.last_epoch.skipped_shards == 0

    bad_rows = flipped.rows + truncated.rows
    assert info is not None and info.skipped_shards == 2 and info.shards == len(records) - 2
    assert len(first) == FILES * GROUPS * ROWS_PER_GROUP - bad_rows == len(set(first))
    assert second == first  # the next epoch's snapshot no longer holds them
    assert {q.record.id for q in ledger.quarantined()} == {flipped.id, truncated.id}
    assert sorted(p.name for p in layout.quarantine.iterdir()) == sorted([flipped.filename, truncated.filename])
    assert ledger.counters()["quarantined"] == 2
    assert ledger.usage().quarantined_bytes == flipped.nbytes + truncated.nbytes  # still inside the budget
    assert check(layout, ledger, checksums=True).problems == 0
    ledger.close()


def test_disk_full_publishes_nothing_backs_off_and_resumes(
    remote: str, make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = make_config(remote, **{"cache.max_bytes": "20MB", "cache.shard_bytes": "200KB"})
    layout = CacheLayout.create(config.cache.dir)
    ledger = Ledger(layout.ledger)
    disk_full = threading.Event()
    disk_full.set()
    failures: list[Path] = []
    real_write = shards._write_file

    def write_or_fail(path: Path, table: pa.Table) -> None:
        if disk_full.is_set():
            path.write_bytes(b"ARROW1\x00\x00" + b"\x00" * 8192)  # some bytes reach the temp file first
            failures.append(path)
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(path, table)

    monkeypatch.setattr(shards, "_write_file", write_or_fail)
    units = UnitLog()
    daemon = DaemonThread(units.daemon(config))
    state = wait_for(lambda: (s := ledger.daemon_state()) and s["state"] == "disk full, backing off" and s)
    assert "No space left" in state["error"]
    wait_for(lambda: len(failures) >= 2, timeout=10)  # it retried after backing off
    assert ledger.shards() == [] and ledger.counters().get("published", 0) == 0
    assert ledger.usage().reserved_bytes == 0
    assert all(not p.exists() for p in failures[:-1])  # each failed temp file removed

    disk_full.clear()
    wait_for(lambda: len(ledger.shards()) >= 3, timeout=30)
    wait_for(lambda: ledger.daemon_state()["state"] == "running", timeout=10)
    daemon.stop()
    assert check(layout, ledger, checksums=True).problems == 0
    assert not list(layout.shards.glob("*" + TMP_SUFFIX))
    published = [u for r in ledger.shards() for u in r.units]
    assert len(published) == len(set(published)) == len(units.published)
    ledger.close()

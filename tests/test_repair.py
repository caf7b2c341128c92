"""Tests for epochcache.repair.reconcile: disk and ledger made to agree after a crash."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import make_table

from epochcache.evict import Fifo
from epochcache.layout import CacheLayout
from epochcache.ledger import Ledger, ShardRecord
from epochcache.repair import Repairs, reconcile
from epochcache.shards import open_shard, write_shard


@pytest.fixture
def layout(tmp_path_factory: pytest.TempPathFactory) -> CacheLayout:
    return CacheLayout.create(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def ledger(layout: CacheLayout) -> Iterator[Ledger]:
    led = Ledger(layout.ledger)
    yield led
    led.close()


def publish_shard(layout: CacheLayout, ledger: Ledger, shard_id: str, created: float) -> ShardRecord:
    """Write a real shard file and publish its record, as the daemon does."""
    table = make_table(10, start=int(created) * 10)
    path = layout.shard_path(shard_id)
    checksum = write_shard(table, layout.tmp_path(shard_id), path)
    record = ShardRecord(
        id=shard_id,
        filename=path.name,
        nbytes=path.stat().st_size,
        rows=table.num_rows,
        created=created,
        checksum=checksum,
        units=(f"obj.parquet#{int(created)}",),
    )
    ledger.publish(record)
    return record


def test_layout_paths(layout: CacheLayout) -> None:
    assert layout.shards.is_dir() and layout.ledger.is_dir()
    assert layout.shard_path("abc").name == "abc.arrow"
    assert layout.tmp_path("abc").name == "abc.arrow.tmp"
    assert layout.shard_path("abc").parent == layout.shards
    assert layout.lock.parent == layout.root


def test_clean_cache_needs_no_repair(layout: CacheLayout, ledger: Ledger) -> None:
    records = [publish_shard(layout, ledger, f"s{i}", float(i)) for i in range(3)]
    assert reconcile(layout, ledger) == Repairs(temp_files=0, unknown_files=0, missing_records=0)
    assert ledger.shards() == records
    assert sorted(p.name for p in layout.shards.iterdir()) == ["s0.arrow", "s1.arrow", "s2.arrow"]


def test_reconcile_repairs_everything(layout: CacheLayout, ledger: Ledger) -> None:
    keep = publish_shard(layout, ledger, "keep", 1.0)
    gone = publish_shard(layout, ledger, "gone", 2.0)
    layout.shard_path(gone.id).unlink()  # record whose file vanished
    layout.tmp_path("half").write_bytes(b"ARROW1 half written")  # crash while writing
    layout.tmp_path("half2").write_bytes(b"")
    layout.shard_path("orphan").write_bytes(b"evicted record, file never deleted")
    unrelated = layout.shards / "README"
    unrelated.write_text("not a shard")

    # A reservation for the shard being written and a retiring shard, as a crash would leave them.
    lease = ledger.snapshot("trainer", ttl_s=60)
    budget = ledger.usage().total + 1
    assert ledger.make_room(10**9, budget, Fifo()) is None
    ledger.release(lease.id)
    assert ledger.make_room(1, budget=10**12, choose=Fifo()) == []
    assert ledger.usage().reserved_bytes == 1
    retiring_before = ledger.snapshot("probe", ttl_s=60)
    ledger.release(retiring_before.id)
    assert len(retiring_before.shards) < len(ledger.shards())

    repairs = reconcile(layout, ledger)

    assert repairs == Repairs(temp_files=2, unknown_files=1, missing_records=1)
    assert sorted(p.name for p in layout.shards.iterdir()) == ["README", "keep.arrow"]
    assert ledger.shards() == [keep]
    assert ledger.usage().reserved_bytes == 0
    # Nothing is retiring any more: a snapshot holds every published shard.
    snap = ledger.snapshot("after", ttl_s=60)
    assert [r.id for r in snap.shards] == ["keep"]
    assert open_shard(layout.shard_path("keep")).num_rows == 10

    # A second run finds nothing left to do.
    assert reconcile(layout, ledger) == Repairs(0, 0, 0)


def test_reconcile_empty_cache(layout: CacheLayout, ledger: Ledger) -> None:
    assert reconcile(layout, ledger) == Repairs(0, 0, 0)
    assert list(layout.shards.iterdir()) == []


def test_reconcile_logs_only_when_repairing(
    layout: CacheLayout, ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="epochcache.repair"):
        reconcile(layout, ledger)
        assert caplog.records == []
        layout.tmp_path("x").write_bytes(b"")
        reconcile(layout, ledger)
    assert len(caplog.records) == 1
    assert "temp_files=1" in caplog.records[0].getMessage()

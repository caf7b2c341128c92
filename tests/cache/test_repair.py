"""Tests for epochcache.cache.repair: disk and ledger made to agree after a crash; checks and adoption."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from functools import partial

import pytest
from conftest import make_table, wait_for

from epochcache.cache.evict import Fifo
from epochcache.cache.layout import CacheLayout, parse_shard_name
from epochcache.cache.ledger import Ledger, ShardRecord
from epochcache.cache.quarantine import quarantine_shard
from epochcache.cache.repair import Repairs, check, reconcile
from epochcache.cache.shards import ShardMeta, open_shard, schema_fingerprint, with_record_meta, write_shard
from epochcache.cache.verifier import BackgroundVerifier


@pytest.fixture
def layout(tmp_path_factory: pytest.TempPathFactory) -> CacheLayout:
    return CacheLayout.create(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def ledger(layout: CacheLayout) -> Iterator[Ledger]:
    led = Ledger(layout.ledger)
    yield led
    led.close()


def write_record(layout: CacheLayout, shard_id: str, created: float) -> ShardRecord:
    """Write a real shard file, with its record metadata, as the publisher does; return its record."""
    units = (f"obj.parquet#{int(created)}",)
    table = with_record_meta(make_table(10, start=int(created) * 10), ShardMeta(shard_id, created, units))
    checksum = write_shard(table, layout.tmp_path(shard_id), partial(layout.shard_path, shard_id))
    path = layout.shard_path(shard_id, checksum)
    return ShardRecord(id=shard_id, filename=path.name, nbytes=path.stat().st_size, rows=table.num_rows,
                       created=created, checksum=checksum, units=units, schema=schema_fingerprint(table.schema),
                       verified=True)


def publish_shard(layout: CacheLayout, ledger: Ledger, shard_id: str, created: float) -> ShardRecord:
    record = write_record(layout, shard_id, created)
    ledger.publish(record)
    return record


def test_layout_paths(layout: CacheLayout) -> None:
    assert layout.shards.is_dir() and layout.ledger.is_dir() and layout.quarantine.is_dir()
    checksum = "0123456789abcdef" * 2
    assert layout.shard_path("abc-1", checksum).name == f"abc-1.{checksum}.arrow"
    assert parse_shard_name(f"abc-1.{checksum}.arrow") == ("abc-1", checksum)
    assert parse_shard_name("abc.arrow") is None
    assert parse_shard_name(f"abc-1.{checksum}.arrow.tmp") is None
    assert layout.tmp_path("abc").name == "abc.arrow.tmp"
    assert layout.shard_file(f"abc-1.{checksum}.arrow") == str(layout.shard_path("abc-1", checksum))
    assert layout.shards is layout.shards  # built once per layout
    assert layout.lock.parent == layout.root


def test_clean_cache_needs_no_repair(layout: CacheLayout, ledger: Ledger) -> None:
    records = [publish_shard(layout, ledger, f"s{i}", float(i)) for i in range(3)]
    assert reconcile(layout, ledger) == Repairs()
    assert check(layout, ledger, checksums=True).problems == 0
    assert ledger.shards() == records
    assert sorted(p.name for p in layout.shards.iterdir()) == sorted(r.filename for r in records)


def test_reconcile_repairs_everything(layout: CacheLayout, ledger: Ledger) -> None:
    keep = publish_shard(layout, ledger, "keep", 1.0)
    gone = publish_shard(layout, ledger, "gone", 2.0)
    (layout.shards / gone.filename).unlink()  # record whose file vanished
    layout.tmp_path("half").write_bytes(b"ARROW1 half written")  # crash while writing
    layout.tmp_path("half2").write_bytes(b"")
    (layout.shards / "orphan.arrow").write_bytes(b"evicted record, file never deleted")
    unrelated = layout.shards / "README"
    unrelated.write_text("not a shard")

    # A reservation for the shard being written and a retiring shard, as a crash would leave them.
    lease = ledger.leases.snapshot("trainer", ttl_s=60)
    budget = ledger.usage().total + 1
    assert ledger.make_room(10**9, budget, Fifo()) is None
    ledger.leases.release(lease.id)
    assert ledger.make_room(1, budget=10**12, choose=Fifo()) == []
    assert ledger.usage().reserved_bytes == 1
    retiring_before = ledger.leases.snapshot("probe", ttl_s=60)
    ledger.leases.release(retiring_before.id)
    assert len(retiring_before.shards) < len(ledger.shards())

    assert check(layout, ledger) == Repairs(temp_files=2, unknown_files=1, missing_records=1)  # read-only
    assert len(list(layout.shards.iterdir())) == 5
    repairs = reconcile(layout, ledger)

    assert repairs == Repairs(temp_files=2, unknown_files=1, missing_records=1)
    assert sorted(p.name for p in layout.shards.iterdir()) == sorted(["README", keep.filename])
    assert [r.id for r in ledger.shards()] == ["keep"]
    assert ledger.usage().reserved_bytes == 0
    # Nothing is retiring any more: a snapshot holds every published shard.
    snap = ledger.leases.snapshot("after", ttl_s=60)
    assert [r.id for r in snap.shards] == ["keep"]
    assert open_shard(layout.shards / keep.filename).num_rows == 10

    # A second run finds nothing left to do.
    assert reconcile(layout, ledger) == Repairs()


def test_whole_unknown_shard_is_adopted(layout: CacheLayout, ledger: Ledger) -> None:
    # The daemon died between the rename and the ledger's publish: the file is whole, unrecorded.
    publish_shard(layout, ledger, "known", 1.0)
    orphan = write_record(layout, "orphan", 2.0)
    assert check(layout, ledger) == Repairs(adopted=1)
    assert reconcile(layout, ledger) == Repairs(adopted=1)
    (adopted,) = [r for r in ledger.shards() if r.id == "orphan"]
    assert adopted == orphan  # id, file, size, rows, created, checksum and units all recovered
    assert ledger.counters.all()["adopted"] == 1
    assert reconcile(layout, ledger) == Repairs()


def test_damaged_or_duplicate_unknown_shard_is_removed(layout: CacheLayout, ledger: Ledger) -> None:
    flipped = write_record(layout, "flipped", 1.0)
    data = bytearray((layout.shards / flipped.filename).read_bytes())
    data[len(data) // 2] ^= 0x01
    (layout.shards / flipped.filename).write_bytes(bytes(data))
    publish_shard(layout, ledger, "holder", 2.0)
    # Same units as "holder" (an evicted shard whose file outlived its record): never two copies.
    twin = write_record(layout, "twin", 2.0)
    assert reconcile(layout, ledger) == Repairs(unknown_files=2)
    assert not (layout.shards / flipped.filename).exists()
    assert not (layout.shards / twin.filename).exists()
    assert [r.id for r in ledger.shards()] == ["holder"]


def test_checksums_find_and_quarantine_corrupt_shard(layout: CacheLayout, ledger: Ledger) -> None:
    good = publish_shard(layout, ledger, "good", 1.0)
    bad = publish_shard(layout, ledger, "bad", 2.0)
    path = layout.shards / bad.filename
    path.write_bytes(path.read_bytes()[:-100])  # truncated
    assert check(layout, ledger) == Repairs()  # without checksums a truncated file goes unseen
    assert check(layout, ledger, checksums=True) == Repairs(corrupt=1)
    assert reconcile(layout, ledger, checksums=True) == Repairs(corrupt=1)
    assert [r.id for r in ledger.shards()] == [good.id]
    assert (layout.quarantine / bad.filename).exists() and not path.exists()
    (entry,) = ledger.quarantine.entries()
    assert entry.record.id == "bad" and "checksum" in entry.reason
    # The quarantined bytes are still charged to the budget.
    assert ledger.usage().quarantined_bytes == bad.nbytes
    assert check(layout, ledger, checksums=True) == Repairs()


def test_a_second_quarantiner_leaves_the_record_to_the_first(layout: CacheLayout, ledger: Ledger) -> None:
    """An epoch and the background verifier can find the same bad shard: the one that finds the file
    already moved must not drop the record the other is about to quarantine (its bytes stay charged)."""
    bad = publish_shard(layout, ledger, "bad", 1.0)
    (layout.shards / bad.filename).replace(layout.quarantine / bad.filename)  # the first one's rename
    assert not quarantine_shard(layout, ledger, bad, "second")
    assert [r.id for r in ledger.shards()] == ["bad"]  # still there for the first one to move
    assert ledger.quarantine.add(bad.id, "first") is not None  # the first one's record move
    assert [q.record.id for q in ledger.quarantine.entries()] == ["bad"]
    assert ledger.usage().quarantined_bytes == bad.nbytes
    assert check(layout, ledger) == Repairs()


def test_quarantine_debris_is_repaired(layout: CacheLayout, ledger: Ledger) -> None:
    a = publish_shard(layout, ledger, "a", 1.0)
    b = publish_shard(layout, ledger, "b", 2.0)
    assert quarantine_shard(layout, ledger, a, "test")
    assert quarantine_shard(layout, ledger, b, "test")
    (layout.quarantine / a.filename).unlink()  # entry without its file
    (layout.quarantine / "stray.arrow").write_bytes(b"x" * 10)  # file without an entry: uncharged bytes
    assert reconcile(layout, ledger) == Repairs(quarantine_debris=2)
    assert [q.record.id for q in ledger.quarantine.entries()] == ["b"]
    assert sorted(p.name for p in layout.quarantine.iterdir()) == [b.filename]


@pytest.mark.slow  # (2 s)
def test_live_check_tolerates_the_shard_in_progress(layout: CacheLayout, ledger: Ledger) -> None:
    publish_shard(layout, ledger, "a", 1.0)
    layout.tmp_path("writing").write_bytes(b"partial")
    assert check(layout, ledger, live=True) == Repairs()
    assert check(layout, ledger, live=False) == Repairs(temp_files=1)
    layout.tmp_path("second").write_bytes(b"")  # a daemon writes one shard at a time
    assert check(layout, ledger, live=True) == Repairs(temp_files=1)


@pytest.mark.slow  # (1.5 s)
def test_live_check_waits_out_a_daemon_deleting_an_evicted_batch(layout: CacheLayout, ledger: Ledger) -> None:
    """Eviction drops a batch's records in one transaction, then deletes the files one by one, for longer
    than a moment on a large batch: a live check counts none of them while they keep going."""
    evicted = [publish_shard(layout, ledger, f"s{i}", float(i)) for i in range(25)]
    ledger.drop([r.id for r in evicted])  # (the records go first, as Ledger.make_room drops them)
    deleting = threading.Thread(target=lambda: [(time.sleep(0.05), layout.remove(r.filename)) for r in evicted])
    deleting.start()
    try:
        assert check(layout, ledger, live=True) == Repairs(), "files the daemon was still deleting counted"
    finally:
        deleting.join()
    assert list(layout.shards.iterdir()) == []


def test_reconcile_empty_cache(layout: CacheLayout, ledger: Ledger) -> None:
    assert reconcile(layout, ledger) == Repairs()
    assert list(layout.shards.iterdir()) == []


def test_reconcile_logs_only_when_repairing(
    layout: CacheLayout, ledger: Ledger, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("WARNING", logger="epochcache.cache.repair"):
        reconcile(layout, ledger)
        assert caplog.records == []
        layout.tmp_path("x").write_bytes(b"")
        reconcile(layout, ledger)
    assert len(caplog.records) == 1
    assert "temp_files=1" in caplog.records[0].getMessage()


def test_the_background_verifiers_quarantine_is_a_commit_the_loaders_ledger_sees(
    layout: CacheLayout, ledger: Ledger
) -> None:
    """The loader keeps an epoch prepared ahead only if its ledger's version (other connections'
    commits) did not change: the verifier, which the loader runs beside it, must write through a
    connection of its own, or its quarantines would go unseen."""
    good, bad = (dataclasses.replace(write_record(layout, name, created), verified=False)
                 for name, created in (("good", 1.0), ("bad", 2.0)))
    for record in (good, bad):
        ledger.publish(record)  # as the daemon of another host would: not checksummed on this one
    path = layout.shards / bad.filename
    path.write_bytes(path.read_bytes()[:-100])  # truncated
    before = ledger.db.version()
    verifier = BackgroundVerifier(layout)
    assert verifier.submit([good, bad]) == 2
    wait_for(lambda: [q.record.id for q in ledger.quarantine.entries()] == ["bad"], timeout=10)
    verifier.close()
    assert ledger.db.version() != before
    assert [r.id for r in ledger.shards()] == ["good"] and ledger.shard("good").verified


def test_pages_give_every_record_once_in_publishing_order(layout: CacheLayout, ledger: Ledger) -> None:
    records = [publish_shard(layout, ledger, f"s{i}", float(10 - i)) for i in range(5)]  # created: newest first
    pages = list(ledger.pages(size=2))
    assert [len(page) for page in pages] == [2, 2, 1]
    assert [r for page in pages for r in page] == records
    ledger.drop(["s0", "s3"])
    assert [r.id for page in ledger.pages(size=2) for r in page] == ["s1", "s2", "s4"]


def test_a_checksum_pass_shows_its_bytes_and_finds_a_missing_file(
    layout: CacheLayout, ledger: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    """verify hashes the cache a page of records at a time, a bar counting the bytes when asked."""
    records = [publish_shard(layout, ledger, f"s{i}", float(i)) for i in range(3)]
    (layout.shards / records[1].filename).unlink()
    assert check(layout, ledger, checksums=True, progress=True) == Repairs(missing_records=1)
    shown = capsys.readouterr().err
    assert "verifying checksums" in shown and "100%" in shown
    assert check(layout, ledger, checksums=True, fix=True) == Repairs(missing_records=1)
    assert capsys.readouterr().err == ""  # no bar unless asked
    assert [r.id for r in ledger.shards()] == ["s0", "s2"]


def test_a_lost_ledger_shows_the_reading_of_every_unknown_file(
    layout: CacheLayout, ledger: Ledger, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every file is unknown to an empty ledger, and each is read whole to see if it may be adopted:
    a bar counts them when asked; with no unknown file there is no bar at all."""
    for i in range(3):
        write_record(layout, f"s{i}", float(i))
    assert check(layout, ledger, progress=True) == Repairs(adopted=3)
    shown = capsys.readouterr().err
    assert "reading unknown shard files" in shown and "3/3" in shown
    reconcile(layout, ledger, progress=True)
    capsys.readouterr()
    assert check(layout, ledger, checksums=True, progress=True) == Repairs()
    assert "reading unknown" not in capsys.readouterr().err

"""The ledger heals and knows its leases' owners: damaged files, the diskcache ledger of earlier
versions, a full disk under the ledger, and leases of processes that die or stop."""

from __future__ import annotations

import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from conftest import FullDisk, make_table, wait_for

import epochcache.cache.ledger_schema as ledger_schema
from epochcache.cache.evict import Lru, MostUsed
from epochcache.cache.layout import CacheLayout
from epochcache.cache.lease_owner import Owner, start_time, this_host
from epochcache.cache.ledger import Ledger, ShardRecord, _choose
from epochcache.cache.ledger_schema import DB_NAME, LEGACY_DB_NAME, connect
from epochcache.cache.publisher import Publisher
from epochcache.cache.shards import ShardMeta, schema_fingerprint, with_record_meta, write_shard
from epochcache.config import CacheConfig
from epochcache.errors import CacheError, LedgerError, LedgerFullError
from epochcache.tools.maintenance import _whole_ledger


@pytest.fixture
def layout(tmp_path: Path) -> CacheLayout:
    return CacheLayout.create(tmp_path / "cache")


def write_shards(layout: CacheLayout, count: int) -> list[ShardRecord]:
    """Real shard files carrying their records, as the publisher writes them."""
    out = []
    for i in range(count):
        sid, units = f"{i:04x}-shard", (f"obj{i}.parquet#0",)
        table = with_record_meta(make_table(5, start=5 * i), ShardMeta(sid, float(i), units))
        checksum = write_shard(table, layout.tmp_path(sid), partial(layout.shard_path, sid))
        path = layout.shard_path(sid, checksum)
        out.append(ShardRecord(id=sid, filename=path.name, nbytes=path.stat().st_size, rows=5, created=float(i),
                               checksum=checksum, units=units, schema=schema_fingerprint(table.schema),
                               verified=True))
    return out


def test_garbage_ledger_is_one_line_and_rebuilt_whole(layout: CacheLayout) -> None:
    records = write_shards(layout, 4)
    (layout.ledger / DB_NAME).write_bytes(b"this is not a database" * 100)
    with pytest.raises(LedgerError, match="verify --fix") as raised:
        Ledger(layout.ledger)
    assert str(layout.ledger / DB_NAME) in str(raised.value) and "\n" not in str(raised.value)
    ledger = _whole_ledger(layout)
    assert ledger.shards() == records, "every whole shard is back, with its record"
    assert sorted(p.name for p in layout.ledger.iterdir() if not p.name.startswith(DB_NAME + "-")) == [DB_NAME]
    ledger.close()


def as_version_2(path: Path) -> None:
    """Turn a fresh ledger (no snapshot taken yet) into the layout version 2 wrote."""
    con = sqlite3.connect(path)
    con.executescript("DROP INDEX shards_fresh; DROP INDEX shards_wear; DROP TABLE generation; "
                      "ALTER TABLE shards DROP COLUMN born; DELETE FROM kv WHERE key = 'database'; "
                      "CREATE INDEX shards_recency ON shards(state, recency, created); "
                      "CREATE INDEX shards_uses ON shards(state, uses DESC, created); PRAGMA user_version=2;")
    con.close()


def test_a_version_1_ledger_is_upgraded_in_place(layout: CacheLayout) -> None:
    records = write_shards(layout, 2)
    ledger = Ledger(layout.ledger)
    ledger.adopt(records)
    ledger.close()
    as_version_2(layout.ledger / DB_NAME)
    con = sqlite3.connect(layout.ledger / DB_NAME)
    con.executescript("DROP TABLE trained_units; DROP TABLE epochs; DROP INDEX shards_untrained; "
                      "ALTER TABLE shards DROP COLUMN trained; PRAGMA user_version=1;")  # as version 1 wrote it
    con.close()
    ledger = Ledger(layout.ledger)
    assert ledger.shards() == records and ledger.leases.epochs() == []
    lease = ledger.leases.snapshot("t", ttl_s=60)
    ledger.leases.record_epoch(lease.id, 10)
    assert ledger.leases.epochs()[0]["distinct_trained"] == 10
    ledger.close()


def test_a_version_2_ledger_is_upgraded_in_place_without_losing_counts(layout: CacheLayout) -> None:
    """Version 2 kept each shard's absolute counts in its row (rewritten at every snapshot): they
    stay as they were, a retiring shard stays retiring, and the next snapshot adds one use to the
    live shards alone."""
    records = write_shards(layout, 4)
    ledger = Ledger(layout.ledger)
    ledger.adopt(records)
    lease = ledger.leases.snapshot("old-trainer", ttl_s=60)  # live across the upgrade (taken with no use counted yet)
    ledger.close()
    as_version_2(layout.ledger / DB_NAME)
    counts = {"0000-shard": (5, 100.0), "0001-shard": (2, 300.0), "0002-shard": (7, 200.0), "0003-shard": (0, None)}
    con = sqlite3.connect(layout.ledger / DB_NAME)
    con.executemany("UPDATE shards SET uses = ?, last_used = ?, recency = coalesce(?, created) WHERE id = ?",
                    [(uses, last, last, sid) for sid, (uses, last) in counts.items()])
    con.execute("UPDATE shards SET state = 1 WHERE id = '0002-shard'")  # retiring when version 2 stopped
    con.commit()
    con.close()
    ledger = Ledger(layout.ledger)
    assert {r.id: (r.uses, r.last_used) for r in ledger.shards()} == counts
    assert [lease_["id"] for lease_ in ledger.leases.live()] == [lease.id]
    assert [r.id for r in MostUsed()(ledger.shards(), 1)] == ["0002-shard"]
    con = ledger.db.connection()
    assert _choose(con, MostUsed(), 1) == ["0000-shard"], "the retiring one is not live"
    assert _choose(con, Lru(), 1) == ["0003-shard"], "never used: its creation counts"
    before = time.time()
    assert [r.id for r in ledger.leases.snapshot("new-trainer", ttl_s=60).shards] == ["0000-shard", "0001-shard",
                                                                                      "0003-shard"]
    after = {r.id: r for r in ledger.shards()}
    assert {sid: r.uses for sid, r in after.items()} == {"0000-shard": 6, "0001-shard": 3, "0002-shard": 7,
                                                         "0003-shard": 1}
    assert after["0002-shard"].last_used == 200.0 and before <= after["0001-shard"].last_used <= time.time()
    assert con.execute("PRAGMA user_version").fetchone()[0] == ledger_schema.VERSION == 3
    assert ledger.db.get("database"), "the upgrade names the database"
    indexes = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {"shards_fresh", "shards_wear"} <= indexes and not {"shards_recency", "shards_uses"} & indexes
    ledger.close()


def test_half_truncated_ledger_is_rebuilt(layout: CacheLayout) -> None:
    records = write_shards(layout, 3)
    ledger = Ledger(layout.ledger)
    ledger.adopt(records)
    ledger.adopt([ShardRecord(id=f"x{i}", filename=f"x{i}.arrow", nbytes=1, rows=1, created=9.0 + i,
                              checksum="0" * 32, units=(f"u{i}" * 20,)) for i in range(3000)])  # pages to cut
    ledger.close()
    path = layout.ledger / DB_NAME
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(LedgerError, match="verify --fix"):
        damaged = Ledger(layout.ledger)
        damaged.shards()
        assert damaged.db.intact()
    healed = _whole_ledger(layout)
    assert healed.shards() == records
    healed.close()


def test_diskcache_ledger_is_migrated_from_the_shard_files(
    layout: CacheLayout, caplog: pytest.LogCaptureFixture
) -> None:
    import diskcache

    records = write_shards(layout, 3)
    old = diskcache.Cache(str(layout.ledger))
    old.set("shard:whatever", {"id": "whatever"})
    old.close()
    with caplog.at_level(logging.WARNING, logger="epochcache.cache.ledger"):
        ledger = Ledger(layout.ledger)
    assert ledger.shards() == records
    assert [r.message for r in caplog.records if "migrated" in r.message] != []
    assert not (layout.ledger / LEGACY_DB_NAME).exists()
    ledger.close()


@pytest.fixture
def full_disk() -> FullDisk:
    return FullDisk()


@pytest.fixture
def full_disk_ledger(layout: CacheLayout, full_disk: FullDisk) -> Iterator[Ledger]:
    ledger = Ledger(layout.ledger, connect=full_disk.connect)
    yield ledger
    ledger.close()


def test_ledger_enospc_is_ledger_full_and_reads_go_on(
    layout: CacheLayout, full_disk: FullDisk, full_disk_ledger: Ledger
) -> None:
    (record,) = write_shards(layout, 1)
    full_disk_ledger.publish(record)
    full_disk.fail_next = 10**6
    with pytest.raises(LedgerFullError, match="disk is full"):
        full_disk_ledger.publish(write_shards(layout, 2)[1])
    assert full_disk_ledger.shards() == [record] and full_disk_ledger.usage().shards == 1
    reader = Ledger(layout.ledger, connect=connect)  # a trainer or status, on its own connection
    assert reader.shards() == [record]
    reader.close()


def test_publisher_backs_off_on_ledger_enospc(
    layout: CacheLayout, full_disk: FullDisk, full_disk_ledger: Ledger
) -> None:
    stop = threading.Event()
    cache = CacheConfig.model_validate({"dir": str(layout.root), "max_bytes": "10MB", "shard_bytes": "1MB"})
    publisher = Publisher(layout, full_disk_ledger, cache, stop)
    full_disk.fail_next = 1  # the reservation's transaction hits the full disk, then space is back
    published = publisher.publish(make_table(5), ["obj.parquet#0"], {"pass_": 0})
    assert published is not None and full_disk_ledger.shards() == [published.record]
    assert sorted(p.name for p in layout.shards.iterdir()) == [published.record.filename]
    assert full_disk_ledger.usage().reserved_bytes == 0


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_lease_of_a_killed_owner_ends_at_once(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger")
    proc = _sleeper()
    try:
        started = wait_for(lambda: start_time(proc.pid), timeout=10)
        lease = ledger.leases.snapshot("trainer", ttl_s=600, holder=Owner(this_host(), proc.pid, started))
        assert [x["id"] for x in ledger.leases.live()] == [lease.id]
        proc.kill()
        proc.wait(10)
        assert ledger.leases.live() == [], "no TTL wait for a dead owner on this host"
        assert ledger.leases.purge_expired() == 1
    finally:
        proc.kill()
        ledger.close()


def test_a_killed_owners_lease_is_deleted_when_room_is_next_made(tmp_path: Path) -> None:
    """A trainer killed leaves its leases' rows (and their excluded rows): every later look at the
    leases reads them (one /proc read each), and a crashed trainer a day adds some for good unless
    each reservation (one per shard the daemon publishes) deletes the ended ones."""
    ledger = Ledger(tmp_path / "ledger")
    proc = _sleeper()
    try:
        started = wait_for(lambda: start_time(proc.pid), timeout=10)
        ledger.leases.snapshot("killed trainer", ttl_s=600, holder=Owner(this_host(), proc.pid, started))
        running = ledger.leases.snapshot("running trainer", ttl_s=600)
        proc.kill()
        proc.wait(10)
        assert ledger.make_room(1, budget=10**9, choose=lambda *_: []) == []
        assert [lease["id"] for lease in ledger.leases.live()] == [running.id]
        assert ledger.leases.purge_expired() == 0, "the killed trainer's lease was left for `epochcache gc`"
    finally:
        proc.kill()
        ledger.close()


def test_lease_of_a_stopped_owner_outlives_its_ttl(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger")
    proc = _sleeper()
    try:
        started = wait_for(lambda: start_time(proc.pid), timeout=10)
        lease = ledger.leases.snapshot("trainer", ttl_s=0.1, holder=Owner(this_host(), proc.pid, started))
        proc.send_signal(signal.SIGSTOP)
        wait_for(lambda: time.time() > lease.expires + 0.3, timeout=10)
        assert [x["id"] for x in ledger.leases.live()] == [lease.id], "a stopped owner still holds its shards"
        assert ledger.leases.renew(lease.id, 0.1)
        assert not Owner(this_host(), proc.pid, started + 1).alive(), "a reused pid is another process"
    finally:
        proc.kill()
        proc.wait(10)
        ledger.close()


def test_a_rebuild_reads_each_file_once_and_shows_its_progress(
    layout: CacheLayout, capsys: pytest.CaptureFixture[str]
) -> None:
    """A rebuild reads every shard file (23 s for 100,000 tiny ones before each was opened once):
    asked for, a bar counts the files on stderr; by default (not a terminal) nothing is printed."""
    records = write_shards(layout, 3)
    ledger = Ledger.rebuild(layout.ledger, progress=True)
    assert ledger.shards() == records
    ledger.close()
    shown = capsys.readouterr().err
    assert "reading shard files" in shown and "3/3" in shown
    Ledger.rebuild(layout.ledger).close()
    assert capsys.readouterr().err == ""


def test_a_rebuild_refuses_while_another_process_has_the_ledger_open(layout: CacheLayout) -> None:
    """Deleted under a running trainer, the old database would live on in it: its leases unseen by the
    rebuilt one (a daemon could evict what it reads). The rebuild refuses until every other user is gone."""
    records = write_shards(layout, 2)
    Ledger(layout.ledger).close()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from epochcache.cache.ledger import Ledger; ledger = Ledger(sys.argv[1]); "
         "ledger.shards(); print('open', flush=True); sys.stdin.read()", str(layout.ledger)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "open\n"
        database = layout.ledger / DB_NAME
        before = database.stat().st_ino
        with pytest.raises(CacheError, match=r"open in another process .* stop every process using this cache"):
            Ledger.rebuild(layout.ledger)
        assert database.stat().st_ino == before, "nothing was deleted"
        holder.communicate("", timeout=30)
    finally:
        holder.kill()
        holder.wait(30)
    ledger = Ledger.rebuild(layout.ledger)
    assert ledger.shards() == records
    ledger.close()


def test_a_rebuild_refuses_while_this_process_has_the_ledger_open(layout: CacheLayout) -> None:
    """Its own connections hold no lock this process could fail to take: they are counted instead."""
    records = write_shards(layout, 1)
    ledger = Ledger(layout.ledger)
    before = (layout.ledger / DB_NAME).stat().st_ino
    with pytest.raises(CacheError, match="open in this process"):
        Ledger.rebuild(layout.ledger)
    assert (layout.ledger / DB_NAME).stat().st_ino == before, "nothing was deleted"
    ledger.close()
    rebuilt = Ledger.rebuild(layout.ledger)
    assert rebuilt.shards() == records
    rebuilt.close()


def test_open_elsewhere_cannot_tell_without_a_right_to_the_shm_file(tmp_path: Path) -> None:
    shm = tmp_path / (DB_NAME + "-shm")
    shm.write_bytes(b"\0" * 32768)
    assert not ledger_schema.open_elsewhere(tmp_path / DB_NAME)
    shm.chmod(0o444)
    if os.access(shm, os.W_OK):
        pytest.skip("this user (root?) may write any file")
    assert ledger_schema.open_elsewhere(tmp_path / DB_NAME), "a file it may not lock: it cannot tell, so it says yes"

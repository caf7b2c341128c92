"""Tests for epochcache.cache.ledger: shard records, byte budget, leases, retiring, sampler state."""

from __future__ import annotations

import dataclasses
import sqlite3
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from conftest import wait_for

import epochcache.cache.ledger_schema as ledger_schema
from epochcache.cache.evict import Fifo
from epochcache.cache.lease_owner import Owner
from epochcache.cache.ledger import LEDGER_RESERVE, Ledger, ShardRecord, Usage, take_until
from epochcache.cache.ledger_schema import connect

S = 10_000_000  # nominal shard size; ledger records carry sizes only, no files are needed
SLACK = S // 2  # room above whole shards, far more than the ledger's own SQLite files


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    led = Ledger(tmp_path / "ledger")
    yield led
    led.close()


def record(index: int, nbytes: int = S, rows: int = 100, created: float | None = None) -> ShardRecord:
    """A shard record named ``s<index>``, created at ``index`` unless given (so lower is older)."""
    return ShardRecord(
        id=f"s{index}",
        filename=f"s{index}.arrow",
        nbytes=nbytes,
        rows=rows,
        created=float(index) if created is None else created,
        checksum=f"{index:032x}",
        units=(f"obj-{index}.parquet#0", f"obj-{index}.parquet#1"),
    )


def publish_all(ledger: Ledger, records: Sequence[ShardRecord]) -> None:
    for rec in records:
        ledger.publish(rec)


def ids(records: Sequence[ShardRecord] | None) -> list[str]:
    assert records is not None
    return [r.id for r in records]


def retiring_ids(ledger: Ledger) -> list[str]:
    """Published shards a fresh snapshot leaves out (the retiring set); the probe lease is released."""
    probe = ledger.leases.snapshot("probe", ttl_s=60)
    ledger.leases.release(probe.id)
    in_snapshot = {r.id for r in probe.shards}
    return [r.id for r in ledger.shards() if r.id not in in_snapshot]


# -- records and usage ---------------------------------------------------------------------------


def test_empty_ledger(ledger: Ledger) -> None:
    assert ledger.shards() == []
    assert ledger.leases.live() == []
    assert ledger.daemon.cursor() is None
    assert ledger.daemon.listing() is None
    usage = ledger.usage()
    assert (usage.shard_bytes, usage.reserved_bytes, usage.shards, usage.rows, usage.leases) == (0, 0, 0, 0, 0)
    assert usage.ledger_bytes > 0


def test_publish_shards_and_usage(ledger: Ledger) -> None:
    records = [record(2, nbytes=300, rows=3), record(1, nbytes=100, rows=1), record(3, nbytes=500, rows=5)]
    publish_all(ledger, records)
    # Oldest first, whatever the publish order; records survive the round trip unchanged.
    assert ledger.shards() == sorted(records, key=lambda r: r.created)
    assert isinstance(ledger.shards()[0].units, tuple)
    usage = ledger.usage()
    assert usage.shard_bytes == 900
    assert usage.rows == 9
    assert usage.shards == 3
    assert usage.reserved_bytes == 0
    assert usage.leases == 0
    assert usage.ledger_bytes > 0
    assert usage.total == usage.shard_bytes + usage.reserved_bytes + usage.ledger_bytes


def test_shards_order_ties_broken_by_id(ledger: Ledger) -> None:
    publish_all(ledger, [record(2, created=5.0), record(1, created=5.0), record(0, created=9.0)])
    assert ids(ledger.shards()) == ["s1", "s2", "s0"]


def test_publish_moves_cursor_and_frees_reservation(ledger: Ledger) -> None:
    assert ledger.make_room(S, budget=10 * S, choose=Fifo()) == []
    assert ledger.usage().reserved_bytes == S
    ledger.publish(record(1), cursor={"pass_": 0, "obj": 2, "unit": 3})
    assert ledger.usage().reserved_bytes == 0
    assert ledger.daemon.cursor() == {"pass_": 0, "obj": 2, "unit": 3}
    # Publishing without a cursor leaves it where it was.
    ledger.publish(record(2))
    assert ledger.daemon.cursor() == {"pass_": 0, "obj": 2, "unit": 3}


def test_drop_forgets_records(ledger: Ledger) -> None:
    publish_all(ledger, [record(1), record(2), record(3)])
    ledger.drop(["s1", "s3", "not-there"])
    assert ids(ledger.shards()) == ["s2"]
    assert ledger.usage().shard_bytes == S


# -- leases ---------------------------------------------------------------------------------------


def test_snapshot_lease_and_release(ledger: Ledger) -> None:
    records = [record(1), record(2)]
    publish_all(ledger, records)
    before = time.time()
    lease = ledger.leases.snapshot("trainer-1", ttl_s=60)
    assert lease.shards == tuple(dataclasses.replace(r, units=()) for r in records), "records without unit keys"
    assert lease.owner == "trainer-1"
    assert before + 59 < lease.expires < time.time() + 61
    # A shard published after the snapshot is not part of it.
    ledger.publish(record(3))
    assert ids(list(lease.shards)) == ["s1", "s2"]

    (live,) = ledger.leases.live()
    assert live["id"] == lease.id
    assert live["owner"] == "trainer-1"
    assert live["shards"] == ["s1", "s2"]
    assert live["expires"] == pytest.approx(lease.expires)
    assert ledger.usage().leases == 1

    ledger.leases.release(lease.id)
    assert ledger.leases.live() == []
    assert ledger.usage().leases == 0


def test_two_leases_are_independent(ledger: Ledger) -> None:
    publish_all(ledger, [record(1)])
    first = ledger.leases.snapshot("a", ttl_s=60)
    second = ledger.leases.snapshot("b", ttl_s=60)
    assert first.id != second.id
    assert {x["owner"] for x in ledger.leases.live()} == {"a", "b"}
    ledger.leases.release(first.id)
    assert [x["id"] for x in ledger.leases.live()] == [second.id]


# A lease taken for a process of another host: only its TTL can end it.
ELSEWHERE = Owner("another-host/boot", 1, 0)


def test_lease_expires(ledger: Ledger) -> None:
    publish_all(ledger, [record(1)])
    lease = ledger.leases.snapshot("short", ttl_s=0.2, holder=ELSEWHERE)
    assert [x["id"] for x in ledger.leases.live()] == [lease.id]
    wait_for(lambda: ledger.leases.live() == [], timeout=10)
    assert ledger.usage().leases == 0
    assert ledger.leases.renew(lease.id, ttl_s=60) is False  # too late: it had expired


def test_renew_extends(ledger: Ledger) -> None:
    publish_all(ledger, [record(1)])
    lease = ledger.leases.snapshot("trainer", ttl_s=0.3)
    assert ledger.leases.renew(lease.id, ttl_s=60) is True
    (live,) = ledger.leases.live()
    assert live["expires"] > time.time() + 50
    # Well past the original expiry, the renewed lease is still live.
    wait_for(lambda: time.time() > lease.expires + 0.3, timeout=5)
    assert [x["id"] for x in ledger.leases.live()] == [lease.id]


def test_renew_released_lease_fails(ledger: Ledger) -> None:
    lease = ledger.leases.snapshot("trainer", ttl_s=60)
    ledger.leases.release(lease.id)
    assert ledger.leases.renew(lease.id, ttl_s=60) is False
    assert ledger.leases.live() == []


# -- budget ---------------------------------------------------------------------------------------


def test_make_room_within_budget_reserves(ledger: Ledger) -> None:
    publish_all(ledger, [record(1), record(2)])
    assert ledger.make_room(S, budget=3 * S + SLACK, choose=Fifo()) == []
    assert ids(ledger.shards()) == ["s1", "s2"]
    assert ledger.usage().reserved_bytes == S
    assert ledger.counters.all().get("evicted", 0) == 0


def test_reservations_count_against_budget(ledger: Ledger) -> None:
    budget = 2 * S + SLACK
    assert ledger.make_room(S, budget, Fifo()) == []
    assert ledger.make_room(S, budget, Fifo()) == []
    assert ledger.make_room(S, budget, Fifo()) is None  # 3 S reserved would exceed 2.5 S
    assert ledger.usage().reserved_bytes == 2 * S


def test_clear_reservation(ledger: Ledger) -> None:
    assert ledger.make_room(S, budget=10 * S, choose=Fifo()) == []
    assert ledger.usage().reserved_bytes == S
    ledger.clear_reservation()
    assert ledger.usage().reserved_bytes == 0
    # The freed room can be reserved again.
    assert ledger.make_room(S, budget=S + SLACK, choose=Fifo()) == []


def test_make_room_over_budget_evicts_oldest(ledger: Ledger) -> None:
    records = [record(i) for i in range(4)]
    publish_all(ledger, records)
    # 4 S used, budget 4.5 S, 2 S wanted: 1.5 S (plus the ledger's bytes) must go: two shards.
    victims = ledger.make_room(2 * S, budget=4 * S + SLACK, choose=Fifo())
    assert ids(victims) == ["s0", "s1"] and [v.filename for v in victims] == [r.filename for r in records[:2]]
    assert ids(ledger.shards()) == ["s2", "s3"]
    usage = ledger.usage()
    assert usage.reserved_bytes == 2 * S
    assert usage.total <= 4 * S + SLACK
    assert ledger.counters.all()["evicted"] == 2


def test_make_room_never_returns_leased_shard(ledger: Ledger) -> None:
    publish_all(ledger, [record(0)])
    lease = ledger.leases.snapshot("trainer", ttl_s=60)  # holds s0, the oldest
    publish_all(ledger, [record(1), record(2)])
    budget = 3 * S + SLACK
    # Fifo picks s0, which is in use: it retires and the caller waits; the newer, unread s1 stays.
    assert ledger.make_room(S, budget, Fifo()) is None
    assert ids(ledger.shards()) == ["s0", "s1", "s2"]
    assert retiring_ids(ledger) == ["s0"]
    assert ledger.usage().reserved_bytes == 0
    ledger.leases.release(lease.id)
    assert ids(ledger.make_room(S, budget, Fifo())) == ["s0"]
    assert ids(ledger.shards()) == ["s1", "s2"]


def test_victims_never_leased_and_budget_kept_over_many_epochs(ledger: Ledger) -> None:
    budget = 4 * S + SLACK
    leases: list[str] = []
    for step in range(24):
        if step % 3 == 0:  # a new epoch starts on the current shard set; the epoch before last ends
            leases.append(ledger.leases.snapshot(f"epoch-{step}", ttl_s=60).id)
            if len(leases) > 2:
                ledger.leases.release(leases.pop(0))
        leased = {sid for lease in ledger.leases.live() for sid in lease["shards"]}
        victims = ledger.make_room(S, budget, Fifo())
        if victims is None:
            assert ledger.usage().reserved_bytes == 0
            continue
        assert not leased & set(ids(victims)), f"step {step}: evicted a leased shard"
        assert ledger.usage().total <= budget
        ledger.publish(record(step))
    assert ledger.counters.all()["evicted"] > 0
    assert ledger.usage().total <= budget


def test_make_room_blocked_by_leases_retires_then_evicts(ledger: Ledger) -> None:
    records = [record(i) for i in range(3)]
    publish_all(ledger, records)
    lease = ledger.leases.snapshot("trainer", ttl_s=60)
    budget = 3 * S + SLACK

    assert ledger.make_room(S, budget, Fifo()) is None
    assert ids(ledger.shards()) == ids(records)  # nothing evicted
    assert ledger.usage().reserved_bytes == 0  # nothing reserved
    assert ledger.counters.all().get("evicted", 0) == 0

    # The oldest shard is retiring: the next epoch's snapshot leaves it out.
    nxt = ledger.leases.snapshot("trainer", ttl_s=60)
    assert ids(list(nxt.shards)) == ["s1", "s2"]
    assert retiring_ids(ledger) == ["s0"]

    # The old epoch ends while the new one is held: the retiring shard goes, the new lease holds.
    ledger.leases.release(lease.id)
    victims = ledger.make_room(S, budget, Fifo())
    assert ids(victims) == ["s0"]
    assert ids(ledger.shards()) == ["s1", "s2"]
    assert ledger.usage().reserved_bytes == S
    assert retiring_ids(ledger) == []
    assert ledger.counters.all()["evicted"] == 1


def test_make_room_after_release_evicts_retiring_first(ledger: Ledger) -> None:
    # The retiring shard is not the oldest unleased one: it still goes first.
    publish_all(ledger, [record(0), record(1)])
    lease = ledger.leases.snapshot("trainer", ttl_s=60)
    budget = 2 * S + SLACK
    newest_first = lambda cands, need: take_until(sorted(cands, key=lambda r: -r.created), need)  # noqa: E731
    assert ledger.make_room(S, budget, newest_first) is None
    assert retiring_ids(ledger) == ["s1"]  # this chooser picks the newest
    ledger.leases.release(lease.id)
    assert ids(ledger.make_room(S, budget, Fifo())) == ["s1"]
    assert ids(ledger.shards()) == ["s0"]


def test_repeated_make_room_while_blocked_does_not_retire_more(ledger: Ledger) -> None:
    records = [record(i) for i in range(5)]
    publish_all(ledger, records)
    ledger.leases.snapshot("trainer", ttl_s=60)
    budget = 5 * S + SLACK
    need = 5 * S + 2 * S - budget  # 1.5 S, plus the ledger's own bytes
    for _ in range(5):
        assert ledger.make_room(2 * S, budget, Fifo()) is None
        retiring = retiring_ids(ledger)
        assert retiring == ["s0", "s1"]
        retiring_bytes = sum(r.nbytes for r in ledger.shards() if r.id in retiring)
        assert need <= retiring_bytes < need + S
    assert ids(ledger.shards()) == ids(records)
    assert ledger.usage().reserved_bytes == 0


def test_make_room_with_empty_chooser_never_retires(ledger: Ledger) -> None:
    publish_all(ledger, [record(0), record(1)])
    ledger.leases.snapshot("trainer", ttl_s=60)
    assert ledger.make_room(S, 2 * S + SLACK, lambda *_: []) is None
    assert retiring_ids(ledger) == []
    assert len(ledger.shards()) == 2


def test_clear_retiring_returns_shards_to_snapshots(ledger: Ledger) -> None:
    publish_all(ledger, [record(0), record(1)])
    ledger.leases.snapshot("trainer", ttl_s=60)
    assert ledger.make_room(S, 2 * S + SLACK, Fifo()) is None
    assert retiring_ids(ledger) == ["s0"]
    ledger.clear_retiring()
    assert retiring_ids(ledger) == []


def test_expired_lease_does_not_protect(ledger: Ledger) -> None:
    publish_all(ledger, [record(0), record(1)])
    ledger.leases.snapshot("trainer", ttl_s=0.2, holder=ELSEWHERE)
    wait_for(lambda: ledger.leases.live() == [], timeout=10)
    assert ids(ledger.make_room(S, 2 * S + SLACK, Fifo())) == ["s0"]


def test_blocked_make_room_retires_enough_leased_bytes(ledger: Ledger) -> None:
    # s1, s2 leased; s0 unleased but older (created 0.0, e.g. a clock step back) and only half a shard.
    publish_all(ledger, [record(1), record(2)])
    old_epoch = ledger.leases.snapshot("trainer", ttl_s=60)
    ledger.publish(record(0, nbytes=S // 2))
    budget = 3 * S
    # 2.5 S used + S wanted - 3 S budget: 0.5 S (plus the ledger's bytes) must go; s0 alone is not enough.
    assert ledger.make_room(S, budget, Fifo()) is None
    # Enough *leased* bytes must now be retiring to cover what s0 cannot.
    assert "s1" in retiring_ids(ledger)
    # So the next epoch leaves s1 out, and once the old epoch ends the room can be made.
    ledger.leases.snapshot("trainer", ttl_s=60)
    ledger.leases.release(old_epoch.id)
    victims = ledger.make_room(S, budget, Fifo())
    assert victims is not None
    assert "s1" in ids(victims)


# -- sampler state and counters -------------------------------------------------------------------


def test_cursor_and_listing_round_trip(ledger: Ledger) -> None:
    ledger.daemon.set_cursor({"pass_": 3, "obj": 7, "unit": 1})
    assert ledger.daemon.cursor() == {"pass_": 3, "obj": 7, "unit": 1}
    listing = {"url": "s3://b/p", "objects": [["b/p/a.parquet", 123], ["b/p/b.parquet", 456]], "seed": 4}
    ledger.daemon.set_listing("", listing)
    assert ledger.daemon.listing() == listing
    ledger.daemon.set_cursor({"pass_": 4, "obj": 0, "unit": 0})
    assert ledger.daemon.cursor() == {"pass_": 4, "obj": 0, "unit": 0}


def test_counters(ledger: Ledger) -> None:
    assert ledger.counters.all() == {}
    ledger.counters.incr("retries")
    ledger.counters.incr("retries", 4)
    ledger.counters.incr("bytes_read", 1000)
    publish_all(ledger, [record(0), record(1)])
    assert ledger.counters.all() == {"retries": 5, "bytes_read": 1000, "published": 2}


# -- several processes ----------------------------------------------------------------------------


def test_second_ledger_on_same_directory_sees_same_data(tmp_path: Path) -> None:
    daemon_side = Ledger(tmp_path / "ledger")
    trainer_side = Ledger(tmp_path / "ledger")
    try:
        publish_all(daemon_side, [record(0), record(1)])
        daemon_side.daemon.set_cursor({"pass_": 0, "obj": 1, "unit": 0})
        assert trainer_side.shards() == daemon_side.shards()
        assert trainer_side.daemon.cursor() == {"pass_": 0, "obj": 1, "unit": 0}

        lease = trainer_side.leases.snapshot("trainer", ttl_s=60)
        assert [x["id"] for x in daemon_side.leases.live()] == [lease.id]
        # The daemon's eviction respects the lease taken through the other object.
        assert daemon_side.make_room(S, 2 * S + SLACK, Fifo()) is None
        assert ids(list(trainer_side.leases.snapshot("t2", ttl_s=60).shards)) == ["s1"]

        trainer_side.leases.release(lease.id)
        assert ids(daemon_side.make_room(S, 2 * S + SLACK, Fifo())) == ["s0"]
        assert ids(trainer_side.shards()) == ["s1"]
        usage = trainer_side.usage()
        assert isinstance(usage, Usage)
        assert usage.reserved_bytes == S
        assert trainer_side.counters.all()["evicted"] == 1
    finally:
        daemon_side.close()
        trainer_side.close()


def test_reopened_ledger_keeps_data(tmp_path: Path) -> None:
    first = Ledger(tmp_path / "ledger")
    publish_all(first, [record(0)])
    first.daemon.set_listing("", {"objects": []})
    first.close()
    again = Ledger(tmp_path / "ledger")
    try:
        assert ids(again.shards()) == ["s0"]
        assert again.daemon.listing() == {"objects": []}
        assert again.counters.all() == {"published": 1}
    finally:
        again.close()


def test_eviction_runs_in_batches_down_to_evict_to(ledger: Ledger) -> None:
    publish_all(ledger, [record(i) for i in range(10)])
    budget = 10 * S + SLACK
    victims = ledger.make_room(S, budget, Fifo(), evict_to=7 * S + SLACK)
    # one shard would make room; evict_to asks for the batch that brings usage to 7 shards' worth
    assert ids(victims) == ["s0", "s1", "s2", "s3"]
    assert ledger.usage().total <= 7 * S + SLACK


def test_leased_cache_retires_a_batch_per_epoch(ledger: Ledger) -> None:
    publish_all(ledger, [record(i) for i in range(10)])
    budget = 10 * S + SLACK
    epoch = ledger.leases.snapshot("trainer", ttl_s=60)
    assert ledger.make_room(S, budget, Fifo(), evict_to=7 * S + SLACK) is None
    assert retiring_ids(ledger) == ["s0", "s1", "s2", "s3"], "the next epoch leaves the whole batch out"
    ledger.leases.release(epoch.id)
    assert ids(ledger.make_room(S, budget, Fifo(), evict_to=7 * S + SLACK)) == ["s0", "s1", "s2", "s3"]


def test_ledger_is_charged_its_files_plus_a_reserve(ledger: Ledger, tmp_path: Path) -> None:
    folder = tmp_path / "ledger"
    assert ledger.disk_bytes() == 2 * (folder / "ledger.sqlite3").stat().st_size + LEDGER_RESERVE
    publish_all(ledger, [record(i) for i in range(200)])
    lease = ledger.leases.snapshot("t", ttl_s=60)
    ledger.leases.record_epoch(lease.id, 200)  # the first epoch marks every record trained in one transaction
    ledger.leases.release(lease.id)
    real = sum(p.stat().st_size for p in folder.iterdir())
    assert real <= ledger.disk_bytes(), "the database, its WAL and shared memory fit in the charge"
    assert (folder / "ledger.sqlite3-wal").stat().st_size <= LEDGER_RESERVE // 2, "checkpoints keep the WAL small"


# -- uses, quarantine, daemon state ---------------------------------------------------------------


def test_snapshot_counts_uses_in_the_same_transaction(ledger: Ledger) -> None:
    publish_all(ledger, [record(1), record(2)])
    before = time.time()
    first = ledger.leases.snapshot("t", ttl_s=60)
    assert [(r.uses, r.last_used) for r in first.shards] == [(0, None), (0, None)], "a lease's records: no counts"
    ledger.publish(record(3))
    assert {r.id: r.uses for r in ledger.shards()} == {"s1": 1, "s2": 1, "s3": 0}
    second = ledger.leases.snapshot("t", ttl_s=60)
    assert ids(list(second.shards)) == ["s1", "s2", "s3"]
    by_id = {r.id: r for r in ledger.shards()}
    assert (by_id["s1"].uses, by_id["s2"].uses, by_id["s3"].uses) == (2, 2, 1)
    assert before <= by_id["s1"].last_used <= time.time()
    assert by_id["s1"].last_used == by_id["s3"].last_used, "both last used by the second snapshot"
    assert ledger.leases.live()[0]["taken"] >= before


def test_evictions_counted_per_policy_label(ledger: Ledger) -> None:
    from epochcache.cache.evict import MaxUses

    publish_all(ledger, [record(i) for i in range(4)])
    ledger.leases.release(ledger.leases.snapshot("t", ttl_s=60).id)  # every shard used once
    ledger.publish(record(9))
    policy = MaxUses(Fifo(), max_uses=1)
    victims = ledger.make_room(S, budget=5 * S + SLACK, choose=policy, evict_to=3 * S + SLACK)
    assert ids(victims) == ["s0", "s1", "s2"]
    assert ledger.counters.all()["evicted.max_uses"] == 3
    ledger.clear_reservation()
    ledger.publish(record(10))
    assert ids(ledger.make_room(3 * S, budget=4 * S + SLACK, choose=policy)) == ["s3", "s9"]
    counters = ledger.counters.all()
    assert (counters["evicted.max_uses"], counters["evicted.fifo"], counters["evicted"]) == (4, 1, 5)


def test_quarantine_keeps_bytes_charged_until_forgotten(ledger: Ledger) -> None:
    publish_all(ledger, [record(1), record(2)])
    assert ledger.quarantine.add("s1", "bit flip") == record(1)
    assert ledger.quarantine.add("s1", "again") is None  # already out of the shard set
    assert ids(ledger.shards()) == ["s2"]
    (entry,) = ledger.quarantine.entries()
    assert (entry.record, entry.reason) == (record(1), "bit flip")
    usage = ledger.usage()
    assert (usage.shard_bytes, usage.quarantined_bytes) == (S, S)
    assert usage.total == 2 * S + usage.ledger_bytes
    # Quarantined bytes block a reservation like any other bytes, and are never evicted by a policy.
    assert ledger.make_room(S, budget=2 * S + SLACK, choose=lambda *_: []) is None
    assert ledger.counters.all()["quarantined"] == 1
    ledger.quarantine.forget(["s1"])
    assert ledger.quarantine.entries() == [] and ledger.usage().quarantined_bytes == 0
    assert ledger.make_room(S, budget=2 * S + SLACK, choose=lambda *_: []) == []


def test_adopt_records_and_counts(ledger: Ledger) -> None:
    ledger.adopt([record(1), record(2)])
    assert ids(ledger.shards()) == ["s1", "s2"]
    assert ledger.counters.all()["adopted"] == 2
    assert ledger.counters.all().get("published", 0) == 0


def test_daemon_state_round_trip(ledger: Ledger) -> None:
    assert ledger.daemon.status() is None
    ledger.daemon.set_status({"pid": 7, "state": "backpressure", "since": 1.0})
    assert ledger.daemon.status() == {"pid": 7, "state": "backpressure", "since": 1.0}


def test_purge_expired_removes_dead_leases(ledger: Ledger) -> None:
    publish_all(ledger, [record(1)])
    ledger.leases.snapshot("short", ttl_s=0.05, holder=ELSEWHERE)
    keep = ledger.leases.snapshot("long", ttl_s=60)
    wait_for(lambda: len(ledger.leases.live()) == 1, timeout=10)
    assert ledger.leases.purge_expired() == 1
    assert [lease["id"] for lease in ledger.leases.live()] == [keep.id]


def test_opening_retries_while_the_database_is_locked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    refusals: list[int] = []

    def locked_twice(path: Path) -> sqlite3.Connection:
        if len(refusals) < 2:  # as SQLite answers when another process is mid-write
            refusals.append(1)
            raise sqlite3.OperationalError("database is locked")
        return connect(path)

    ledger = Ledger(tmp_path / "ledger", connect=locked_twice)
    assert len(refusals) == 2
    assert ledger.shards() == []
    ledger.close()

    def always_locked(path: Path) -> sqlite3.Connection:
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(ledger_schema, "OPEN_PATIENCE_S", 0.2)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        Ledger(tmp_path / "ledger", connect=always_locked)


def _epoch(ledger: Ledger, samples: int) -> None:
    lease = ledger.leases.snapshot("t", ttl_s=60)
    ledger.leases.record_epoch(lease.id, samples)
    ledger.leases.release(lease.id)


def test_each_epoch_run_is_recorded_with_distinct_samples_at_unit_level(ledger: Ledger) -> None:
    """Coverage and echo (issue 11): a unit cached again in a later shard (after its first shard was
    evicted) is trained again, but is not a new distinct sample; a snapshot no epoch ran on (prepared
    ahead, then dropped) records nothing."""
    first = dataclasses.replace(record(1), units=("a#0", "a#1"))  # 100 rows, 2 units
    ledger.publish(first)
    ledger.counters.incr("fetched_bytes", 500)
    ledger.leases.release(ledger.leases.snapshot("prepared-ahead", ttl_s=60).id)
    assert ledger.leases.epochs() == []
    _epoch(ledger, 100)
    ledger.drop(["s1"])
    again = dataclasses.replace(record(2, rows=60), units=("a#1", "b#0", "b#1"))  # a#1 back, 20 rows a unit
    ledger.publish(again)
    _epoch(ledger, 60)
    _epoch(ledger, 1000)  # a fixed epoch length
    ended = ledger.leases.snapshot("t", ttl_s=60)
    ledger.leases.release(ended.id)
    ledger.leases.record_epoch(ended.id, 5)  # its lease ended: no record
    epochs = ledger.leases.epochs(last=5)
    assert [e["n"] for e in epochs] == [1, 2, 3]
    assert [e["samples"] for e in epochs] == [100, 60, 1000]
    assert [e["trained"] for e in epochs] == [100, 160, 1160]
    assert [e["distinct_trained"] for e in epochs] == [100, 140, 140], "a#1 is not distinct twice"
    assert epochs[0]["fetched_bytes"] == 500 and epochs[1]["cache_bytes"] == S and ledger.leases.epochs()[0]["n"] == 3


def test_a_unit_in_two_shards_new_to_one_epoch_counts_once_at_its_first_shards_share(ledger: Ledger) -> None:
    """Both shards untrained when the epoch is recorded: a#1 counts at s1's 50 rows a unit, not s2's 30."""
    ledger.publish(dataclasses.replace(record(1), units=("a#0", "a#1")))  # 100 rows, 2 units
    ledger.publish(dataclasses.replace(record(2, rows=60), units=("a#1", "b#0")))  # 30 rows a unit
    _epoch(ledger, 160)
    _epoch(ledger, 160)  # nothing new to training
    assert [e["distinct_trained"] for e in ledger.leases.epochs(last=2)] == [130, 130]


def test_the_version_changes_with_another_connections_commit_only(tmp_path: Path) -> None:
    ledger, other = Ledger(tmp_path / "ledger"), Ledger(tmp_path / "ledger")
    first = ledger.db.version()
    ledger.daemon.set_cursor({"pass": 1})  # its own commit
    assert ledger.db.version() == first
    other.daemon.set_cursor({"pass": 2})
    second = ledger.db.version()
    assert second != first
    assert ledger.db.version() == second
    ledger.close()
    other.close()


def test_unleased_retiring_skips_every_live_leases_shards_and_takes_only_what_is_needed(ledger: Ledger) -> None:
    """Two live leases of different epochs: a retiring shard goes only once neither holds it, oldest
    first, and no more of them than the bytes asked for (one statement, whatever the retiring set)."""
    from epochcache.cache.ledger_leases import unleased_retiring

    publish_all(ledger, [record(i) for i in range(6)])
    with ledger.db.write() as con:
        con.execute("UPDATE shards SET state = 1 WHERE id IN ('s0', 's1')")
    late = ledger.leases.snapshot("late epoch", ttl_s=60)  # holds s2..s5 (s0, s1 retiring: excluded)
    publish_all(ledger, [record(6), record(7)])
    with ledger.db.write() as con:
        con.execute("UPDATE shards SET state = 1 WHERE id IN ('s3', 's6', 's7')")
        assert ids(unleased_retiring(con, 10 * S)) == ["s0", "s1", "s6", "s7"]  # s3: the late epoch holds it
        assert ids(unleased_retiring(con, S + 1)) == ["s0", "s1"]
    newer = ledger.leases.snapshot("newer epoch", ttl_s=60)  # holds s2, s4, s5 only: the rest retire
    ledger.leases.release(late.id)
    with ledger.db.write() as con:
        assert ids(unleased_retiring(con, 10 * S)) == ["s0", "s1", "s3", "s6", "s7"]
    ledger.leases.release(newer.id)


def test_a_path_a_listing_gives_twice_is_still_found_rewritten(ledger: Ledger) -> None:
    """Some stores repeat a key (within a page, or across two); a rewrite of it must still show,
    and a path both listings give under one ETag (spelled otherwise) is not rewritten."""
    ledger.daemon.set_listing_page(0, [("b/a", 1, '"1111"'), ("b/a", 1, '"1111"'), ("b/c", 1, '"3333"')])
    ledger.daemon.keep_previous_listing()
    ledger.daemon.set_listing_page(0, [("b/a", 1, '"2222"'), ("b/c", 1, "3333")])
    ledger.daemon.set_listing_page(1, [("b/a", 1, '"2222"'), ("b/c", 1, '"3333"'), ("b/d", 1, '"4444"')])
    assert ledger.daemon.rewritten() == ["b/a"]

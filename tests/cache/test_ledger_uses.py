"""Tests for use counts by generation (epochcache.cache.ledger_uses) and the records a lease hands out
(epochcache.cache.ledger_leased): counts stay exact through several trainers, retiring shards,
quarantine and re-adoption, every policy's index walk picks what the policy picks over the full list,
and a later lease reuses the records of the last one."""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from epochcache.cache.evict import Fifo, Lru, MaxUses, MinUses, MostUsed, Policy, Random
from epochcache.cache.ledger import PUBLISH_GROWTH, Ledger, ShardRecord, _choose

S = 1_000_000


def record(i: int, uses: int = 0, last_used: float | None = None) -> ShardRecord:
    return ShardRecord(id=f"s{i:03d}", filename=f"s{i:03d}.arrow", nbytes=S, rows=10, created=float(i % 13 + i / 1000),
                       checksum=f"{i:032x}", units=(f"u{i}",), uses=uses, last_used=last_used)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Ledger]:
    led = Ledger(tmp_path / "ledger")
    yield led
    led.close()


def retiring(ledger: Ledger) -> set[str]:
    return {sid for (sid,) in ledger.db.connection().execute("SELECT id FROM shards WHERE state = 1")}


class Model:
    """What the counts must be: a shard's uses are the snapshots whose lease held it, its last use
    the latest of them (known to lie within that snapshot call's window)."""

    def __init__(self) -> None:
        self.uses: dict[str, int] = {}
        self.last: dict[str, tuple[float, float] | None] = {}

    def add(self, r: ShardRecord) -> None:
        self.uses[r.id] = r.uses
        self.last[r.id] = None if r.last_used is None else (r.last_used, r.last_used)

    def used(self, ids: list[str], window: tuple[float, float]) -> None:
        for sid in ids:
            self.uses[sid] += 1
            self.last[sid] = window

    def forget(self, sid: str) -> None:
        del self.uses[sid], self.last[sid]

    def check(self, records: list[ShardRecord]) -> None:
        assert {r.id: r.uses for r in records} == self.uses
        for r in records:
            window = self.last[r.id]
            if window is None:
                assert r.last_used is None, r
            else:
                assert r.last_used is not None and window[0] <= r.last_used <= window[1], r


POLICIES: list[Policy] = [Fifo(), Lru(), MostUsed(), MaxUses(Lru(), 3), MaxUses(MostUsed(), 2),
                          MinUses(MostUsed(), 2), MinUses(Lru(), 1), MinUses(MaxUses(Fifo(), 4), 2)]


def test_counts_stay_exact_through_trainers_retiring_quarantine_and_adoption(tmp_path: Path) -> None:
    """Two trainers (two connections) take snapshots while a daemon publishes, adopts shards with
    counts of their own, retires and evicts with min_uses, returns retiring shards, and a reader
    quarantines one mid-epoch: after every step each shard's uses and last use are what the
    snapshots that held it say, no victim was used fewer than min_uses times, and every policy's
    index walk picks exactly what the policy picks over the live records."""
    rng = random.Random(7)
    daemon, trainers = Ledger(tmp_path / "ledger"), [Ledger(tmp_path / "ledger") for _ in range(2)]
    model, leases, made = Model(), [], 0
    min_uses = MinUses(Fifo(), 2)
    for step in range(200):
        op = rng.choice(["publish", "publish", "adopt", "snapshot", "snapshot", "release", "release", "release",
                         "evict", "evict", "clear", "quarantine"])
        if op in ("publish", "adopt") or not model.uses:
            made += 1
            if op == "adopt":  # e.g. a shard found whole at start, its counts from elsewhere
                r = record(made, uses=rng.randrange(5), last_used=1000.0 + made)
                daemon.adopt([r])
            else:
                r = record(made)
                daemon.publish(r)
            model.add(r)
        elif op == "snapshot":
            trainer, before = rng.choice(trainers), time.time()
            lease = trainer.leases.snapshot(f"t{step}", ttl_s=60)
            model.used([r.id for r in lease.shards], (before, time.time()))
            assert not {r.id for r in lease.shards} & retiring(daemon), "a snapshot leaves retiring shards out"
            leases.append((trainer, lease.id))
        elif op == "release" and leases:
            trainer, lease_id = leases.pop(rng.randrange(len(leases)))
            trainer.leases.release(lease_id)
        elif op == "evict":
            usage = daemon.usage()
            budget = usage.total + S + PUBLISH_GROWTH - rng.randint(1, 3) * S
            victims = daemon.make_room(S, budget, min_uses) or []
            daemon.clear_reservation()
            for victim in victims:
                assert victim.uses == model.uses[victim.id] >= 2, "min_uses holds, and the counts went with it"
                model.forget(victim.id)
        elif op == "clear":
            daemon.clear_retiring()
        elif op == "quarantine":
            sid = rng.choice(sorted(model.uses))
            found = trainers[0].quarantine.add(sid, "damaged")
            assert found is not None and found.uses == model.uses[sid]
            (moved,) = [q.record for q in trainers[0].quarantine.entries() if q.record.id == sid]
            assert moved.uses == model.uses[sid] and moved.last_used == found.last_used
            model.forget(sid)
        model.check(trainers[1].shards())
        if step % 8 == 0:
            live = [r for r in daemon.shards() if r.id not in retiring(daemon)]
            for policy in POLICIES:
                need = rng.randint(1, 6) * S
                expected = [r.id for r in policy(live, need)]
                assert _choose(daemon.db.connection(), policy, need) == expected, (step, policy)
    for led in (daemon, *trainers):
        led.close()


def test_a_later_lease_reuses_records_and_sees_what_changed(tmp_path: Path, ledger: Ledger) -> None:
    ledger.adopt([record(i) for i in range(20)])
    first = ledger.leases.snapshot("t", ttl_s=60)
    assert [(r.uses, r.last_used, r.units) for r in first.shards] == [(0, None, ())] * 20, "no counts, no units"
    ledger.mark_verified(["s001"])
    ledger.publish(record(29))
    ledger.quarantine.add("s002", "damaged")
    second = ledger.leases.snapshot("t", ttl_s=60)
    assert [r.id for r in second.shards] == [f"s{i:03d}" for i in (0, 1, *range(3, 20), 29)]
    by_id = {r.id: r for r in second.shards}
    assert by_id["s000"] is first.shards[0], "an unchanged record is reused, not decoded again"
    assert by_id["s029"] == dataclasses.replace(record(29), units=()), "a new shard's record is read"
    assert by_id["s001"].verified and not first.shards[1].verified, "a newly verified record is read again"
    other = Ledger(tmp_path / "ledger")
    assert other.leases.snapshot("t", ttl_s=60).shards == second.shards, "a process's first lease reads the same"
    other.close()


def test_random_eviction_walk_draws_every_candidate_and_only_candidates(ledger: Ledger) -> None:
    """Random victims by row-number draws: only shards the bounds allow, a seed repeats its draws,
    each candidate about equally often; with few candidates among many rows, all of them."""
    ledger.adopt([record(i) for i in range(60)])
    ledger.leases.release(ledger.leases.snapshot("t", ttl_s=60).id)  # s000..s059 used once
    ledger.adopt([record(i) for i in range(60, 120)])  # never used: min_uses keeps them
    policy = MinUses(Random(seed=3), 1)
    picks = _choose(ledger.db.connection(), policy, 10 * S)
    assert len(set(picks)) == 10 and all(int(sid[1:]) < 60 for sid in picks)
    assert _choose(ledger.db.connection(), policy, 10 * S) == picks, "a seed repeats its draws"
    firsts = Counter(_choose(ledger.db.connection(), MinUses(Random(seed=s), 1), S)[0] for s in range(1200))
    assert set(firsts) == {f"s{i:03d}" for i in range(60)}
    assert max(firsts.values()) < 60, "about 20 each of 60 candidates"
    ledger.drop([f"s{i:03d}" for i in range(3, 60)])  # 3 candidates among 63 rows spread over 120
    assert sorted(_choose(ledger.db.connection(), policy, 100 * S)) == ["s000", "s001", "s002"]


def test_records_kept_by_row_number_are_not_reused_from_a_rebuilt_database(tmp_path: Path) -> None:
    """A ledger rebuilt under a process (``verify --fix`` elsewhere, then a fork reconnects) numbers
    its rows anew: the records this process kept by row number are read again, not handed out."""
    trainer = Ledger(tmp_path / "ledger")
    trainer.adopt([record(i) for i in range(20)])
    assert [r.id for r in trainer.leases.snapshot("t", ttl_s=60).shards][:2] == ["s000", "s001"]
    trainer.db.close()
    for name in ("ledger.sqlite3", "ledger.sqlite3-wal", "ledger.sqlite3-shm"):
        (tmp_path / "ledger" / name).unlink(missing_ok=True)
    rebuilt = Ledger(tmp_path / "ledger")
    rebuilt.adopt([record(i) for i in reversed(range(20))])  # row 1 is now s019
    rebuilt.close()
    trainer.db._pid = -1  # as in a forked child: the next statement reconnects, to the rebuilt database
    lease = trainer.leases.snapshot("t", ttl_s=60)
    assert [(r.id, r.filename) for r in lease.shards][:2] == [("s019", "s019.arrow"), ("s018", "s018.arrow")]
    trainer.close()


def test_snapshots_naming_one_epoch_count_one_use(ledger: Ledger) -> None:
    """The ranks of a node each take a snapshot for one epoch: its shards are used once, not once per
    rank; an epoch of another name (the next epoch, another trainer) counts again."""
    ledger.adopt([record(1), record(2)])
    for owner in ("rank0", "rank1"):
        ledger.leases.release(ledger.leases.snapshot(owner, 60, use="node-a:epoch0").id)
    assert {r.id: r.uses for r in ledger.shards()} == {"s001": 1, "s002": 1}
    ledger.leases.release(ledger.leases.snapshot("rank0", 60, use="node-a:epoch1").id)
    ledger.leases.release(ledger.leases.snapshot("other", 60, use="node-b:epoch0").id)
    ledger.leases.release(ledger.leases.snapshot("unnamed", 60).id)
    assert {r.id: r.uses for r in ledger.shards()} == {"s001": 4, "s002": 4}

"""Tests for epochcache.cache.evict: the policies, lookup by name, and their index walks in the ledger."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from conftest import make_table, wait_for

from epochcache.cache.evict import POLICIES, Fifo, Lru, MaxUses, MinUses, MostUsed, Random, policy_named
from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import Ledger, ShardRecord, _choose
from epochcache.cache.ledger_uses import SPAN, draw, walks
from epochcache.cache.publisher import EPOCH_FILL, Published, Publisher
from epochcache.config import CacheConfig
from epochcache.errors import ConfigError


def record(
    shard_id: str, created: float, nbytes: int = 100, uses: int = 0, last_used: float | None = None
) -> ShardRecord:
    return ShardRecord(
        id=shard_id, filename=f"{shard_id}.arrow", nbytes=nbytes, rows=1, created=created, checksum="0" * 32,
        units=(), uses=uses, last_used=last_used,
    )


def test_fifo_picks_oldest_first_and_stops_at_need() -> None:
    candidates = [record("c", 3.0), record("a", 1.0), record("d", 4.0), record("b", 2.0)]
    assert [r.id for r in Fifo()(candidates, 150)] == ["a", "b"]
    assert [r.id for r in Fifo()(candidates, 200)] == ["a", "b"]
    assert [r.id for r in Fifo()(candidates, 201)] == ["a", "b", "c"]
    assert [r.id for r in Fifo()(candidates, 1)] == ["a"]


def test_fifo_nothing_needed_takes_nothing() -> None:
    candidates = [record("a", 1.0), record("b", 2.0)]
    assert Fifo()(candidates, 0) == []
    assert Fifo()(candidates, -5) == []
    assert Fifo()([], 100) == []


def test_fifo_returns_everything_when_need_cannot_be_met() -> None:
    candidates = [record("b", 2.0), record("a", 1.0)]
    assert [r.id for r in Fifo()(candidates, 10_000)] == ["a", "b"]


def test_fifo_counts_bytes_not_shards() -> None:
    candidates = [record("big", 1.0, nbytes=1000), record("small", 2.0, nbytes=1)]
    assert [r.id for r in Fifo()(candidates, 500)] == ["big"]


def test_fifo_ties_broken_by_id() -> None:
    candidates = [record("z", 1.0), record("m", 1.0), record("a", 2.0)]
    assert [r.id for r in Fifo()(candidates, 150)] == ["m", "z"]


def test_fifo_does_not_mutate_candidates() -> None:
    candidates = [record("b", 2.0), record("a", 1.0)]
    Fifo()(candidates, 100)
    assert [r.id for r in candidates] == ["b", "a"]


def test_policy_named_fifo() -> None:
    policy = policy_named("fifo")
    assert isinstance(policy, Fifo)
    assert policy.name == "fifo"
    assert [r.id for r in policy([record("b", 2.0), record("a", 1.0)], 50)] == ["a"]
    assert "fifo" in POLICIES


def test_policy_named_unknown_lists_valid_policies() -> None:
    with pytest.raises(ConfigError) as info:
        policy_named("oldest")
    message = str(info.value)
    assert "cache.eviction" in message
    assert "'oldest'" in message
    for name in POLICIES:
        assert name in message


def test_lru_least_recently_used_first_never_used_counts_as_created() -> None:
    candidates = [
        record("old-but-fresh", 1.0, last_used=50.0),
        record("used-long-ago", 2.0, last_used=10.0),
        record("never-used", 20.0),
        record("used-late", 3.0, last_used=90.0),
    ]
    assert [r.id for r in Lru()(candidates, 10_000)] == ["used-long-ago", "never-used", "old-but-fresh", "used-late"]
    assert [r.id for r in Lru()(candidates, 150)] == ["used-long-ago", "never-used"]


def test_most_used_first_ties_oldest_first() -> None:
    candidates = [record("a", 1.0, uses=2), record("b", 2.0, uses=5), record("c", 3.0, uses=5), record("d", 0.5)]
    assert [r.id for r in MostUsed()(candidates, 10_000)] == ["b", "c", "a", "d"]
    assert [r.id for r in MostUsed()(candidates, 100)] == ["b"]


def test_random_is_a_seeded_permutation() -> None:
    candidates = [record(f"s{i:02d}", float(i)) for i in range(40)]
    first = [r.id for r in Random(seed=1)(candidates, 10_000)]
    assert sorted(first) == sorted(r.id for r in candidates)
    assert first == [r.id for r in Random(seed=1)(list(reversed(candidates)), 10_000)]  # input order ignored
    assert first != [r.id for r in Random(seed=2)(candidates, 10_000)]
    assert first != sorted(first)
    assert len(Random(seed=1)(candidates, 250)) == 3


def test_max_uses_goes_first_whatever_the_policy() -> None:
    candidates = [record("new-worn", 9.0, uses=4), record("old", 1.0, uses=1), record("worn", 5.0, uses=3)]
    policy = MaxUses(Fifo(), max_uses=3)
    assert [r.id for r in policy(candidates, 150)] == ["worn", "new-worn"]
    assert [r.id for r in policy(candidates, 250)] == ["worn", "new-worn", "old"]
    assert [r.id for r in policy(candidates, 50)] == ["worn"]
    assert policy.label(candidates[0]) == "max_uses" and policy.label(candidates[1]) == "fifo"
    assert policy.name == "fifo"


def test_min_uses_never_picks_a_shard_fewer_epochs_used() -> None:
    candidates = [record("old-unused", 1.0, uses=0), record("used", 2.0, uses=1), record("new-used", 3.0, uses=2)]
    policy = MinUses(Fifo(), min_uses=1)
    assert [r.id for r in policy(candidates, 250)] == ["used", "new-used"], "all it may take, never the unused"
    assert [r.id for r in MinUses(Fifo(), 2)(candidates, 50)] == ["new-used"]
    assert policy.name == "fifo" and policy.label(candidates[1]) == "fifo"
    assert policy_named("fifo", min_uses=0) is POLICIES["fifo"], "0 turns it off"
    wrapped = policy_named("lru", max_uses=3, min_uses=1)
    assert isinstance(wrapped, MinUses) and isinstance(wrapped.policy, MaxUses), "outermost: worn or not"


@pytest.mark.parametrize("name", ["fifo", "lru", "most-used", "random"])
def test_every_policy_by_name_and_labels(name: str) -> None:
    policy = policy_named(name)
    assert policy.name == name and POLICIES[name] is policy
    victims = policy([record("a", 1.0), record("b", 2.0)], 150)
    assert sorted(r.id for r in victims) == ["a", "b"]
    assert {policy.label(v) for v in victims} == {name}
    wrapped = policy_named(name, max_uses=2)
    assert isinstance(wrapped, MaxUses) and wrapped.policy is policy and wrapped.max_uses == 2


@pytest.mark.parametrize("policy", [Fifo(), Lru(), MostUsed(), MaxUses(Fifo(), 3), MaxUses(Lru(), 3),
                                    MinUses(Fifo(), 1), MinUses(MaxUses(MostUsed(), 3), 2)],
                         ids=lambda p: f"{type(p).__name__}")
def test_indexed_policies_walk_an_index_never_sort_the_cache(tmp_path: Path, policy: MaxUses | MinUses) -> None:
    """Each stage's ORDER BY is served by an index (ties of lru/most-used aside), so k victims cost
    O(k log n): SQLite never sorts the whole candidate set first."""
    ledger = Ledger(tmp_path / "ledger")
    statements = [sql for stage in policy.stages() or [] for sql in walks(stage)]
    assert statements
    for sql in statements:
        plan = [row[3] for row in ledger.db.connection().execute(
            f"EXPLAIN QUERY PLAN {sql}", {"g": 0, "t": 0.0, "at_least": 1, "below": 3})]
        assert "USING" in plan[0] and "INDEX" in plan[0], plan
        assert "USE TEMP B-TREE FOR ORDER BY" not in plan, plan
    ledger.close()


def test_random_eviction_looks_up_rows_never_scans(tmp_path: Path) -> None:
    """A random walk's draws cost O(log n) each: its span and its lookups search, never scan."""
    ledger = Ledger(tmp_path / "ledger")
    for stage in MinUses(MaxUses(Random(), 3), 1).stages() or []:
        for sql in (SPAN, draw(stage)):
            plan = [row[3] for row in ledger.db.connection().execute(
                f"EXPLAIN QUERY PLAN {sql}", {"n": 1, "g": 0, "t": 0.0, "at_least": 1, "below": 3})]
            assert not [step for step in plan if step.startswith("SCAN shards")], (sql, plan)
    ledger.close()


def test_indexed_eviction_matches_the_policy_order(tmp_path: Path) -> None:
    """The ledger's index walk picks exactly what the policy picks over the full list."""
    ledger = Ledger(tmp_path / "ledger")
    records = [ShardRecord(id=f"s{i}", filename=f"s{i}.arrow", nbytes=10, rows=1, created=float(i % 7 + i / 100),
                           checksum="0" * 32, units=(f"u{i}",)) for i in range(40)]
    ledger.adopt(records)
    for i in range(0, 40, 3):  # uneven uses and recency
        ledger.leases.release(ledger.leases.snapshot("t", 60).id)
        ledger.drop([f"s{i}"])
        ledger.adopt([records[i]])
    for policy in (Fifo(), Lru(), MostUsed(), MaxUses(Lru(), 3), MinUses(Lru(), 2), MinUses(MaxUses(Fifo(), 4), 3)):
        expected = [r.id for r in policy(ledger.shards(), 95)]
        assert _choose(ledger.db.connection(), policy, 95) == expected, policy
    ledger.close()


def test_auto_low_watermark_keeps_nine_tenths_of_the_budget_for_the_next_epoch_and_rotates(tmp_path: Path) -> None:
    """cache.low_watermark auto, under a trainer that always holds its epoch's shards: making room
    retires more than one shard (the cache keeps rotating at each epoch boundary) but never so much
    that the next epoch gets less than EPOCH_FILL of the budget; the retired shards go when the
    lease ends, within the budget, temp files included."""
    layout = CacheLayout.create(tmp_path / "cache")
    ledger = Ledger(layout.ledger)
    cache = CacheConfig.model_validate({"dir": str(layout.root), "max_bytes": 80 * 256 * 1024, "shard_bytes": "256KiB"})
    assert cache.low_watermark == "auto", "the default"
    budget, stop, table = int(cache.max_bytes), threading.Event(), make_table(320)
    filling = Publisher(layout, ledger, cache, stop, evict=False)
    while filling.publish(table, [f"u{ledger.usage().shards}"], None) is not None:
        pass
    ledger.leases.release(ledger.leases.snapshot("epoch-1", ttl_s=60).id)  # every shard used once: cache.min_uses
    trainer = ledger.leases.snapshot("epoch-2", ttl_s=60)
    published: list[Published | None] = []
    writer = threading.Thread(target=lambda: published.append(
        Publisher(layout, ledger, cache, stop).publish(table, ["new"], None)))
    writer.start()
    try:
        wait_for(lambda: ledger.usage().retiring_bytes)
        shard = trainer.shards[0].nbytes
        assert ledger.usage().retiring_bytes >= 2 * shard, "more than the next shard's room goes"
        probe = ledger.leases.snapshot("epoch-3", ttl_s=60)
        ledger.leases.release(probe.id)
        assert sum(r.nbytes for r in probe.shards) >= EPOCH_FILL * budget
        assert not published, "the retired shards are leased: the publish waits"
    finally:
        ledger.leases.release(trainer.id)
        writer.join(30)
    assert published and published[0] is not None and len(published[0].evicted) >= 2
    assert sum(f.stat().st_size for f in layout.root.rglob("*") if f.is_file()) <= budget
    ledger.close()

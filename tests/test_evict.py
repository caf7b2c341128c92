"""Tests for epochcache.evict: the FIFO policy and lookup by name."""

from __future__ import annotations

import pytest

from epochcache.errors import ConfigError
from epochcache.evict import POLICIES, Fifo, policy_named
from epochcache.ledger import ShardRecord


def record(shard_id: str, created: float, nbytes: int = 100) -> ShardRecord:
    return ShardRecord(
        id=shard_id, filename=f"{shard_id}.arrow", nbytes=nbytes, rows=1, created=created, checksum="0" * 32, units=()
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
        policy_named("lru")
    message = str(info.value)
    assert "cache.eviction" in message
    assert "'lru'" in message
    for name in POLICIES:
        assert name in message

"""epochcache.status: the table people read, from a ledger a test fills directly."""

from __future__ import annotations

from collections.abc import Callable

from epochcache.config import Config
from epochcache.evict import Fifo
from epochcache.layout import CacheLayout
from epochcache.ledger import PUBLISH_GROWTH, Ledger, ShardRecord
from epochcache.status import cache_status, format_status


def _record(i: int) -> ShardRecord:
    return ShardRecord(id=f"s{i}", filename=f"s{i}.arrow", nbytes=1000 * (i + 1), rows=10, created=float(i),
                       checksum="0" * 32, units=(f"u{i}",))


def test_status_reports_shards_leases_evictions_quarantine_and_progress(
    make_config: Callable[..., Config],
) -> None:
    config = make_config("remote", **{"cache.eviction": "lru", "cache.max_uses": 3})
    ledger = Ledger(CacheLayout.create(config.cache.dir).ledger)
    for i in range(4):
        ledger.publish(_record(i), cursor={"pass_": 0, "progress": {"pass": 0, "units done": 4, "units": None}})
    ledger.quarantine("s3", "checksum mismatch")
    assert ledger.make_room(2000, budget=ledger.usage().total + 1000 + PUBLISH_GROWTH, choose=Fifo()) == [_record(0)]
    ledger.snapshot("host:42:epoch3", ttl_s=60)
    ledger.set_daemon_state({"pid": 1, "state": "backpressure", "since": 0.0})

    status = cache_status(config)
    assert (status["shards"], status["samples"], status["shard_bytes"]) == (2, 20, 5000)
    assert status["quarantined_bytes"] == 4000 and status["reserved_bytes"] == 2000
    assert status["bytes"] == 5000 + 4000 + 2000 + status["ledger_bytes"]
    assert [s["id"] for s in status["shard_list"]] == ["s2", "s1"] and status["shard_list"][0]["uses"] == 1
    assert status["evictions"] == {"fifo": 1}
    assert status["daemon"] == "not running (last pid 1)"  # nobody holds the lock
    assert status["progress"] == {"pass": 0, "units done": 4, "units": None}

    table = format_status(status)
    assert "lru, max_uses 3" in table
    assert "host:42:epoch3" in table and "2 shards, age" in table
    assert "1 (1 fifo)" in next(line for line in table.splitlines() if line.startswith("evicted"))
    assert "s3" in table and "checksum mismatch" in table
    assert "pass 0, units done 4, units ?" in table
    assert "newest 2 of 2 shards" in table
    ledger.close()

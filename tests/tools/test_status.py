"""epochcache.tools.status: the table people read, from a ledger a test fills directly."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from epochcache.cache.evict import Fifo
from epochcache.cache.layout import CacheLayout
from epochcache.cache.ledger import PUBLISH_GROWTH, Ledger, ShardRecord
from epochcache.cache.lockfile import exclusive
from epochcache.config import Config
from epochcache.tools.status import cache_status, format_status


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
    ledger.quarantine.add("s3", "checksum mismatch")
    evicted = ledger.make_room(2000, budget=ledger.usage().total + 1000 + PUBLISH_GROWTH, choose=Fifo())
    assert [r.id for r in evicted or ()] == [_record(0).id]
    ledger.leases.snapshot("host:42:epoch3", ttl_s=60)
    ledger.daemon.set_status({"pid": 1, "state": "backpressure", "since": 0.0})

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
    assert "pass 0, units done 4, units ?" in table  # a progress mapping of another shape, as it is
    assert "newest 2 of 2 shards" in table
    ledger.close()


def test_status_shows_the_running_daemons_uptime_error_settings_rate_skips_and_sources(
    make_config: Callable[..., Config],
) -> None:
    config = make_config("remote", **{"cache.max_bytes": "10MB", "cache.shard_bytes": "1MB"})
    layout = CacheLayout.create(config.cache.dir)
    ledger = Ledger(layout.ledger)
    now = time.time()
    ledger.publish(_record(0), cursor={"progress": {
        "big.pass": 1, "big.units_done": 17, "big.objects_done": 16, "big.objects_total": 32,
        "small.pass": 0, "small.units_done": 3, "small.objects_done": 2, "small.objects_total": None,
        "node_rank": 0, "num_nodes": 1, "units_skipped": 2}})
    ledger.daemon.set_skipped("s3://b/x.parquet:3", {"path": "s3://b/x.parquet", "index": 3, "pass": 0,
                                                     "error": "corrupt page: CRC mismatch"})
    ledger.daemon.set_status({"pid": os.getpid(), "state": "fetching", "since": now - 5})
    ledger.daemon.update_status({
        "started": now - 3725, "fetched_bytes": 3725 * 2_000_000, "units_unread": 1,
        "last_error": "remote unreachable: http://127.0.0.1:9/ (connection refused)", "last_error_at": now - 60,
        "settings": {"cache": {"max_bytes": 20_000_000}, "source": {"storage_options": {"secret": "very-secret"}}},
    })
    ledger.close()
    with exclusive(layout.lock):  # this process is the daemon, as far as the lock tells
        status = cache_status(config)
    detail = status["daemon_detail"]
    assert status["daemon"].startswith(f"running pid {os.getpid()}: fetching for 5s, up 1h02m")
    assert detail["uptime_s"] >= 3725 and detail["in_state_s"] < 60
    assert abs(detail["fetch_bytes_per_s"] - 2_000_000) < 10_000
    assert status["max_bytes"] == 20_000_000, "the running daemon's budget, not the file's 10MB"
    assert status["skipped_units"] == 1 and status["skipped"][0]["reason"] == "corrupt page: CRC mismatch"
    assert "very-secret" not in json.dumps(status)

    table = format_status(status)
    at = time.strftime("%H:%M:%S", time.localtime(now - 60))
    assert f"last error     remote unreachable: http://127.0.0.1:9/ (connection refused) (latest {at})" in table
    assert "MB/s since start" in table
    assert next(line for line in table.splitlines() if line.startswith("units unread")).split()[2] == "1"
    assert "cache.max_bytes=20000000" in table and "storage_options" not in table
    assert detail["settings"]["source"]["storage_options"] == {"secret": "***"}
    assert "s3://b/x.parquet:3" in table and "corrupt page: CRC mismatch" in table
    assert "pass 1: 17 units cached this pass, 16 of 32 objects finished" in table
    assert "pass 0: 3 units cached this pass, 2 of ? objects finished" in table
    assert "of 20.0MB" in table


def test_status_never_creates_a_cache(make_config: Callable[..., Config]) -> None:
    import pytest

    from epochcache.errors import CacheError

    config = make_config("remote")
    with pytest.raises(CacheError, match="does not exist"):
        cache_status(config)
    assert not os.path.exists(config.cache.dir)

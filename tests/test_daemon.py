"""SyncDaemon: fills to the budget, rotates, resumes its cursor, stops cleanly, one per cache dir."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import fsspec
import pytest
import yaml

from conftest import DaemonThread, UnitLog, wait_for, write_parquet_dataset
from epochcache import DaemonRunningError, Ledger, SyncDaemon
from epochcache.config import Config
from epochcache.daemon import StopReason
from epochcache.layout import TMP_SUFFIX, CacheLayout
from epochcache.shards import verify_shard

UNITS = 6 * 4


@pytest.fixture
def remote(tmp_path: Path) -> str:
    root = str(tmp_path / "remote")
    write_parquet_dataset(fsspec.filesystem("file"), root, files=6, rows_per_file=128, rows_per_group=32)
    return root


def _ledger(config: Config) -> Ledger:
    return Ledger(CacheLayout(Path(config.cache.dir)).ledger)


def _assert_disk_matches_ledger(config: Config) -> None:
    layout = CacheLayout(Path(config.cache.dir))
    ledger = Ledger(layout.ledger)
    records = ledger.shards()
    ledger.close()
    on_disk = sorted(p.name for p in layout.shards.iterdir())
    assert on_disk == sorted(r.filename for r in records), "no temp or orphan files; no missing files"
    for record in records:
        verify_shard(layout.shards / record.filename, record.checksum)


def test_once_stops_when_the_budget_is_full(remote: str, make_config: Callable[..., Config]) -> None:
    config = make_config(remote, **{"cache.max_bytes": "700KB", "cache.shard_bytes": "100KB"})
    report = SyncDaemon(config, progress=False).run(once=True)
    assert report.reason is StopReason.BUDGET_FULL
    assert 0 < report.shards_published and report.evicted == 0
    ledger = _ledger(config)
    assert ledger.usage().total <= int(config.cache.max_bytes)
    ledger.close()
    _assert_disk_matches_ledger(config)


def test_once_with_room_caches_one_whole_pass_exactly_once(remote: str, make_config: Callable[..., Config]) -> None:
    config = make_config(remote, **{"cache.max_bytes": "20MB", "cache.shard_bytes": "100KB"})
    log = UnitLog()
    report = log.daemon(config).run(once=True)
    assert report.reason is StopReason.EXHAUSTED
    assert len(log.published) == len(set(log.published)) == UNITS == report.units_published
    assert report.samples_published == UNITS * 32
    again = SyncDaemon(config, progress=False).run(once=True)
    assert again.units_fetched == 0, "every unit is cached: the next pass fetches nothing"


def test_restart_resumes_the_cursor(remote: str, make_config: Callable[..., Config]) -> None:
    small = make_config(remote, **{"cache.max_bytes": "700KB", "cache.shard_bytes": "100KB"})
    first, second = UnitLog(), UnitLog()
    first.daemon(small).run(once=True)
    roomy = make_config(remote, **{"cache.max_bytes": "20MB", "cache.shard_bytes": "100KB"})
    second.daemon(roomy).run(once=True)
    assert first.published and set(second.fetched).isdisjoint(first.published)
    published = first.published + second.published
    assert len(published) == len(set(published)) == UNITS


def test_continuous_sync_rotates_within_the_budget(remote: str, make_config: Callable[..., Config]) -> None:
    config = make_config(remote, **{"cache.max_bytes": "700KB", "cache.shard_bytes": "100KB"})
    runner = DaemonThread(SyncDaemon(config, progress=False))
    ledger = _ledger(config)
    wait_for(lambda: ledger.counters().get("evicted", 0) >= 3 or runner.error)
    report = runner.stop()
    assert report.evicted >= 3
    assert ledger.usage().total <= int(config.cache.max_bytes)
    cached = [unit for record in ledger.shards() for unit in record.units]
    assert len(cached) == len(set(cached)), "a unit is never cached twice"
    ledger.close()
    _assert_disk_matches_ledger(config)


def test_leased_shards_are_never_evicted(remote: str, make_config: Callable[..., Config]) -> None:
    config = make_config(remote, **{"cache.max_bytes": "700KB", "cache.shard_bytes": "100KB"})
    SyncDaemon(config, progress=False).run(once=True)
    ledger = _ledger(config)
    lease = ledger.snapshot("test-trainer", ttl_s=600)
    leased_paths = [CacheLayout(Path(config.cache.dir)).shards / r.filename for r in lease.shards]
    runner = DaemonThread(SyncDaemon(config, progress=False))
    # the daemon needs room, finds only leased shards, marks the oldest retiring and waits
    wait_for(lambda: len(ledger.snapshot("probe", 1).shards) < len(lease.shards) or runner.error)
    assert all(p.exists() for p in leased_paths) and ledger.counters().get("evicted", 0) == 0
    ledger.release(lease.id)
    wait_for(lambda: ledger.counters().get("evicted", 0) > 0 or runner.error)
    runner.stop()
    assert not leased_paths[0].exists(), "once the lease ended, the oldest (retiring) shard went first"
    ledger.close()


def test_a_second_daemon_on_the_same_dir_is_refused(remote: str, make_config: Callable[..., Config]) -> None:
    config = make_config(remote, **{"cache.max_bytes": "700KB", "cache.shard_bytes": "100KB", "sampler.max_bytes_per_s": "100KB"})
    runner = DaemonThread(SyncDaemon(config, progress=False))
    ledger = _ledger(config)
    wait_for(lambda: ledger.usage().shards > 0 or runner.error)
    with pytest.raises(DaemonRunningError, match=f"pid {os.getpid()}"):
        SyncDaemon(config, progress=False).run(once=True)
    runner.stop()
    ledger.close()


def test_sigterm_stops_the_cli_daemon_cleanly(remote: str, tmp_path: Path) -> None:
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump({
        "source": {"url": remote},
        "cache": {"dir": str(tmp_path / "cache"), "max_bytes": "20MB", "shard_bytes": "100KB"},
        "sampler": {"max_bytes_per_s": "300KB"},
    }))
    proc = subprocess.Popen([sys.executable, "-m", "epochcache", "sync", "--config", str(config_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        layout = CacheLayout.create(tmp_path / "cache")
        wait_for(lambda: any(layout.shards.glob("*.arrow")) or proc.poll() is not None)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    assert "received SIGTERM" in output and "Traceback" not in output
    assert not list(layout.shards.glob(f"*{TMP_SUFFIX}"))
    config = Config.model_validate({"source": {"url": remote}, "cache": {"dir": str(tmp_path / "cache"), "max_bytes": "20MB", "shard_bytes": "100KB"}})
    _assert_disk_matches_ledger(config)

"""SyncDaemon: fills to the budget, rotates, resumes its cursor, stops cleanly, one per cache dir."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import DaemonThread, UnitLog, make_table, wait_for, write_parquet_dataset

from epochcache import DaemonRunningError, Ledger, ShardRecord, SyncDaemon
from epochcache.cache.layout import TMP_SUFFIX, CacheLayout, bytes_under
from epochcache.cache.shards import verify_shard
from epochcache.config import Config, load_config
from epochcache.sync.daemon import StopReason

FILES, GROUPS, ROWS_PER_GROUP = 6, 4, 256  # units of ~200 KB decoded, ~5 MB in all
UNITS = FILES * GROUPS
SMALL = {"cache.max_bytes": "2.5MB", "cache.shard_bytes": "450KB"}  # room for ~4 of 12 shards
ROOMY = {"cache.max_bytes": "50MB", "cache.shard_bytes": "450KB"}


@pytest.fixture
def remote(tmp_path: Path) -> str:
    root = str(tmp_path / "remote")
    write_parquet_dataset(fsspec.filesystem("file"), root, FILES, GROUPS * ROWS_PER_GROUP, ROWS_PER_GROUP)
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
    config = make_config(remote, **SMALL)
    report = SyncDaemon(config, progress=False).run(once=True)
    assert report.reason is StopReason.BUDGET_FULL
    assert 0 < report.shards_published and report.evicted == 0
    ledger = _ledger(config)
    assert ledger.usage().total <= int(config.cache.max_bytes)
    ledger.close()
    _assert_disk_matches_ledger(config)


def test_once_with_room_caches_one_whole_pass_exactly_once(remote: str, make_config: Callable[..., Config]) -> None:
    config = make_config(remote, **ROOMY)
    log = UnitLog()
    report = log.daemon(config).run(once=True)
    assert report.reason is StopReason.EXHAUSTED
    assert len(log.published) == len(set(log.published)) == UNITS == report.units_published
    assert report.samples_published == UNITS * ROWS_PER_GROUP
    again = SyncDaemon(config, progress=False).run(once=True)
    assert again.units_fetched == 0, "every unit is cached: the next pass fetches nothing"


def test_restart_resumes_the_cursor(remote: str, make_config: Callable[..., Config]) -> None:
    small = make_config(remote, **SMALL)
    first, second = UnitLog(), UnitLog()
    first.daemon(small).run(once=True)
    roomy = make_config(remote, **ROOMY)
    second.daemon(roomy).run(once=True)
    assert first.published and set(second.fetched).isdisjoint(first.published)
    published = first.published + second.published
    assert len(published) == len(set(published)) == UNITS


def test_continuous_sync_rotates_within_the_budget(remote: str, make_config: Callable[..., Config]) -> None:
    config = make_config(remote, **SMALL, **{"cache.min_uses": 0})  # rotate though no epoch uses the shards
    runner = DaemonThread(SyncDaemon(config, progress=False))
    ledger = _ledger(config)
    wait_for(lambda: ledger.counters.all().get("evicted", 0) >= 3 or runner.error)
    report = runner.stop()
    assert report.evicted >= 3
    assert ledger.usage().total <= int(config.cache.max_bytes)
    cached = [unit for record in ledger.shards() for unit in record.units]
    assert len(cached) == len(set(cached)), "a unit is never cached twice"
    ledger.close()
    _assert_disk_matches_ledger(config)


def test_with_no_epoch_the_daemon_fills_the_budget_once_and_waits(
    remote: str, make_config: Callable[..., Config]
) -> None:
    """cache.min_uses (default 1): no shard goes before an epoch used it, so what the daemon fetches
    is bounded by training; an epoch's snapshot lets it rotate again."""
    config = make_config(remote, **SMALL)
    fetched: list[str] = []
    runner = DaemonThread(SyncDaemon(config, progress=False, on_fetch=lambda unit: fetched.append(unit.key)))
    ledger = _ledger(config)
    wait_for(lambda: (ledger.daemon.status() or {}).get("state") == "waiting for training" or runner.error)
    published_units = sum(len(r.units) for r in ledger.shards())
    # At most the reads in flight and one shard's units beyond what is published: fetching has stopped.
    assert len(fetched) <= published_units + config.sampler.concurrency + 8, (len(fetched), published_units)
    assert ledger.counters.all().get("evicted", 0) == 0
    ledger.leases.release(ledger.leases.snapshot("epoch-0", ttl_s=60).id)  # an epoch used every shard
    wait_for(lambda: ledger.counters.all().get("evicted", 0) > 0 or runner.error)
    runner.stop()
    assert ledger.usage().total <= int(config.cache.max_bytes)
    ledger.close()


def _probe(ledger: Ledger) -> list[ShardRecord]:
    """The shards a new epoch would get now. The probe's lease is released at once: a lease whose owner
    (this process) is alive never expires, and would itself hold every shard."""
    lease = ledger.leases.snapshot("probe", ttl_s=1)
    ledger.leases.release(lease.id)
    return list(lease.shards)


def test_leased_shards_are_never_evicted(remote: str, make_config: Callable[..., Config]) -> None:
    config = make_config(remote, **SMALL)
    SyncDaemon(config, progress=False).run(once=True)
    ledger = _ledger(config)
    lease = ledger.leases.snapshot("test-trainer", ttl_s=600)
    leased_paths = [CacheLayout(Path(config.cache.dir)).shards / r.filename for r in lease.shards]
    runner = DaemonThread(SyncDaemon(config, progress=False))
    # the daemon needs room, finds only leased shards, marks the oldest retiring and waits
    wait_for(lambda: len(_probe(ledger)) < len(lease.shards) or runner.error)
    assert all(p.exists() for p in leased_paths) and ledger.counters.all().get("evicted", 0) == 0
    ledger.leases.release(lease.id)
    wait_for(lambda: ledger.counters.all().get("evicted", 0) > 0 or runner.error)
    runner.stop()
    assert not leased_paths[0].exists(), "once the lease ended, the oldest (retiring) shard went first"
    ledger.close()


def test_a_second_daemon_on_the_same_dir_is_refused(remote: str, make_config: Callable[..., Config]) -> None:
    config = make_config(remote, **SMALL, **{"sampler.max_bytes_per_s": "500KB"})
    runner = DaemonThread(SyncDaemon(config, progress=False))
    ledger = _ledger(config)
    wait_for(lambda: ledger.usage().shards > 0 or runner.error)
    with pytest.raises(DaemonRunningError, match=f"pid {os.getpid()}"):
        SyncDaemon(config, progress=False).run(once=True)
    runner.stop()
    ledger.close()


@pytest.mark.slow  # (a CLI process: 1.5 s)
def test_sigterm_stops_the_cli_daemon_cleanly(remote: str, tmp_path: Path) -> None:
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump({
        "source": {"url": remote},
        "cache": {"dir": str(tmp_path / "cache"), "max_bytes": "50MB", "shard_bytes": "450KB"},
        "sampler": {"max_bytes_per_s": "1MB"},
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
    config = Config.model_validate({"source": {"url": remote}, "cache": {"dir": str(tmp_path / "cache")}})
    _assert_disk_matches_ledger(config)


def test_a_restarted_daemon_keeps_the_budget(remote: str, make_config: Callable[..., Config]) -> None:
    config = make_config(remote, **SMALL)
    budget = int(config.cache.max_bytes)
    assert SyncDaemon(config, progress=False).run(once=True).reason is StopReason.BUDGET_FULL
    assert bytes_under(Path(config.cache.dir)) <= budget
    # SQLite removed its WAL when the daemon closed the ledger: that must not look like free room
    again = SyncDaemon(config, progress=False).run(once=True)
    assert again.reason is StopReason.BUDGET_FULL and again.shards_published == 0
    assert bytes_under(Path(config.cache.dir)) <= budget


def test_a_changed_source_starts_its_own_order(tmp_path: Path, make_config: Callable[..., Config]) -> None:
    fs = fsspec.filesystem("file")
    write_parquet_dataset(fs, str(tmp_path / "a"), files=2, rows_per_file=64, rows_per_group=32)
    write_parquet_dataset(fs, str(tmp_path / "b"), files=3, rows_per_file=64, rows_per_group=32)
    SyncDaemon(make_config(str(tmp_path / "a"), **ROOMY), progress=False).run(once=True)
    log = UnitLog()
    report = log.daemon(make_config(str(tmp_path / "b"), **ROOMY)).run(once=True)
    assert report.reason is StopReason.EXHAUSTED
    assert len(log.published) == 6 and all(key.startswith(str(tmp_path / "b")) for key in log.published)


@pytest.mark.slow  # (a CLI process: 2 s)
def test_verbose_logging_never_shows_credentials(
    s3: Any, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    write_parquet_dataset(s3, f"{bucket}/data", files=1, rows_per_file=64, rows_per_group=32)
    # moto accepts any credentials: these values must never appear in the output
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump({
        "source": {"url": f"s3://{bucket}/data", "storage_options": {
            "key": "AKIAEXAMPLEKEYID0001", "secret": "very-secret-value-0001", "token": "session-token-0001",
            "client_kwargs": {"endpoint_url": s3_endpoint}}},
        "cache": {"dir": str(tmp_path / "cache")},
    }))
    result = subprocess.run(
        [sys.executable, "-m", "epochcache", "-v", "sync", "--config", str(config_path), "--once"],
        capture_output=True, text=True, timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "DEBUG epochcache" in output, "verbose mode shows our own debug lines"
    for value in ("very-secret-value-0001", "session-token-0001", "AKIAEXAMPLEKEYID0001"):
        assert value not in output


def test_the_published_cursor_carries_sampler_progress(remote: str, make_config: Callable[..., Config]) -> None:
    config = make_config(remote, **SMALL, **{"sampler.mix_units": 2})
    assert SyncDaemon(config, progress=False).run(once=True).reason is StopReason.BUDGET_FULL
    ledger = _ledger(config)
    progress = ledger.daemon.cursor()["progress"]
    ledger.close()
    assert progress["pass"] == 0 and progress["objects_total"] == FILES
    assert progress["objects_done"] < FILES and progress["objects_done"] % 2 == 0, progress


def test_a_stop_from_the_publish_hook_publishes_nothing_more(remote: str, make_config: Callable[..., Config]) -> None:
    config = make_config(remote, **{**ROOMY, "cache.shard_bytes": "64KiB"})  # one unit per shard: many queued
    stop = threading.Event()
    report = SyncDaemon(config, progress=False, on_publish=lambda _: stop.set()).run(once=True, stop=stop)
    ledger = _ledger(config)
    shards = ledger.shards()
    ledger.close()
    assert report.reason is StopReason.STOPPED
    assert len(shards) == report.shards_published == 1, "shards queued for the writer are dropped on stop"
    _assert_disk_matches_ledger(config)


def test_two_nodes_cache_disjoint_halves_of_a_pass(remote: str, tmp_path: Path) -> None:
    logs = []
    for rank in (0, 1):
        config = load_config(None, {"source.url": remote, "cache.dir": str(tmp_path / f"node{rank}"), **ROOMY,
                                    "sampler.node_rank": rank, "sampler.num_nodes": 2})
        log = UnitLog()
        assert log.daemon(config).run(once=True).reason is StopReason.EXHAUSTED
        logs.append(log.published)
    assert logs[0] and logs[1] and set(logs[0]).isdisjoint(logs[1]), "no unit fetched by both nodes"
    assert len(logs[0]) + len(logs[1]) == UNITS


def test_an_empty_cache_gets_a_one_unit_first_shard(remote: str, make_config: Callable[..., Config]) -> None:
    config = make_config(remote, **ROOMY)
    SyncDaemon(config, progress=False).run(once=True)
    ledger = _ledger(config)
    first, *rest = ledger.shards()
    ledger.close()
    assert len(first.units) == 1, "a trainer started with the daemon waits for one unit, not a shard"
    assert rest and all(len(record.units) > 1 for record in rest[:-1]), "then shards fill to cache.shard_bytes"


def _waits_5_then_10_s(caplog: pytest.LogCaptureFixture) -> None:
    """Wait for the walk's first two idle waits, which must be of 5 s, then 10 s."""
    def idle() -> list[str]:
        return [m for m in caplog.messages if "listing it again in" in m]

    wait_for(lambda: len(idle()) >= 2, timeout=60)
    assert idle()[0].endswith("in 5s") and idle()[1].endswith("in 10s")


@pytest.mark.slow  # (15 s: two idle waits, of 5 s and 10 s)
def test_an_idle_daemon_lists_ever_less_often_yet_refills_at_once_a_shard_let_go(
    remote: str, make_config: Callable[..., Config], caplog: pytest.LogCaptureFixture
) -> None:
    """A fully cached remote is listed again after 5 s, then 10 s, 20 s... up to 5 minutes (it was
    listed every 5 s for as long as the daemon ran: a thousand LISTs each time for a million objects);
    a shard leaving the cache meanwhile (quarantined here) has its units read again within seconds."""
    caplog.set_level(logging.INFO, logger="epochcache.sync.walk")
    config = make_config(remote, **ROOMY)
    daemon = DaemonThread(SyncDaemon(config, progress=False))
    ledger = _ledger(config)
    try:
        _waits_5_then_10_s(caplog)
        victim = ledger.shards()[0]
        assert ledger.quarantine.add(victim.id, "damaged") is not None
        wait_for(lambda: ledger.cached_units(victim.units) == set(victim.units), timeout=8.0)
        assert any("let 1 shards go" in m for m in caplog.messages), "woken by the shard let go, not the listing"
    finally:
        ledger.close()
        daemon.stop()


@pytest.mark.slow  # (6 s: one idle wait)
def test_an_idle_daemon_reads_an_object_added_while_it_waits_once_the_wait_is_over(
    remote: str, make_config: Callable[..., Config], caplog: pytest.LogCaptureFixture
) -> None:
    """The listing comes after the wait, not before it: the walk listed the next pass at once and then
    waited, so an object added during a wait of 5 s was read only after the 10 s wait after it."""
    caplog.set_level(logging.INFO, logger="epochcache.sync.walk")
    config = make_config(remote, **ROOMY)
    daemon = DaemonThread(SyncDaemon(config, progress=False))
    ledger = _ledger(config)
    try:
        wait_for(lambda: any(m.endswith("listing it again in 5s") for m in caplog.messages), timeout=60)
        with fsspec.open(f"{remote}/part-new.parquet", "wb") as f:
            pq.write_table(make_table(ROWS_PER_GROUP, 10**6), f)
        wait_for(lambda: ledger.cached_units([f"{remote}/part-new.parquet#0"]), timeout=9.0)
    finally:
        ledger.close()
        daemon.stop()


@pytest.mark.slow  # (11 s: two idle waits)
def test_a_unit_that_fails_for_good_does_not_keep_an_idle_daemon_listing(
    remote: str, make_config: Callable[..., Config], caplog: pytest.LogCaptureFixture
) -> None:
    """A damaged object, read again (and failing) at every pass, must not count as work left: the
    daemon still waits 5 s, then 10 s, between listings of a remote otherwise cached."""
    caplog.set_level(logging.INFO, logger="epochcache.sync.walk")
    with fsspec.open(f"{remote}/part-bad.parquet", "wb") as f:  # (its footer intact, a page damaged)
        pq.write_table(make_table(ROWS_PER_GROUP, 10**6), f, write_page_checksum=True, compression="none")
    with fsspec.open(f"{remote}/part-bad.parquet", "rb") as f:
        damaged = bytearray(f.read())
    damaged[len(damaged) // 4] ^= 0xFF
    with fsspec.open(f"{remote}/part-bad.parquet", "wb") as f:
        f.write(bytes(damaged))
    config = make_config(remote, **ROOMY, **{"sampler.backoff_s": 0.001, "sampler.backoff_max_s": 0.01})
    daemon = DaemonThread(SyncDaemon(config, progress=False))
    try:
        _waits_5_then_10_s(caplog)
        assert any("part-bad.parquet#0" in m for m in caplog.messages), "its unit was tried, and failed"
    finally:
        daemon.stop()

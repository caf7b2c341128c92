"""The daemon through faults: a 10% fault rate on the wire, vanished objects, permanent errors."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pytest
import yaml
from conftest import ITEM_SHAPE, UnitLog, write_parquet_dataset
from faultproxy import KINDS, FaultProxy

import epochcache.sync.daemon as daemon_module
from epochcache import Ledger, SourceError, SyncDaemon
from epochcache.cache.layout import CacheLayout
from epochcache.cache.shards import verify_shard
from epochcache.config import Config
from epochcache.sources.retry import Retrier, TruncatedReadError, is_transient
from epochcache.sync.daemon import StopReason

FILES, GROUPS, ROWS_PER_GROUP = 8, 6, 64
ROWS_PER_FILE = GROUPS * ROWS_PER_GROUP
ROOMY = {"cache.max_bytes": "50MB", "cache.shard_bytes": "200KB"}
FAST_RETRIES = {"sampler.backoff_s": 0.01, "sampler.backoff_max_s": 0.1, "sampler.max_attempts": 8,
                "sampler.request_timeout_s": 1.0}


def _cached_rows(config: Config) -> tuple[Ledger, list[tuple[str, pa.Table]]]:
    layout = CacheLayout(Path(config.cache.dir))
    ledger = Ledger(layout.ledger)
    tables = []
    for record in ledger.shards():
        verify_shard(layout.shards / record.filename, record.checksum)
        tables.append((record.id, pa.ipc.open_file(layout.shards / record.filename).read_all()))
    return ledger, tables


def _assert_rows_intact(table: pa.Table) -> None:
    """Every row is the sample its key names: id from (file, row), pixels all equal id % 251."""
    keys = table.column("__key__").to_pylist()
    ids = table.column("id").to_numpy()
    for key, sample_id in zip(keys, ids):
        path, _, row = key.rpartition(":")
        file_number = int(path.rsplit("part-", 1)[1].split(".")[0])
        assert sample_id == file_number * ROWS_PER_FILE + int(row), key
    images = table.column("image").combine_chunks().to_numpy_ndarray().reshape(len(ids), -1)
    assert images.shape[1] == int(np.prod(ITEM_SHAPE))
    assert (images == (ids % 251).astype(np.uint8)[:, None]).all(), "a corrupt sample was cached"


@pytest.mark.slow
@pytest.mark.parametrize("whole_object_bytes, rate, seed", [(0, 0.10, 7), ("8MB", 0.35, 2)],
                         ids=["ranged", "whole"])
def test_ten_percent_faults_every_unit_published_once_or_skipped(
    s3: Any, bucket: str, s3_endpoint: str, make_config: Callable[..., Config], caplog: pytest.LogCaptureFixture,
    whole_object_bytes: int | str, rate: float, seed: int, request: pytest.FixtureRequest
) -> None:
    """Reads of units in ranges, or of small objects whole (one GET for all their units: over those
    fewer requests, a higher rate and a seed whose faults still hit every kind)."""
    write_parquet_dataset(s3, f"{bucket}/data", FILES, ROWS_PER_FILE, ROWS_PER_GROUP)
    proxy = FaultProxy(s3_endpoint, rate=rate, kinds=KINDS, delay_s=2.0, seed=seed)
    request.addfinalizer(proxy.close)
    # moto accepts any credentials: these values must appear in none of our log lines
    config = make_config(f"s3://{bucket}/data", **ROOMY, **FAST_RETRIES, **{
        "sampler.whole_object_bytes": whole_object_bytes,
        "source.storage_options": {"key": "AKIAFAULTKEY0003", "secret": "fault-secret-0003",
                                   "client_kwargs": {"endpoint_url": proxy.url}}})
    log = UnitLog()
    with caplog.at_level(logging.DEBUG, logger="epochcache"):  # all of ours, as `sync -v` shows
        report = log.daemon(config).run(once=True)
    assert "attempt 1 failed" in caplog.text, "retries are logged"
    assert "fault-secret-0003" not in caplog.text and "AKIAFAULTKEY0003" not in caplog.text

    assert report.reason is StopReason.EXHAUSTED
    print("faults injected:", dict(proxy.faults), "of", proxy.requests, "requests")
    assert set(proxy.faults) == set(KINDS), proxy.faults  # the run really went through every kind of fault
    ledger, tables = _cached_rows(config)
    skipped = set(ledger.daemon.skipped())
    counters, cursor = ledger.counters.all(), ledger.daemon.cursor()
    ledger.close()
    assert len(log.published) == len(set(log.published)), "no unit published twice"
    all_units = {f"{bucket}/data/part-{f:03d}.parquet#{g}" for f in range(FILES) for g in range(GROUPS)}
    assert set(log.published) | skipped == all_units and not set(log.published) & skipped
    assert counters.get("retries", 0) + counters.get("give_ups", 0) >= 1
    for _, table in tables:
        _assert_rows_intact(table)
    assert sum(t.num_rows for _, t in tables) == len(log.published) * ROWS_PER_GROUP
    assert cursor["progress"] == {"pass": 1, "remote_rows": FILES * ROWS_PER_FILE, "units_done": 0,
                                  "objects_done": 0, "objects_total": None, "node_rank": 0, "num_nodes": 1,
                                  "units_skipped": report.units_skipped}, "pass 0 done"


def test_a_store_that_throttles_in_its_own_words_is_waited_out_not_fatal(
    s3: Any, bucket: str, s3_endpoint: str, make_config: Callable[..., Config], request: pytest.FixtureRequest
) -> None:
    """MinIO's 503 SlowDownRead, which s3fs raises as OSError EIO, on listings and GETs alike: the pass
    completes with every unit cached, as with AWS's SlowDown."""
    write_parquet_dataset(s3, f"{bucket}/throttled", 2, ROWS_PER_FILE, ROWS_PER_GROUP)
    proxy = FaultProxy(s3_endpoint, rate=0.3, kinds=("503",), seed=4, throttle=(503, "SlowDownRead"))
    request.addfinalizer(proxy.close)
    config = make_config(f"s3://{bucket}/throttled", **ROOMY, **FAST_RETRIES, **{
        "source.storage_options": {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": proxy.url}}})
    report = SyncDaemon(config, progress=False).run(once=True)
    assert report.reason is StopReason.EXHAUSTED and proxy.faults["503"] > 0
    assert report.samples_published == 2 * ROWS_PER_FILE and report.units_unread == 0


def test_an_object_deleted_mid_pass_is_skipped_and_the_pass_completes(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    root = tmp_path / "remote"
    paths = write_parquet_dataset(fsspec.filesystem("file"), str(root), FILES, ROWS_PER_FILE, ROWS_PER_GROUP)
    config = make_config(str(root), **ROOMY, **FAST_RETRIES, **{"sampler.mix_units": 2})
    log = UnitLog()
    daemon = log.daemon(config)
    deleted: list[str] = []

    def delete_the_rest_once(unit: Any) -> None:  # once the walk is under way, a file disappears
        if not deleted:
            victim = next(p for p in paths if p != unit.obj.path)
            Path(victim).unlink()
            deleted.append(victim)

    daemon.on_fetch = delete_the_rest_once
    report = daemon.run(once=True)
    assert report.reason is StopReason.EXHAUSTED
    ledger, tables = _cached_rows(config)
    counters, skipped = ledger.counters.all(), ledger.daemon.skipped()
    ledger.close()
    assert not skipped, "a vanished object is dropped at the end of the pass, not kept for retry"
    assert counters.get("objects_missing", 0) >= 1
    survivors = {key for key in log.published if not key.startswith(deleted[0])}
    assert len(survivors) == (FILES - 1) * GROUPS
    again = SyncDaemon(config, progress=False).run(once=True)  # a restart does not trip over the hole
    assert again.reason is StopReason.EXHAUSTED


def _sync_once(config_path: Path) -> tuple[int, str]:
    result = subprocess.run([sys.executable, "-m", "epochcache", "sync", "--config", str(config_path), "--once"],
                            capture_output=True, text=True, timeout=120)
    return result.returncode, result.stdout + result.stderr


def _s3_config(tmp_path: Path, url: str, s3_endpoint: str) -> Path:
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump({
        "source": {"url": url, "storage_options": {
            "key": "AKIAEXAMPLEKEYID0002", "secret": "very-secret-value-0002",
            "client_kwargs": {"endpoint_url": s3_endpoint}}},
        "cache": {"dir": str(tmp_path / "cache")},
        # (a corrupt unit is retried, and again at the pass end: real backoffs would cost ~12 s here)
        "sampler": {"backoff_s": 0.001, "backoff_max_s": 0.01},
    }))
    return config_path


@pytest.mark.slow  # (a CLI process: 2 s)
def test_a_permanent_error_stops_with_one_line_naming_the_url(s3_endpoint: str, tmp_path: Path) -> None:
    url = "s3://no-such-bucket-epochcache/data"
    code, output = _sync_once(_s3_config(tmp_path, url, s3_endpoint))
    assert code == 2, output
    errors = [line for line in output.splitlines() if "error" in line]
    assert len(errors) == 1 and "no-such-bucket-epochcache" in errors[0], output
    assert "Traceback" not in output
    assert "very-secret-value-0002" not in output and "AKIAEXAMPLEKEYID0002" not in output


@pytest.mark.slow  # (a CLI process: 2-3 s)
def test_a_corrupt_object_is_skipped_with_lines_naming_it(
    s3: Any, bucket: str, s3_endpoint: str, tmp_path: Path
) -> None:
    s3.pipe(f"{bucket}/bad/broken.parquet", b"PAR1" + b"x" * 100 + (50).to_bytes(4, "little") + b"PAR1")
    code, output = _sync_once(_s3_config(tmp_path, f"s3://{bucket}/bad", s3_endpoint))
    assert code == 3, output  # the pass completed; a unit was skipped and not read again
    skips = [line for line in output.splitlines() if "CorruptObjectError" in line]
    assert skips and all("broken.parquet" in line for line in skips), output
    assert "Traceback" not in output
    assert "very-secret-value-0002" not in output and "AKIAEXAMPLEKEYID0002" not in output


def test_a_missing_bucket_is_a_source_error_naming_it(
    s3_options: dict[str, Any], make_config: Callable[..., Config]
) -> None:
    config = make_config("s3://no-such-bucket-epochcache/data", **{"source.storage_options": s3_options})
    with pytest.raises(SourceError, match="no-such-bucket-epochcache"):
        SyncDaemon(config, progress=False).run(once=True)


def test_retrier_counts_retries_and_give_ups() -> None:
    counts: list[str] = []
    attempts: list[int] = []

    def flaky() -> bytes:
        attempts.append(1)
        raise TruncatedReadError("cut short")

    retrier = Retrier(max_attempts=3, backoff_s=0.001, backoff_max_s=0.002, count=counts.append)
    with pytest.raises(Exception, match="still failing after retries") as info:
        retrier.call(flaky, what="s3://b/k bytes 0-10")
    assert "s3://b/k" in str(info.value)
    assert len(attempts) == 3 and counts == ["retries", "retries", "give_ups"]
    with pytest.raises(PermissionError):  # permanent: one attempt, no retry counted
        retrier.call(_denied, what="x")
    assert counts == ["retries", "retries", "give_ups"]


def _denied() -> None:
    raise PermissionError("Access Denied")


@pytest.mark.parametrize("exc, transient", [
    (TimeoutError(), True), (ConnectionResetError(), True), (OSError(16, "SlowDown"), True),
    (FileNotFoundError(), False), (PermissionError(), False), (SourceError("bad"), False), (ValueError(), False),
])
def test_transient_classification(exc: BaseException, transient: bool) -> None:
    assert is_transient(exc) is transient


@pytest.fixture
def flaky(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, dict[str, int]]:
    """A local remote whose unit ``part-002.parquet#3`` fails with a reset for the next ``failures["left"]``
    reads (fault injection into the daemon's sources): ``(its key, failures)``; none fail until set."""
    root = tmp_path / "remote"
    write_parquet_dataset(fsspec.filesystem("file"), str(root), FILES, ROWS_PER_FILE, ROWS_PER_GROUP)
    flaky_key = f"{root}/part-002.parquet#3"
    failures = {"left": 0}
    open_source = daemon_module.open_source

    def open_flaky(*args: Any) -> Any:
        source = open_source(*args)
        read = source.read

        def flaky_read(unit: Any) -> pa.Table:
            if unit.key == flaky_key and failures["left"] > 0:
                failures["left"] -= 1
                raise ConnectionResetError("injected reset")
            return read(unit)

        monkeypatch.setattr(source, "read", flaky_read)
        return source

    monkeypatch.setattr(daemon_module, "open_source", open_flaky)
    return flaky_key, failures


def test_a_unit_that_keeps_failing_is_skipped_then_retried_at_the_end_of_the_pass(
    tmp_path: Path, make_config: Callable[..., Config], flaky: tuple[str, dict[str, int]]
) -> None:
    flaky_key, failures = flaky
    config = make_config(str(tmp_path / "remote"), **ROOMY, **{"sampler.backoff_s": 0.001, "sampler.max_attempts": 3})
    failures["left"] = 3  # exactly max_attempts: the walk gives up on it, the end-of-pass retry reads it
    log = UnitLog()
    report = log.daemon(config).run(once=True)
    ledger = Ledger(CacheLayout(Path(config.cache.dir)).ledger)
    counters, skipped = ledger.counters.all(), ledger.daemon.skipped()
    ledger.close()
    assert report.reason is StopReason.EXHAUSTED and report.units_skipped == 1
    assert counters["retries"] == 2 and counters["give_ups"] == 1 and counters["units_skipped"] == 1
    assert log.published.count(flaky_key) == 1 and log.published[-1] == flaky_key, "retried at the end"
    assert len(log.published) == len(set(log.published)) == FILES * GROUPS
    assert not skipped, "the record goes once the unit is published"


def test_a_skip_record_goes_once_a_later_pass_has_read_its_unit(
    tmp_path: Path, make_config: Callable[..., Config], flaky: tuple[str, dict[str, int]]
) -> None:
    """A record left final by its pass is never read by a later one: kept, the records would grow
    with every unit a long run ever failed to read twice (an outage), each read at every pass end."""
    flaky_key, failures = flaky
    config = make_config(str(tmp_path / "remote"), **ROOMY, **{"sampler.backoff_s": 0.001, "sampler.max_attempts": 3})
    ledger = Ledger(CacheLayout.create(config.cache.dir).ledger)
    failures["left"] = 6  # the walk's 3 attempts, then the end-of-pass retry's 3: unread in pass 0
    first = SyncDaemon(config, progress=False).run(once=True)
    assert first.units_unread == 1 and ledger.daemon.skipped()[flaky_key]["final"]
    log = UnitLog()
    log.daemon(config).run(once=True)  # pass 1 reads it
    assert log.published == [flaky_key]
    assert ledger.daemon.skipped() == {}, "pass 0's record of a unit cached since was kept"
    ledger.close()

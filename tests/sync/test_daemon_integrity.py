"""The daemon keeps one dataset per cache dir and never stops for one bad object (issue 9, daemon side).

A config that would change the schema of the cached rows stops with one line; damaged objects, units
of 0 rows and rows with nulls in fixed-width columns are skipped (counted, reported) while the pass
goes on; skips left unread are in the report; the daemon's vitals are in its ledger state.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import DaemonThread, FullDisk, cached_ids, wait_for, write_parquet_dataset

from epochcache import EpochCachedLoader, Ledger, SyncDaemon
from epochcache.cache.layout import CacheLayout
from epochcache.config import Config
from epochcache.errors import CorruptObjectError, DatasetMismatchError, SourceError
from epochcache.sources import Source, Unit
from epochcache.sync.vitals import Vitals

# (a corrupt unit is retried, and again at the pass end: real backoffs would cost seconds per test)
ROOMY = {"cache.max_bytes": "50MB", "cache.shard_bytes": "200KB", "sampler.backoff_s": 0.001,
         "sampler.backoff_max_s": 0.01}


def _remote(tmp_path: Path, files: int = 9, name: str = "remote") -> tuple[str, list[str]]:
    root = str(tmp_path / name)
    return root, write_parquet_dataset(fsspec.filesystem("file"), root, files, 64, 32)


def _ledger(config: Config) -> Ledger:
    return Ledger(CacheLayout(Path(config.cache.dir)).ledger)


def _state(ledger: Ledger) -> dict[str, Any]:
    state = ledger.daemon.status()
    assert state is not None, "the daemon wrote its state"
    return state


def _identity(ledger: Ledger) -> dict[str, Any]:
    identity = ledger.daemon.identity()
    assert identity is not None, "the cache is bound to a dataset"
    return identity


def test_columns_changed_on_the_same_cache_dir_stop_with_one_line(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """Issue 9 item 1: filled with columns [image, id], then synced on with [image]: the second run
    must not write rows without ``id`` into a cache whose shards have it."""
    remote, _ = _remote(tmp_path, files=2)
    first = make_config(remote, **ROOMY, **{"source.columns": ["image", "id"]})
    SyncDaemon(first, progress=False).run(once=True)
    shards_before = len(_ledger(first).shards())

    narrowed = make_config(remote, **ROOMY, **{"source.columns": ["image"]})
    with pytest.raises(DatasetMismatchError) as caught:
        SyncDaemon(narrowed, progress=False).run(once=True)
    message = str(caught.value)
    assert "\n" not in message
    assert "source.columns is ['image']" in message and "['image', 'id']" in message
    assert "new cache.dir" in message and "epochcache clear --config" in message
    ledger = _ledger(first)
    assert len(ledger.shards()) == shards_before and _identity(ledger)["schema"].startswith("[image: ")
    ledger.close()


def test_rows_of_another_schema_are_refused_before_a_shard_holds_them(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """Same columns key, another remote whose ``id`` is int32: refused at its first rows."""
    remote, _ = _remote(tmp_path, files=2)
    config = make_config(remote, **ROOMY)
    SyncDaemon(config, progress=False).run(once=True)
    other = tmp_path / "other"
    other.mkdir()
    pq.write_table(pa.table({"id": pa.array(np.arange(10, dtype=np.int32))}), other / "part-000.parquet")
    published = len(_ledger(config).shards())

    mismatch = r"has columns \[id: int32, __key__: string\] but the rows cached .* have \[image"
    with pytest.raises(DatasetMismatchError, match=mismatch):
        SyncDaemon(make_config(str(other), **ROOMY), progress=False).run(once=True)
    assert len(_ledger(config).shards()) == published


def test_a_cache_written_before_it_recorded_its_dataset_is_checked_against_its_shards(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    remote, _ = _remote(tmp_path, files=1)
    config = make_config(remote, **ROOMY, **{"source.columns": ["image", "id"]})
    SyncDaemon(config, progress=False).run(once=True)
    ledger = _ledger(config)
    ledger.daemon.set_identity(None)  # as a cache of the previous version has none
    ledger.close()
    same, _ = _remote(tmp_path, files=1, name="same")  # units not cached yet: their rows are written
    assert SyncDaemon(make_config(same, **ROOMY, **{"source.columns": ["image", "id"]}),
                      progress=False).run(once=True).shards_published > 0
    ledger = _ledger(config)
    ledger.daemon.set_identity(None)
    ledger.close()
    remote, _ = _remote(tmp_path, files=1, name="more")
    with pytest.raises(DatasetMismatchError, match=r"has columns \[id: int64, __key__: string\], which no shard"):
        SyncDaemon(make_config(remote, **ROOMY, **{"source.columns": ["id"]}), progress=False).run(once=True)


def test_an_emptied_cache_takes_another_dataset(tmp_path: Path, make_config: Callable[..., Config]) -> None:
    """The binding holds while shards do: a cache with none takes the new schema and binds to it."""
    remote, _ = _remote(tmp_path, files=1)
    config = make_config(remote, **ROOMY, **{"source.columns": ["image", "id"]})
    SyncDaemon(config, progress=False).run(once=True)
    ledger = _ledger(config)
    records = ledger.shards()
    ledger.drop([record.id for record in records])
    ledger.close()
    for record in records:  # as `epochcache clear` does: files and records gone
        (CacheLayout(Path(config.cache.dir)).shards / record.filename).unlink()
    narrowed = make_config(remote, **ROOMY, **{"source.columns": ["id"]})
    report = SyncDaemon(narrowed, progress=False).run(once=True)
    assert report.shards_published > 0
    ledger = _ledger(narrowed)
    assert _identity(ledger)["schema"] == "[id: int64, __key__: string]"
    ledger.close()


class _Faulty:
    """A real source whose reads of ``bad`` objects fail as ``fault(unit, table)`` says (fault injection)."""

    def __init__(self, inner: Source, bad: str, fault: Callable[[Unit, pa.Table], pa.Table]) -> None:
        self._inner, self._bad, self._fault = inner, bad, fault

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def read(self, unit: Unit) -> pa.Table:
        table = self._inner.read(unit)
        return self._fault(unit, table) if unit.obj.path.endswith(self._bad) else table


def _inject(monkeypatch: pytest.MonkeyPatch, bad: str, fault: Callable[[Unit, pa.Table], pa.Table]) -> None:
    import epochcache.sync.daemon as daemon

    real = daemon.open_source
    monkeypatch.setattr(daemon, "open_source", lambda *args: _Faulty(real(*args), bad, fault))


def _corrupt(unit: Unit, table: pa.Table) -> pa.Table:
    raise CorruptObjectError(f"{unit.key}: Corrupt snappy compressed data")


def test_a_corrupt_object_is_skipped_with_its_reason_and_the_pass_goes_on(
    tmp_path: Path, make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    remote, _ = _remote(tmp_path)
    _inject(monkeypatch, "part-004.parquet", _corrupt)
    config = make_config(remote, **ROOMY)
    report = SyncDaemon(config, progress=False).run(once=True)

    assert report.reason.value == "remote exhausted"
    assert set(cached_ids(config.cache.dir)) == set(range(9 * 64)) - set(range(4 * 64, 5 * 64))
    assert report.units_unread == 2  # both row groups of part-004, read again at the pass end and failed again
    ledger = _ledger(config)
    skipped = ledger.daemon.skipped()
    assert {info["path"] for info in skipped.values()} == {f"{remote}/part-004.parquet"}
    assert all("Corrupt snappy" in info["error"] and info["final"] for info in skipped.values())
    state = _state(ledger)
    # The pass-end retry was the run's last read: its failure is the last error (a read that works clears it).
    assert state["fetched_bytes"] > 0 and state["last_error"].startswith("corrupt object since ")
    assert "part-004.parquet#" in state["last_error"] and "failed again at the pass end" in state["last_error"]
    ledger.close()


def test_zero_row_units_are_skipped_and_null_rows_dropped(
    tmp_path: Path, make_config: Callable[..., Config], monkeypatch: pytest.MonkeyPatch
) -> None:
    remote, _ = _remote(tmp_path, files=3)
    ids = pa.array([1000, None, 1002, None], type=pa.int64())
    pq.write_table(pa.table({"image": pa.array([b"x"] * 4), "id": ids}), f"{remote}/part-009.parquet")
    _inject(monkeypatch, "part-001.parquet", lambda unit, table: table.slice(0, 0))
    config = make_config(remote, **ROOMY, **{"source.columns": ["id"]})
    report = SyncDaemon(config, progress=False).run(once=True)

    assert report.rows_dropped == 2
    assert set(cached_ids(config.cache.dir)) == set(range(64)) | set(range(128, 192)) | {1000, 1002}
    ledger = _ledger(config)
    assert all(record.rows > 0 for record in ledger.shards())
    assert {key for key in ledger.daemon.skipped()} == {f"{remote}/part-001.parquet#0", f"{remote}/part-001.parquet#1"}
    assert ledger.counters.all()["rows_dropped"] == 2
    ledger.close()


def test_row_groups_whose_metadata_says_they_are_empty_are_read_as_empty_not_skipped(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """pyarrow (and Spark) write a Parquet file of an empty table as one row group of 0 rows: valid,
    nothing to cache, never a corrupt object retried and reported at every pass end."""
    remote, _ = _remote(tmp_path, files=2)
    rows = pq.read_table(f"{remote}/part-001.parquet")  # ids 64..127
    Path(f"{remote}/part-001.parquet").unlink()
    pq.write_table(rows.slice(0, 0), f"{remote}/part-007.parquet")
    with pq.ParquetWriter(f"{remote}/part-008.parquet", rows.schema) as writer:
        for start, length in [(0, 3), (3, 0), (3, 2)]:  # a row group of 0 rows between two
            writer.write_table(rows.slice(start, length))
    assert pq.ParquetFile(f"{remote}/part-007.parquet").metadata.row_group(0).num_rows == 0
    assert pq.ParquetFile(f"{remote}/part-008.parquet").metadata.row_group(1).num_rows == 0
    config = make_config(remote, **ROOMY)
    report = SyncDaemon(config, progress=False).run(once=True)

    assert sorted(cached_ids(config.cache.dir)) == [*range(64), *range(64, 69)]
    assert report.units_skipped == 0 and report.units_unread == 0
    ledger = _ledger(config)
    assert ledger.daemon.skipped() == {} and _state(ledger)["last_error"] is None
    ledger.close()


def test_rows_with_a_null_item_inside_a_fixed_size_list_are_dropped_not_trained_on(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    remote = tmp_path / "nested"
    remote.mkdir()
    inner = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(16, dtype=np.float32)), 2,
                                              mask=pa.array([False, True] + [False] * 6))  # row 0's second item
    vectors = pa.FixedSizeListArray.from_arrays(inner, 2)  # 4 rows of 2x2, none null itself
    numbers = pa.array([0.0, 1.0, None, 3.0, 4.0, 5.0, 6.0, 7.0], pa.float32())  # row 1 holds a null number
    tensors = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.float32(), [2]),
                                             pa.FixedSizeListArray.from_arrays(numbers, 2))
    table = pa.table({"v": vectors, "t": tensors, "id": pa.array([0, 1, 2, 3])})
    with pa.OSFile(str(remote / "part-0.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)  # (Arrow IPC: pyarrow 25 cannot read such a column back from Parquet)
    config = make_config(str(remote), **ROOMY, **{"source.format": "arrow"})
    report = SyncDaemon(config, progress=False).run(once=True)
    assert report.rows_dropped == 2
    assert sorted(cached_ids(config.cache.dir)) == [2, 3]
    with EpochCachedLoader(config.cache.dir, batch_size=4, progress=False) as loader:
        (batch,) = list(loader)
    assert sorted(batch["id"].tolist()) == [2, 3] and batch["v"].shape == (2, 2, 2)


@pytest.mark.slow  # (a CLI process)
def test_a_damaged_parquet_footer_among_nine_is_skipped_by_sync_once(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """Issue 9 item 4, through the CLI in a real process: 8 of 9 objects cached, exit 3 (skips)."""
    remote, paths = _remote(tmp_path)
    damaged = bytearray(Path(paths[6]).read_bytes())
    damaged[-12:-8] = b"\xff\xff\xff\x7f"  # the footer's thrift no longer parses
    Path(paths[6]).write_bytes(bytes(damaged))
    config = make_config(remote, **ROOMY)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump({"source": {"url": remote}, "cache": {"dir": config.cache.dir, **{
        "max_bytes": "50MB", "shard_bytes": "200KB"}}, "sampler": {"backoff_s": 0.001, "backoff_max_s": 0.01}}))
    done = subprocess.run([sys.executable, "-m", "epochcache", "sync", "-c", str(config_file), "--once",
                           "--no-progress"], capture_output=True, text=True, timeout=120)
    assert set(cached_ids(config.cache.dir)) == set(range(9 * 64)) - set(range(6 * 64, 7 * 64)), done.stderr
    assert done.returncode == 3, done.stderr  # completed, but units were skipped and not read again
    ledger = _ledger(config)
    assert [info["path"] for info in ledger.daemon.skipped().values()] == [paths[6]]
    ledger.close()


@pytest.mark.slow  # (1.5 s)
def test_a_ledger_that_keeps_filling_its_disk_does_not_stop_the_daemon(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """Issue 9 item 9: ENOSPC under the ledger's writes (counters, state, skips, publishes) is backed
    waited out or left unrecorded; the pass completes and every sample is cached once."""
    remote, _ = _remote(tmp_path, files=4)
    config = make_config(remote, **ROOMY)
    disk = FullDisk(chance=0.25, seed=3)  # a quarter of the writes refused, the very first among them
    report = SyncDaemon(config, progress=False, connect=disk.connect).run(once=True)
    assert disk.refused >= 3, f"{disk.refused} of {disk.writes} writes refused"
    assert report.samples_published == 4 * 64
    assert sorted(cached_ids(config.cache.dir)) == list(range(4 * 64))


def test_configuration_errors_still_stop_the_daemon(tmp_path: Path, make_config: Callable[..., Config]) -> None:
    with pytest.raises(SourceError):
        SyncDaemon(make_config(str(tmp_path / "nothing-here"), **ROOMY), progress=False).run(once=True)


def test_vitals_record_settings_fetches_and_an_outage_until_reads_work_again(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger")
    now = [1000.0]
    vitals = Vitals(ledger, clock=lambda: now[0], interval_s=1.0)
    vitals.start({"max_bytes": 5, "concurrency": 3})
    now[0] += 2
    vitals.fetched(4000)
    state = _state(ledger)
    assert state["started"] == 1000.0 and state["settings"]["concurrency"] == 3
    assert state["fetched_bytes"] == 4000 and state["fetch_bytes_per_s"] == 2000.0

    vitals.failed("remote unreachable", "listing of s3://b/x: ConnectTimeoutError: 127.0.0.1:9")
    now[0] += 30
    vitals.failed("remote unreachable", "again")
    state = _state(ledger)
    assert state["last_error"].startswith("remote unreachable since ") and state["last_error"].endswith("again")
    assert state["last_error_at"] == 1032.0
    first = _state(ledger)["last_error"].split(" since ")[1][:8]
    assert first == time.strftime("%H:%M:%S", time.localtime(1002.0))  # the outage's start is kept
    vitals.fetched(10)
    assert _state(ledger)["last_error"] is None and _state(ledger)["fetched_bytes"] == 4010
    # A failed attempt that will be retried shows at once, before the retries run out.
    vitals.retrying("attempt 1 failed, retrying: ReadTimeoutError: 127.0.0.1:9")
    assert _state(ledger)["last_error"].startswith("reads failing since ")
    vitals.fetched(10)
    assert _state(ledger)["last_error"] is None
    ledger.close()


def test_a_run_leaves_its_settings_and_fetched_bytes_in_the_daemon_state_without_secrets(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    remote, _ = _remote(tmp_path, files=2)
    config = make_config(remote, **ROOMY, **{"source.storage_options": {"secret": "hunter2"},
                                             "sampler.concurrency": 3})
    SyncDaemon(config, progress=False).run(once=True)
    ledger = _ledger(config)
    state = _state(ledger)
    ledger.close()
    settings = state["settings"]
    assert settings["sampler"]["concurrency"] == 3 and settings["cache"]["max_bytes"] == 50_000_000
    assert settings["sources"][0]["url"] == remote and "hunter2" not in repr(state)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump({"source": {"url": remote}, "cache": {"dir": config.cache.dir}}))
    shown = subprocess.run([sys.executable, "-m", "epochcache", "status", "-c", str(config_file)],
                           capture_output=True, text=True, timeout=60).stdout
    assert "pass 1: 0 units cached this pass" in shown, shown  # the pass completed; the next is counted
    assert state["fetched_bytes"] > 0 and state["started"] > 0 and state["last_error"] is None


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A TCP port on 127.0.0.1 that accepts connections (the kernel's backlog) and never answers."""
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield listener.getsockname()[1]


def _refused_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])  # closed on return: connections to it are refused


def _sync_once_against(tmp_path: Path, port: int, *overrides: str) -> tuple[subprocess.CompletedProcess[str], float]:
    import time

    import yaml

    config_file = tmp_path / "config.yaml"
    config_file.write_text(yaml.safe_dump({
        "source": {"url": "s3://bucket/data", "storage_options": {
            "key": "k", "secret": "s", "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}}},
        "cache": {"dir": str(tmp_path / "cache"), "max_bytes": "10MB", "shard_bytes": "1MB"}}))
    args = [arg for override in overrides for arg in ("--set", override)]
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "epochcache", "sync", "-c", str(config_file), "--once",
                           "--no-progress", *args], capture_output=True, text=True, timeout=150)
    return done, time.monotonic() - started


@pytest.mark.slow  # (a CLI process each: 2-3 s)
@pytest.mark.parametrize("endpoint", ["black hole", "refused"])
def test_sync_once_against_an_unreachable_endpoint_ends_with_one_line_naming_the_host(
    tmp_path: Path, black_hole: int, endpoint: str
) -> None:
    port = black_hole if endpoint == "black hole" else _refused_port()
    done, elapsed = _sync_once_against(tmp_path, port, "sampler.request_timeout_s=0.5", "sampler.max_attempts=2",
                                       "sampler.backoff_max_s=0.2")
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
    assert done.returncode == 2 and elapsed < 30, done.stderr
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "Traceback" not in done.stderr, done.stderr


@pytest.mark.slow  # (timeouts against a black hole)
def test_the_daemon_keeps_retrying_an_unreachable_endpoint_and_shows_it(
    tmp_path: Path, black_hole: int, make_config: Callable[..., Config]
) -> None:
    config = make_config("s3://bucket/data", **{
        "source.storage_options": {"key": "k", "secret": "s",
                                   "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{black_hole}"}},
        "sampler.request_timeout_s": 0.3, "sampler.max_attempts": 1, "sampler.backoff_max_s": 0.2,
        "cache.max_bytes": "10MB", "cache.shard_bytes": "1MB"})
    daemon = DaemonThread(SyncDaemon(config, progress=False))
    ledger = _ledger(config)

    def failures() -> int:
        failing = (ledger.daemon.status() or {}).get("last_error") is not None
        return ledger.counters.all().get("give_ups", 0) if failing else 0

    try:
        wait_for(lambda: failures() >= 2, timeout=20)  # failed, backed off, tried again: still running
        error = _state(ledger)["last_error"]
        assert error.startswith("remote unreachable since ") and f"127.0.0.1:{black_hole}" in error
        from epochcache.tools.status import cache_status

        assert cache_status(config)["daemon"].startswith("running pid ")  # status reads the daemon's state
    finally:
        report = daemon.stop()
        ledger.close()
    assert report.shards_published == 0


def test_no_thread_of_the_run_outlives_it_when_the_budget_fills_mid_window(
    tmp_path: Path, make_config: Callable[..., Config]
) -> None:
    """Issue 9 item 10: 'budget full' returns with reads still queued; none may run on after run()."""
    import threading

    remote = str(tmp_path / "remote")
    write_parquet_dataset(fsspec.filesystem("file"), remote, 12, 512, 32)  # ~4.8 MB
    config = make_config(remote, **{"cache.max_bytes": "1.2MB", "cache.shard_bytes": "200KB",
                                    "sampler.concurrency": 32})
    before = set(threading.enumerate())
    report = SyncDaemon(config, progress=False).run(once=True)
    assert report.reason.value == "budget full"
    left = [t.name for t in set(threading.enumerate()) - before if t.name.startswith(("fetch", "publish"))]
    assert left == []


@pytest.mark.soak
def test_sync_once_never_aborts_at_exit_with_many_reads_in_flight(
    tmp_path: Path, s3: Any, bucket: str, s3_options: dict[str, Any]
) -> None:
    """Issue 9 item 10: `sync --once` with sampler.concurrency=32 ends at 'budget full' with reads in
    flight; 25 runs, none may end in SIGABRT (134: a native thread alive at interpreter exit)."""
    import yaml

    write_parquet_dataset(s3, f"{bucket}/data", 12, 512, 32)
    config_file = tmp_path / "config.yaml"
    codes = []
    for run in range(25):
        config_file.write_text(yaml.safe_dump({
            "source": {"url": f"s3://{bucket}/data", "storage_options": s3_options},
            "cache": {"dir": str(tmp_path / f"cache{run}"), "max_bytes": "1.2MB", "shard_bytes": "200KB"},
            "sampler": {"concurrency": 32}}))
        done = subprocess.run([sys.executable, "-m", "epochcache", "sync", "-c", str(config_file), "--once",
                               "--no-progress"], capture_output=True, text=True, timeout=120)
        codes.append(done.returncode)
        assert "terminate called" not in done.stderr, done.stderr
    assert codes == [0] * 25

"""The daemon (``SyncDaemon.run(once=True)``) against quirky S3 remotes: awkward key names, folder
markers and empty files, objects refused one by one, connections that stall, a listing that changes
between passes. Every unit ends up published once or skipped with its reason; the run never hangs."""

from __future__ import annotations

import io
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import UnitLog, make_table
from faultproxy import FaultProxy

from epochcache import FetchFailedError, Ledger, SourceError, SyncDaemon
from epochcache.cache.layout import CacheLayout
from epochcache.cache.shards import verify_shard
from epochcache.config import Config
from epochcache.sync.daemon import StopReason

ROWS, GROUP = 64, 32
ROOMY = {"cache.max_bytes": "50MB", "cache.shard_bytes": "200KB"}
FAST = {"sampler.backoff_s": 0.01, "sampler.backoff_max_s": 0.05, "sampler.max_attempts": 8,
        "sampler.request_timeout_s": 0.5}
NAMES = ["a b.parquet", "a+b.parquet", "a%20b.parquet", "ünï cödé ✓.parquet", "year=2024/month=01/p.parquet",
         "q?x=1&y=2.parquet", "h#frag.parquet", "back\\slash.parquet", ("deep-" + "x" * 180 + "/") * 4 + "long.parquet"]


def _parquet(start: int) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(make_table(ROWS, start), buffer, row_group_size=GROUP)
    return buffer.getvalue()


def _cached_ids(config: Config) -> dict[str, list[int]]:
    """Each cached row's key -> the ids cached under it (verified shards only)."""
    layout = CacheLayout(Path(config.cache.dir))
    ledger = Ledger(layout.ledger)
    ids: dict[str, list[int]] = {}
    for record in ledger.shards():
        verify_shard(layout.shards / record.filename, record.checksum)
        table = pa.ipc.open_file(layout.shards / record.filename).read_all()
        for key, sample_id in zip(table.column("__key__").to_pylist(), table.column("id").to_pylist()):
            ids.setdefault(key, []).append(sample_id)
    ledger.close()
    return ids


def _skipped(config: Config) -> dict[str, Any]:
    ledger = Ledger(CacheLayout(Path(config.cache.dir)).ledger)
    try:
        return dict(ledger.daemon.skipped())
    finally:
        ledger.close()


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(s3_endpoint, rate=0.0, seed=3)
    yield proxy
    proxy.close()


def _via(proxy: FaultProxy) -> dict[str, Any]:
    return {"source.storage_options": {"key": "testing", "secret": "testing",
                                       "client_kwargs": {"endpoint_url": proxy.url}}}


def test_awkward_keys_markers_and_an_empty_file_are_cached_or_skipped_by_name(
    s3: Any, bucket: str, s3_options: dict[str, Any], make_config: Callable[..., Config]
) -> None:
    """Keys with spaces, '+', '%', unicode, '=', '?', '#', '\\' and 800-byte keys are read whole;
    folder markers are not objects; a zero-byte *.parquet is skipped, named; the sibling prefix
    ``data2/`` of the URL ``s3://b/data`` is not part of the source."""
    for number, name in enumerate(NAMES):
        s3.pipe(f"{bucket}/data/{name}", _parquet(number * ROWS))
    for marker in ("data/", "data/year=2024/", "data/empty-folder/"):
        s3.pipe(f"{bucket}/{marker}", b"")
    s3.pipe(f"{bucket}/data/zero.parquet", b"")
    s3.pipe(f"{bucket}/data2/sibling.parquet", _parquet(10_000))
    config = make_config(f"s3://{bucket}/data", **ROOMY, **FAST, **{"source.storage_options": s3_options})
    report = SyncDaemon(config, progress=False).run(once=True)
    assert report.reason is StopReason.EXHAUSTED
    cached = _cached_ids(config)
    for number, name in enumerate(NAMES):
        assert [cached[f"{bucket}/data/{name}:{row}"] for row in range(ROWS)] == [
            [number * ROWS + row] for row in range(ROWS)], name
    assert len(cached) == len(NAMES) * ROWS, "nothing else cached: no sibling rows, no marker"
    assert list(_skipped(config)) == [f"{bucket}/data/zero.parquet#*"]


def test_a_refused_object_is_skipped_and_reported_and_the_pass_completes(
    s3: Any, bucket: str, proxy: FaultProxy, make_config: Callable[..., Config]
) -> None:
    for number in range(4):
        s3.pipe(f"{bucket}/data/part-{number}.parquet", _parquet(number * ROWS))
    proxy.deny = {f"/{bucket}/data/part-2.parquet".encode()}
    config = make_config(f"s3://{bucket}/data", **ROOMY, **FAST, **_via(proxy))
    log = UnitLog()
    report = log.daemon(config).run(once=True)
    assert report.reason is StopReason.EXHAUSTED and report.units_unread == 1
    assert sorted(log.published) == sorted(f"{bucket}/data/part-{n}.parquet#{g}" for n in (0, 1, 3) for g in (0, 1))
    skipped = _skipped(config)
    assert list(skipped) == [f"{bucket}/data/part-2.parquet#*"]
    assert "ObjectDeniedError" in skipped[f"{bucket}/data/part-2.parquet#*"]["error"]
    assert proxy.faults["deny"] == 2, "read once in the walk, once at the pass end: a 403 is not retried"


def test_a_remote_whose_objects_are_all_refused_stops_the_daemon_naming_the_fix(
    s3: Any, bucket: str, proxy: FaultProxy, make_config: Callable[..., Config]
) -> None:
    for number in range(4):
        s3.pipe(f"{bucket}/data/part-{number}.parquet", _parquet(number * ROWS))
    proxy.deny = {f"/{bucket}/data/part-{number}.parquet".encode() for number in range(4)}
    config = make_config(f"s3://{bucket}/data", **ROOMY, **FAST, **_via(proxy))
    with pytest.raises(SourceError, match=r"refused, none read.*check the credentials and the bucket policy"):
        SyncDaemon(config, progress=False).run(once=True)


@pytest.mark.parametrize("whole", [False, True], ids=["ranged", "whole"])
def test_a_store_that_closes_kept_alive_connections_unannounced_has_every_row_read(
    s3: Any, bucket: str, s3_endpoint: str, make_config: Callable[..., Config], whole: bool
) -> None:
    """Each connection is closed 50 ms after its reply, without a ``Connection: close``: a request sent on
    it meanwhile (a footer's confirming read follows its first at once) gets no reply. That request is
    sent again on a new connection, as HTTP allows for a GET, so no unit is skipped for it."""
    for number in range(4):
        s3.pipe(f"{bucket}/data/part-{number}.parquet", _parquet(number * ROWS))
    proxy = FaultProxy(s3_endpoint, rate=0.0, silent_close_s=0.05)
    try:
        config = make_config(f"s3://{bucket}/data", **ROOMY, **FAST, **_via(proxy),
                             **{"sampler.whole_object_bytes": "1MB" if whole else 0})
        report = SyncDaemon(config, progress=False).run(once=True)
    finally:
        proxy.close()
    assert report.reason is StopReason.EXHAUSTED
    assert _skipped(config) == {}
    cached = _cached_ids(config)
    assert sorted(i for ids in cached.values() for i in ids) == list(range(4 * ROWS)), "every row, once"


@pytest.mark.slow  # (4 s: each stall waits out request_timeout_s)
def test_stalling_connections_never_hang_the_daemon(
    s3: Any, bucket: str, proxy: FaultProxy, make_config: Callable[..., Config]
) -> None:
    """A fifth of the requests stall after their headers and half their body: each is given up after
    sampler.request_timeout_s of silence and retried; the pass completes with every row intact."""
    for number in range(4):
        s3.pipe(f"{bucket}/data/part-{number}.parquet", _parquet(number * ROWS))
    proxy.rate, proxy.kinds = 0.2, ("stall",)
    config = make_config(f"s3://{bucket}/data", **ROOMY, **FAST, **_via(proxy))
    log = UnitLog()
    daemon, ran = log.daemon(config), {}
    thread = threading.Thread(target=lambda: ran.setdefault("report", daemon.run(once=True)), daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "the daemon hangs on a stalled connection"
    assert ran["report"].reason is StopReason.EXHAUSTED
    assert proxy.faults["stall"] >= 1
    skipped = set(_skipped(config))
    units = {f"{bucket}/data/part-{n}.parquet#{g}" for n in range(4) for g in (0, 1)}
    assert set(log.published) | {key for key in skipped if not key.endswith("#*")} <= units
    cached = _cached_ids(config)
    assert all(ids == [int(key.rsplit("part-", 1)[1][0]) * ROWS + int(key.rsplit(":", 1)[1])]
               for key, ids in cached.items()), "every cached row is the row its key names, once"
    assert len(cached) == len(log.published) * GROUP


def test_the_next_pass_sees_objects_added_and_deleted_since_the_last(
    s3: Any, bucket: str, s3_options: dict[str, Any], make_config: Callable[..., Config]
) -> None:
    for number in range(3):
        s3.pipe(f"{bucket}/data/part-{number}.parquet", _parquet(number * ROWS))
    config = make_config(f"s3://{bucket}/data", **ROOMY, **FAST, **{"source.storage_options": s3_options})
    assert SyncDaemon(config, progress=False).run(once=True).reason is StopReason.EXHAUSTED
    s3.rm(f"{bucket}/data/part-1.parquet")
    s3.pipe(f"{bucket}/data/part-7.parquet", _parquet(7 * ROWS))
    log = UnitLog()
    report = log.daemon(config).run(once=True)
    assert report.reason is StopReason.EXHAUSTED and report.units_skipped == 0
    assert sorted(log.published) == [f"{bucket}/data/part-7.parquet#{g}" for g in (0, 1)], "only the new object is read"
    assert sorted(_cached_ids(config)[f"{bucket}/data/part-7.parquet:{row}"][0] for row in range(ROWS)) == list(
        range(7 * ROWS, 8 * ROWS))


def test_a_bucket_deleted_mid_pass_stops_the_daemon_naming_it(
    s3: Any, s3_options: dict[str, Any], make_config: Callable[..., Config]
) -> None:
    """Not a pass of 'objects missing' that ends as if complete: the bucket of source.url is gone."""
    name = f"gone-{uuid.uuid4().hex[:12]}"
    s3.mkdir(name)
    for number in range(4):
        s3.pipe(f"{name}/data/part-{number}.parquet", _parquet(number * ROWS))
    config = make_config(f"s3://{name}/data", **ROOMY, **FAST, **{"source.storage_options": s3_options})
    daemon = SyncDaemon(config, progress=False)
    daemon.on_fetch = lambda unit: s3.rm(name, recursive=True) if s3.exists(name) else None
    with pytest.raises(SourceError, match=rf"cannot read s3://{name}/data/part-.\.parquet: its bucket no longer"):
        daemon.run(once=True)


def test_a_listing_the_store_keeps_failing_with_a_server_error_is_shown_as_failing_not_unreachable(
    s3: Any, bucket: str, quirky: Callable[..., FaultProxy], make_config: Callable[..., Config]
) -> None:
    """A store that answers every listing with a 500 is reachable: status says it is failing, and how."""
    s3.pipe(f"{bucket}/failing/part-0.parquet", _parquet(0))
    proxy = quirky(refuse_listing=(500, "InternalError"))
    config = make_config(f"s3://{bucket}/failing", **ROOMY, **_via(proxy), **{**FAST, "sampler.max_attempts": 2})
    with pytest.raises(FetchFailedError, match="still failing after retries"):
        SyncDaemon(config, progress=False).run(once=True)
    ledger = Ledger(CacheLayout(Path(config.cache.dir)).ledger)
    try:
        error = (ledger.daemon.status() or {}).get("last_error")
    finally:
        ledger.close()
    assert error is not None and error.startswith("remote failing (HTTP 500) since "), error
    assert f"listing of s3://{bucket}/failing" in error

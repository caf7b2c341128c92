"""The daemon keeps remote footers on disk: a pass, a restart or a wide mixing window reads none twice,
and the footers' files stay within their share of the budget (through a proxy that records every GET)."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import DaemonThread, make_table, wait_for, write_parquet_dataset
from faultproxy import FaultProxy

from epochcache import SyncDaemon
from epochcache.cache.layout import bytes_under
from epochcache.config import Config
from epochcache.sync.report import StopReason
from epochcache.tools.status import cache_status, format_status

FILES, ROWS, ROWS_PER_GROUP = 4, 256, 64
_RANGE = re.compile(rb"(?im)^range: *bytes=(\d+)-(\d+)\r\n")


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(s3_endpoint, rate=0.0, seed=5)
    yield proxy
    proxy.close()


def _tail_gets(proxy: FaultProxy, sizes: dict[str, int]) -> int:
    """Object GETs forwarded whose range ends at the object's last byte: its footer's reads."""
    count = 0
    for head in proxy.object_get_heads:
        path = head.split(b" ")[1].split(b"?")[0].decode()
        ranged = _RANGE.search(head)
        count += bool(ranged and int(ranged[2]) == sizes[path] - 1)
    return count


def test_a_restarted_daemon_reads_no_footer_again_within_the_budget(
    s3: Any, bucket: str, proxy: FaultProxy, make_config: Callable[..., Config]
) -> None:
    paths = write_parquet_dataset(s3, f"{bucket}/data", files=FILES, rows_per_file=ROWS, rows_per_group=ROWS_PER_GROUP)
    sizes = {f"/{path}": s3.size(path) for path in paths}
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url}}
    config = make_config(f"s3://{bucket}/data", **{
        "source.storage_options": options, "sampler.whole_object_bytes": 0, "cache.shard_bytes": "64KiB",
        "cache.max_bytes": "2MiB", "cache.footer_bytes": "1MiB", "cache.min_uses": 0,
    })
    first = SyncDaemon(config, progress=False).run(once=True)
    assert first.reason is StopReason.BUDGET_FULL and 0 < first.samples_published < FILES * ROWS
    assert _tail_gets(proxy, sizes) == 2 * FILES, "each footer read, then confirmed, once"
    proxy.object_get_heads.clear()

    published = threading.Event()
    restarted = DaemonThread(SyncDaemon(config, progress=False, on_publish=lambda _: published.set()))
    wait_for(published.is_set)  # units read and a shard published, evicting: the pass goes on
    restarted.stop()
    assert proxy.object_get_heads, "the restarted daemon read units"
    assert _tail_gets(proxy, sizes) == 0, "no footer read again"
    assert bytes_under(Path(config.cache.dir)) <= int(config.cache.max_bytes)
    footers = bytes_under(Path(config.cache.dir) / "footers")
    status = cache_status(config)  # counts them among the cache's bytes
    assert status["footer_bytes"] == footers > 0
    assert status["bytes"] == status["shard_bytes"] + status["ledger_bytes"] + footers
    assert "footers " in format_status(status)


@pytest.mark.slow  # (several daemon runs through a faulty proxy, ~10 s)
def test_runs_through_a_hostile_remote_cache_only_intact_rows_reading_kept_footers(
    s3: Any, bucket: str, s3_endpoint: str, make_config: Callable[..., Config], request: pytest.FixtureRequest
) -> None:
    """Flipped bits in bodies, resets, cut bodies and throttling, over runs that re-read every unit
    (their shards deleted in between) from kept footers: every cached row is its sample."""
    sizes = {}
    for number in range(6):  # page CRCs: flipped data bits are caught (the footer is guarded by its two reads)
        path = f"{bucket}/hostile/part-{number:03d}.parquet"
        with s3.open(path, "wb") as f:
            pq.write_table(make_table(ROWS, number * ROWS), f, row_group_size=ROWS_PER_GROUP,
                           write_page_checksum=True)
        sizes[f"/{path}"] = s3.size(path)
    proxy = FaultProxy(s3_endpoint, rate=0.15, kinds=("503", "reset", "truncate"), flip_rate=0.1, seed=11)
    request.addfinalizer(proxy.close)
    config = make_config(f"s3://{bucket}/hostile", **{
        "source.storage_options": {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": proxy.url}},
        "sampler.whole_object_bytes": 0, "sampler.backoff_s": 0.01, "sampler.backoff_max_s": 0.1,
        "sampler.max_attempts": 10, "cache.max_bytes": "20MB", "cache.shard_bytes": "64KiB",
        "cache.footer_bytes": "1MiB",
    })
    shards = Path(config.cache.dir) / "shards"
    footer_gets = []
    for _ in range(3):
        proxy.object_get_heads.clear()
        report = SyncDaemon(config, progress=False).run(once=True)
        footer_gets.append(_tail_gets(proxy, sizes))
        rows = 0
        for file in shards.glob("*.arrow"):
            table = pa.ipc.open_file(file).read_all()
            ids = table.column("id").to_numpy()
            images = table.column("image").combine_chunks().to_numpy_ndarray().reshape(len(ids), -1)
            assert (images == (ids % 251).astype(np.uint8)[:, None]).all(), "a damaged sample was cached"
            keys = table.column("__key__").to_pylist()
            assert [int(k.rsplit("part-", 1)[1][:3]) * ROWS + int(k.rpartition(":")[2]) for k in keys] == list(ids)
            rows += len(ids)
            file.unlink()  # the next run reads every unit again, through the footers kept
        assert rows == (6 * ROWS // ROWS_PER_GROUP - report.units_unread) * ROWS_PER_GROUP, "each unit cached once"
    assert proxy.faults["flip"] and proxy.faults["reset"], proxy.faults
    assert footer_gets[0] >= 12 and footer_gets[2] < footer_gets[0], footer_gets

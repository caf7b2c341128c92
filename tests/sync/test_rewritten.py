"""An object rewritten in place between two passes: the next pass reads its new version, and no
epoch that starts afterwards reads its old rows, whether or not a running epoch held them meanwhile,
across a daemon restart too. (Within one pass every read is pinned to the listed version: see
``tests/sources``.)"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import DaemonThread, make_table, wait_for
from faultproxy import FaultProxy

from epochcache import EpochCachedLoader, Ledger, SyncDaemon
from epochcache.cache.layout import CacheLayout
from epochcache.config import Config

ROWS, GROUP, NEW = 64, 32, 5_000


def _parquet(start: int) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(make_table(ROWS, start), buffer, row_group_size=GROUP)
    return buffer.getvalue()


def _cached(config: Config) -> Counter[int]:
    """How often each id is in a shard the next snapshot may take (retiring shards left out)."""
    layout = CacheLayout(Path(config.cache.dir))
    ledger = Ledger(layout.ledger)
    try:
        lease = ledger.leases.snapshot("probe", ttl_s=60)
        ids: Counter[int] = Counter()
        for record in lease.shards:
            ids.update(pa.ipc.open_file(layout.shards / record.filename).read_all().column("id").to_pylist())
        ledger.leases.release(lease.id)
        return ids
    finally:
        ledger.close()


def _epoch_ids(config: Config) -> Counter[int]:
    with EpochCachedLoader(config.cache.dir, batch_size=16, progress=False) as loader:
        return Counter(i for batch in loader for i in batch["id"].tolist())


@pytest.fixture
def remote(s3: Any, bucket: str, s3_options: dict[str, Any], make_config: Callable[..., Config]) -> Config:
    for number in range(3):
        s3.pipe(f"{bucket}/data/part-{number}.parquet", _parquet(number * ROWS))
    config = make_config(f"s3://{bucket}/data", **{"source.storage_options": s3_options, "cache.max_bytes": "50MB",
                                                     "cache.shard_bytes": "100KB"})
    SyncDaemon(config, progress=False).run(once=True)
    assert _cached(config) == Counter(range(3 * ROWS))
    return config


def test_the_next_pass_reads_a_rewritten_objects_new_rows_and_deletes_the_old(
    remote: Config, s3: Any, bucket: str
) -> None:
    s3.pipe(f"{bucket}/data/part-0.parquet", _parquet(NEW))
    SyncDaemon(remote, progress=False).run(once=True)
    expected = Counter([*range(NEW, NEW + ROWS), *range(ROWS, 3 * ROWS)])
    assert _cached(remote) == expected, "every row of the remote as it is now, once"
    ledger = Ledger(CacheLayout(Path(remote.cache.dir)).ledger)
    try:
        assert ledger.usage().retiring_bytes == 0, "no epoch held the old rows: their shards are gone"
        assert ledger.counters.all()["outdated"] >= 1
    finally:
        ledger.close()
    assert _epoch_ids(remote) == expected


def test_old_rows_held_by_a_running_epoch_stay_out_of_later_epochs_across_a_restart(
    remote: Config, s3: Any, bucket: str
) -> None:
    with EpochCachedLoader(remote.cache.dir, batch_size=16, progress=False) as loader:
        running = iter(loader)
        held = next(running)["id"].tolist()  # this epoch's lease holds every shard
        s3.pipe(f"{bucket}/data/part-1.parquet", _parquet(NEW))
        SyncDaemon(remote, progress=False).run(once=True)
        rest = [i for batch in running for i in batch["id"].tolist()]
        assert Counter(held + rest) == Counter(range(3 * ROWS)), "the running epoch reads its snapshot to its end"
    expected = Counter([*range(ROWS), *range(NEW, NEW + ROWS), *range(2 * ROWS, 3 * ROWS)])
    assert _epoch_ids(remote) == expected, "the next epoch: the new rows, the old ones left out"
    SyncDaemon(remote, progress=False).run(once=True)  # a restart returns unfinished retirements to snapshots...
    assert _epoch_ids(remote) == expected, "...but not shards of outdated rows"


def test_etags_the_store_spells_otherwise_in_the_next_listing_retire_nothing(
    s3: Any, bucket: str, s3_endpoint: str, make_config: Callable[..., Config]
) -> None:
    """A store whose listings spell an unchanged object's ETag otherwise (in upper case, weak, without
    quotes) rewrote nothing: its shards stay, and nothing is read again."""
    for number in range(3):
        s3.pipe(f"{bucket}/spelled/part-{number}.parquet", _parquet(number * ROWS))
    proxy = FaultProxy(s3_endpoint, rate=0.0)
    try:
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url}}
        config = make_config(f"s3://{bucket}/spelled", **{"source.storage_options": options,  # (footers kept)
                                                           "cache.max_bytes": "200MB", "cache.shard_bytes": "100KB"})
        SyncDaemon(config, progress=False).run(once=True)
        ledger = Ledger(CacheLayout(Path(config.cache.dir)).ledger)
        try:
            before = {r.id for r in ledger.shards()}
            for respell in (lambda e: e, lambda e: e.upper().replace(b"&QUOT;", b"&quot;"), lambda e: b"W/" + e,
                            lambda e: e.replace(b"&quot;", b"")):
                proxy.listing_etag, gets = respell, proxy.object_gets
                SyncDaemon(config, progress=False).run(once=True)
                assert {r.id for r in ledger.shards()} == before and "outdated" not in ledger.counters.all()
                assert proxy.object_gets == gets, "no object read again (footers kept, units cached)"
        finally:
            ledger.close()
    finally:
        proxy.close()
    assert _cached(config) == Counter(range(3 * ROWS))


def test_an_unchanged_or_shrunk_remote_retires_nothing(remote: Config, s3: Any, bucket: str) -> None:
    """Only a rewrite retires: rows of a deleted object are a sample the remote had, and retiring the
    shards holding them would read their shard-mates again (a shard mixes units of many objects)."""
    layout = CacheLayout(Path(remote.cache.dir))
    ledger = Ledger(layout.ledger)
    try:
        before = {r.id for r in ledger.shards()}
        SyncDaemon(remote, progress=False).run(once=True)
        s3.rm(f"{bucket}/data/part-2.parquet")
        SyncDaemon(remote, progress=False).run(once=True)
        assert {r.id for r in ledger.shards()} == before and "outdated" not in ledger.counters.all()
    finally:
        ledger.close()


def test_a_unit_skipped_as_its_object_was_rewritten_mid_pass_is_not_read_from_the_new_version(
    s3: Any, bucket: str, s3_endpoint: str, make_config: Callable[..., Config]
) -> None:
    for number in range(2):
        s3.pipe(f"{bucket}/data/part-{number}.parquet", _parquet(number * ROWS))
    proxy = FaultProxy(s3_endpoint, rate=0.0, seed=1)
    options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url}}
    config = make_config(f"s3://{bucket}/data", **{
        "source.storage_options": options, "cache.max_bytes": "50MB", "cache.shard_bytes": "100KB",
        "sampler.concurrency": 1, "sampler.mix_units": 1, "sampler.whole_object_bytes": 0,  # one GET at a time
    })

    # The new version has other rows but the same size: only the version pins it apart from the old
    new = next((data for start in range(NEW, NEW + 100_000, 251)
                if len(data := _parquet(start)) == len(_parquet(0))), None)
    assert new is not None

    def rewritten_after_its_first_unit(unit: Any) -> None:
        if unit.obj.path.endswith("part-0.parquet"):  # its other row group's GET then finds a new version
            key = f"{bucket}/data/part-0.parquet"
            proxy.rewrite_on_get(f"/{key}", lambda: s3.pipe(key, new))

    try:
        SyncDaemon(config, progress=False, on_fetch=rewritten_after_its_first_unit).run(once=True)
    finally:
        proxy.close()
    assert proxy.faults["rewrite"] == 1
    ids = _cached(config)
    assert not [i for i in ids if i >= NEW], "rows of a version this pass never listed, beside the listed one's"
    assert sum(ids.values()) == GROUP + ROWS and set(ids) >= set(range(ROWS, 2 * ROWS))
    ledger = Ledger(CacheLayout(Path(config.cache.dir)).ledger)
    try:
        assert ledger.counters.all()["objects_missing"] == 1, "the skipped unit dropped at the pass end, not read"
    finally:
        ledger.close()


def test_units_read_before_their_object_was_rewritten_and_not_yet_published_never_reach_the_cache(
    s3: Any, bucket: str, s3_options: dict[str, Any], make_config: Callable[..., Config]
) -> None:
    """A unit read (its old bytes in hand) and still in the shard being built when the next pass's
    listing shows its object rewritten: published after the shards of the old version were retired,
    its rows stayed for good, and its key, counting as cached, kept the new version from being read."""
    paths = [f"{bucket}/data/part-{number}.parquet" for number in range(2)]
    for number, path in enumerate(paths):
        s3.pipe(path, _parquet(number * ROWS))
    config = make_config(f"s3://{bucket}/data", **{
        "source.storage_options": s3_options, "cache.max_bytes": "200MB", "cache.shard_bytes": "50MB",
        "sampler.concurrency": 1, "sampler.mix_units": 1, "sampler.whole_object_bytes": 0,  # one GET at a time
    })
    fetched: list[str] = []

    def rewrite_the_object_of_the_second_unit(unit: Any) -> None:
        fetched.append(unit.obj.path)  # (the first unit is published alone: an empty cache's first shard)
        if len(fetched) == 2:
            s3.pipe(unit.obj.path, _parquet(NEW))

    daemon = DaemonThread(SyncDaemon(config, progress=False, on_fetch=rewrite_the_object_of_the_second_unit))
    try:
        wait_for(lambda: len(fetched) >= 2, timeout=30)
        other = paths.index(next(path for path in paths if path != fetched[1]))
        expected = Counter([*range(NEW, NEW + ROWS), *range(other * ROWS, (other + 1) * ROWS)])
        wait_for(lambda: _cached(config) == expected, timeout=30, interval=0.1)
    finally:
        daemon.stop()
    assert _epoch_ids(config) == expected

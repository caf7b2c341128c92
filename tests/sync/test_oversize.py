"""A unit larger than the budget can hold as one shard (a huge row group among normal ones): it is
skipped with its reason, never fetched for nothing, and the daemon caches every other unit, rather
than stop with a BudgetError for one object."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import make_table

import epochcache.sync.daemon as daemon_module
from epochcache import Ledger, OversizeUnitError, SyncDaemon
from epochcache.cache.layout import CacheLayout
from epochcache.config import Config, SourceConfig
from epochcache.sources import RemoteObject, Unit
from epochcache.sync.daemon import StopReason
from epochcache.sync.stream import Stream


def _remote_with_a_huge_unit(tmp_path: Path) -> Path:
    """One ~6 MB row group (written plain, so its metadata says so) and three small files."""
    remote = tmp_path / "remote"
    remote.mkdir()
    pq.write_table(make_table(8_000), remote / "huge.parquet", row_group_size=8_000, use_dictionary=False)
    for number in range(3):
        pq.write_table(make_table(100, 10_000 + 100 * number), remote / f"small-{number}.parquet", row_group_size=50)
    return remote


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The keys of the units the source was asked to read (fetched from the remote)."""
    asked: list[str] = []
    open_source = daemon_module.open_source

    def open_recorded(*args: Any) -> Any:
        source = open_source(*args)
        read = source.read
        monkeypatch.setattr(source, "read", lambda unit: asked.append(unit.key) or read(unit))
        return source

    monkeypatch.setattr(daemon_module, "open_source", open_recorded)
    return asked


def test_a_unit_over_the_budget_is_skipped_unread_and_the_rest_is_cached(
    tmp_path: Path, make_config: Callable[..., Config], reads: list[str]
) -> None:
    remote = _remote_with_a_huge_unit(tmp_path)
    config = make_config(str(remote), **{"cache.max_bytes": "4MB", "cache.shard_bytes": "1MB"})
    report = SyncDaemon(config, progress=False).run(once=True)
    assert report.reason is StopReason.EXHAUSTED
    assert report.samples_published == 300 and report.units_unread == 1
    huge = f"{remote}/huge.parquet#0"
    assert huge not in reads, "its metadata tells its size: it is not downloaded to be dropped"
    ledger = Ledger(CacheLayout(Path(config.cache.dir)).ledger)
    try:
        skipped = ledger.daemon.skipped()
        assert list(skipped) == [huge]
        assert "OversizeUnitError" in skipped[huge]["error"] and "cache.max_bytes" in skipped[huge]["error"]
    finally:
        ledger.close()


def test_a_large_unit_of_which_few_columns_are_read_is_judged_by_what_is_read(
    tmp_path: Path, make_config: Callable[..., Config], reads: list[str]
) -> None:
    """Its metadata's size counts every column: a unit whose selected columns fit is read and cached."""
    remote = _remote_with_a_huge_unit(tmp_path)
    config = make_config(str(remote), **{"cache.max_bytes": "4MB", "cache.shard_bytes": "1MB",
                                         "source.columns": ["id"]})
    report = SyncDaemon(config, progress=False).run(once=True)
    assert report.samples_published == 8_300 and report.units_unread == 0
    assert f"{remote}/huge.parquet#0" in reads


class _Understated:
    """A source whose metadata understates a unit's size (as a hostile remote's may)."""

    def read(self, unit: Unit) -> pa.Table:
        return make_table(2_000)


def test_a_unit_found_too_large_once_read_is_refused_too() -> None:
    stream = Stream(SourceConfig(url="remote"), _Understated(), largest_unit=1_000_000)  # type: ignore[arg-type]
    unit = Unit(RemoteObject("remote/x.parquet", 10), 0, None, None, nbytes=10)
    with pytest.raises(OversizeUnitError, match=r"remote/x.parquet#0 holds \d+ bytes \(read\)"):
        stream.read(unit)

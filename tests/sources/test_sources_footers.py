"""FooterStore: footers by object version on disk, within the budget it is given."""

from __future__ import annotations

import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from epochcache.cache.layout import bytes_under
from epochcache.config import SamplerConfig, SourceConfig
from epochcache.sources import open_source
from epochcache.sources.base import RemoteObject
from epochcache.sources.footers import STORE_LEAST, FooterStore, daemon_store

BUDGET = 2**20
OBJ = RemoteObject("bucket/a.parquet", 1000, '"0123456789abcdef0123456789abcdef"')


@pytest.mark.parametrize("size", [8192, BUDGET // 32], ids=["8KiB", "the largest kept"])
def test_the_store_stays_within_its_budget_dropping_the_oldest(tmp_path: Path, size: int) -> None:
    store = FooterStore(tmp_path / "footers", BUDGET)
    objects = [RemoteObject(f"bucket/part-{n:04d}.parquet", 10**6, f'"{n:032x}"') for n in range(300)]
    footers = [os.urandom(size) for _ in objects]
    peak = 0
    for obj, footer in zip(objects, footers, strict=True):
        store.put("Parquet", obj, footer)
        peak = max(peak, bytes_under(tmp_path / "footers"))  # the database, its log and its index
    assert peak <= BUDGET, f"{peak} bytes on disk for a budget of {BUDGET}"
    assert store.get("Parquet", objects[-1]) == footers[-1], "the newest is kept"
    assert store.get("Parquet", objects[0]) is None, "the oldest went to make room"
    kept = sum(store.get("Parquet", obj) == footer for obj, footer in zip(objects, footers, strict=True))
    assert BUDGET // 3 < kept * size <= BUDGET, "most of the budget holds footers"
    store.close()


def test_threads_storing_and_reading_at_once_keep_the_store_within_its_budget(tmp_path: Path) -> None:
    # (the daemon reads a mixing window's footers on its fetch threads, all at once)
    store = FooterStore(tmp_path / "footers", BUDGET)
    peaks: list[int] = []

    def work(thread: int) -> None:
        for n in range(40):
            obj = RemoteObject(f"bucket/{thread}-{n}.parquet", 10**6, f'"{thread}-{n}"')
            store.put("Parquet", obj, os.urandom(BUDGET // 32))
            store.get("Parquet", RemoteObject(f"bucket/{thread}-0.parquet", 10**6, f'"{thread}-0"'))
            peaks.append(bytes_under(tmp_path / "footers"))

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(work, range(8)))
    assert len(peaks) == 320 and max(peaks) <= BUDGET, f"{max(peaks)} bytes on disk for a budget of {BUDGET}"


def test_a_store_reopened_within_a_smaller_budget_is_trimmed_to_it(tmp_path: Path) -> None:
    store = FooterStore(tmp_path / "footers", 4 * BUDGET)
    for n in range(200):
        store.put("Parquet", RemoteObject(f"bucket/{n}.parquet", 10**6, f'"{n}"'), os.urandom(16384))
    store.close()
    assert bytes_under(tmp_path / "footers") > 2 * BUDGET
    FooterStore(tmp_path / "footers", BUDGET).close()
    assert bytes_under(tmp_path / "footers") <= BUDGET


@pytest.mark.parametrize(("share", "free"), [(0, 10 * BUDGET), (BUDGET, STORE_LEAST - 1)])
def test_a_daemon_without_room_for_footers_keeps_none_and_deletes_those_kept(
    tmp_path: Path, share: int, free: int
) -> None:
    FooterStore(tmp_path / "footers", BUDGET).put("Parquet", OBJ, b"footer")
    assert daemon_store(tmp_path / "footers", share, free) is None
    assert not (tmp_path / "footers").exists()
    store = daemon_store(tmp_path / "footers", BUDGET, BUDGET)
    assert store is not None


def test_a_footer_is_kept_per_format_and_version_only(tmp_path: Path) -> None:
    store = FooterStore(tmp_path / "footers", BUDGET)
    obj = OBJ
    store.put("Parquet", obj, b"footer")
    assert store.get("Parquet", obj) == b"footer"
    assert store.get("Arrow IPC", obj) is None
    assert store.get("Parquet", RemoteObject(obj.path, obj.size, '"ffffffffffffffffffffffffffffffff"')) is None
    assert store.get("Parquet", RemoteObject(obj.path, obj.size + 1, obj.etag)) is None
    unpinned = RemoteObject("bucket/b.parquet", 1000, None)
    store.put("Parquet", unpinned, b"footer")
    assert store.get("Parquet", unpinned) is None, "nothing pins a version without an ETag"
    large = RemoteObject("bucket/c.parquet", 10**7, '"1"')
    store.put("Parquet", large, bytes(BUDGET // 16 + 1))
    assert store.get("Parquet", large) is None, "a footer over a sixteenth of the budget is not kept"
    store.forget("Parquet", obj)
    assert store.get("Parquet", obj) is None
    store.close()


def test_a_store_damaged_on_disk_is_emptied_and_made_afresh(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = FooterStore(tmp_path / "footers", BUDGET)
    store.put("Parquet", OBJ, b"footer")
    store.close()
    for name in os.listdir(tmp_path / "footers"):  # a crash, a bad disk: the database is garbage now
        (tmp_path / "footers" / name).write_bytes(os.urandom(8192))
    store = FooterStore(tmp_path / "footers", BUDGET)
    assert "is damaged" in caplog.text
    assert store.get("Parquet", OBJ) is None
    store.put("Parquet", OBJ, b"footer again")
    assert store.get("Parquet", OBJ) == b"footer again"
    store.close()


class _Failing:
    """A diskcache whose every operation fails with ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def _fail(self, *args: Any) -> None:
        raise self.error

    get = set = delete = __contains__ = _fail


def test_a_store_that_fails_is_switched_off_and_reads_go_on(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = FooterStore(tmp_path / "footers", BUDGET)
    store.put("Parquet", OBJ, b"footer")
    store._cache = _Failing(sqlite3.OperationalError("database or disk is full"))  # type: ignore[assignment]
    store.put("Parquet", RemoteObject("bucket/b.parquet", 1000, '"1"'), b"footer")  # no error escapes
    assert caplog.text.count("footers are no longer kept") == 1 and "disk is full" in caplog.text
    assert store.get("Parquet", OBJ) is None, "switched off: nothing served, not even what was kept"
    store.forget("Parquet", OBJ)
    store.put("Parquet", OBJ, b"footer")
    assert caplog.text.count("footers are no longer kept") == 1, "said once"
    assert (tmp_path / "footers").is_dir(), "a full disk says nothing of the database: kept for the next run"


def test_a_store_found_damaged_while_open_is_switched_off_and_deleted(tmp_path: Path) -> None:
    store = FooterStore(tmp_path / "footers", BUDGET)
    store._cache = _Failing(sqlite3.DatabaseError("database disk image is malformed"))  # type: ignore[assignment]
    assert store.get("Parquet", OBJ) is None
    assert not (tmp_path / "footers").exists(), "deleted: the next run makes it afresh"
    store.put("Parquet", OBJ, b"footer")
    assert FooterStore(tmp_path / "footers", BUDGET).get("Parquet", OBJ) is None


def test_a_row_that_is_not_a_footer_is_never_unpickled_and_the_store_is_made_afresh(tmp_path: Path) -> None:
    store = FooterStore(tmp_path / "footers", BUDGET)
    store.put("Parquet", OBJ, b"footer")
    store.close()
    with sqlite3.connect(tmp_path / "footers" / "cache.db") as db:  # damage: a pickled value's mode
        db.execute("UPDATE Cache SET mode = 4")
    store = FooterStore(tmp_path / "footers", BUDGET)
    assert store.get("Parquet", OBJ) is None
    assert not (tmp_path / "footers").exists()


def test_a_footer_kept_already_is_not_written_again(tmp_path: Path) -> None:
    store = FooterStore(tmp_path / "footers", BUDGET)
    store.put("Parquet", OBJ, b"footer")
    store.put("Parquet", OBJ, b"the same version's footer, read again")
    assert store.get("Parquet", OBJ) == b"footer"


def test_footers_are_kept_only_where_reads_are_pinned_to_the_listed_version(tmp_path: Path) -> None:
    fs = fsspec.filesystem("memory")  # (an fsspec filesystem other than S3: its reads are not pinned)
    with fs.open("/footers-test/a.parquet", "wb") as f:
        pq.write_table(pa.table({"x": list(range(100))}), f, row_group_size=25)
    store = FooterStore(tmp_path / "footers", BUDGET)
    source = open_source(SourceConfig(url="memory://footers-test", format="parquet"),
                         SamplerConfig(whole_object_bytes=0), store)
    (listed,) = source.list_objects()
    tagged = RemoteObject(listed.path, listed.size, "1764150000.0-1628")  # as an mtime-size tag would read
    assert len(source.units(tagged)) == 4
    assert store.get(source.kind, tagged) is None
    fs.rm("/footers-test", recursive=True)

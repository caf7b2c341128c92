"""WholeObjects (small objects read whole) and the daemon reading a remote of small Arrow IPC objects."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pytest
from conftest import cached_ids, make_table

from epochcache import SyncDaemon
from epochcache.config import Config
from epochcache.errors import CorruptObjectError
from epochcache.sources import RemoteObject
from epochcache.sources.wholes import WholeObjects


class GatedRemote:
    """A remote whose whole reads wait for ``gate`` (injection: a slow GET) and can fail; counts them."""

    url, local = "s3://gated", False

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.calls = 0
        self.fail: BaseException | None = None

    def fetch_whole(self, obj: RemoteObject) -> bytes:
        self.calls += 1
        self.gate.wait(10)
        if self.fail is not None:
            raise self.fail
        return obj.path.encode() * (obj.size // len(obj.path))


def _obj(name: str, size: int = 1000) -> RemoteObject:
    return RemoteObject(f"bucket/{name}", size, f'"{name}"')


def _parsed(obj: RemoteObject, data: pa.Buffer) -> int:
    """A parse of the whole bytes (the sources parse the footer): here, its length, counted."""
    PARSES.append(obj.path)
    return data.size


PARSES: list[str] = []


def _wholes(remote: GatedRemote, parse: Any = _parsed, **kwargs: Any) -> WholeObjects[Any]:
    PARSES.clear()
    return WholeObjects(remote, parse, **kwargs)  # type: ignore[arg-type]


def test_readers_of_one_object_share_one_fetch_and_parse() -> None:
    remote = GatedRemote()
    wholes = _wholes(remote)
    obj = _obj("a")
    with ThreadPoolExecutor(4) as pool:
        reads = [pool.submit(wholes.bytes_of, obj) for _ in range(4)]
        remote.gate.set()
        got = [read.result(timeout=10) for read in reads]
    assert remote.calls == 1 and PARSES == [obj.path]
    assert all(data.equals(got[0][0]) and parsed == 1000 for data, parsed in got)
    assert got[0][0].to_pybytes().startswith(b"bucket/a")


@pytest.mark.parametrize("fails", ["fetch", "parse"])
def test_a_failed_fetch_or_parse_fails_its_waiters_and_is_fetched_again(fails: str) -> None:
    remote = GatedRemote()
    refused = [True]

    def parse(obj: RemoteObject, data: pa.Buffer) -> int:
        if fails == "parse" and refused[0]:
            raise CorruptObjectError("footers differ")
        return data.size

    if fails == "fetch":
        remote.fail = TimeoutError("slow store")
    wholes = _wholes(remote, parse)
    obj = _obj("a")
    with ThreadPoolExecutor(2) as pool:
        reads = [pool.submit(wholes.bytes_of, obj) for _ in range(2)]
        remote.gate.set()
        for read in reads:
            with pytest.raises((TimeoutError, CorruptObjectError), match="slow store|footers differ"):
                read.result(timeout=10)
    assert wholes.held_bytes() == 0 and remote.calls == 1, "one fetch, no bytes kept"
    remote.fail, refused[0] = None, False
    assert wholes.bytes_of(obj)[1] == 1000 and remote.calls == 2


def test_an_object_is_let_go_once_each_unit_was_read_or_forgotten() -> None:
    remote = GatedRemote()
    remote.gate.set()
    wholes = _wholes(remote)
    obj = _obj("a")
    wholes.bytes_of(obj)
    wholes.done(obj, 0, 2)
    wholes.done(obj, 0, 2)  # the same unit again (another slice of it) does not count twice
    assert wholes.held_bytes() == 1000
    wholes.done(obj, 1, 2)
    assert wholes.held_bytes() == 0 and wholes.wanted(obj), "let go, and read whole again if wanted"
    wholes.bytes_of(obj)
    assert remote.calls == 2
    wholes.forget(obj)
    assert wholes.held_bytes() == 0
    wholes.bytes_of(obj)
    assert remote.calls == 3


def test_the_least_recently_read_objects_are_let_go_for_room() -> None:
    remote = GatedRemote()
    remote.gate.set()
    wholes = _wholes(remote, most_bytes=1000, keep_bytes=2500)
    a, b, c = (_obj(name) for name in "abc")
    wholes.bytes_of(a)
    wholes.bytes_of(b)
    wholes.bytes_of(a)  # read again: now the most recently read
    wholes.bytes_of(c)
    assert wholes.held_bytes() == 2000, "at most keep_bytes held"
    wholes.bytes_of(a)
    assert remote.calls == 3, "a, still held, not fetched again"
    wholes.bytes_of(b)
    assert remote.calls == 4, "b, let go, fetched again"
    assert wholes.wanted(RemoteObject(b.path, 1000, '"rewritten"'))
    assert not wholes.wanted(_obj("big", 1001)) and not wholes.wanted(_obj("empty", 0))


def test_the_daemon_reads_each_small_object_in_two_gets(
    s3: Any, bucket: str, s3_endpoint: str, make_config: Callable[..., Config]
) -> None:
    """A remote of small Arrow IPC objects, 3 record batches each, through a proxy counting requests:
    each object costs its footer's GET and one GET of its bytes (not 3 ranged ones plus the footer's
    second read), and every row is cached exactly once."""
    from faultproxy import FaultProxy

    objects, rows = 6, 30
    for number in range(objects):
        table = make_table(rows, number * rows)
        with s3.open(f"{bucket}/small/part-{number:03d}.arrow", "wb") as f, pa.ipc.new_file(f, table.schema) as w:
            for batch in table.to_batches(max_chunksize=rows // 3):
                w.write_batch(batch)
    proxy = FaultProxy(s3_endpoint, rate=0.0)
    try:
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url}}
        config = make_config(f"s3://{bucket}/small", **{"source.format": "arrow", "source.storage_options": options,
                                                         "cache.max_bytes": "50MB", "cache.shard_bytes": "1MB"})
        report = SyncDaemon(config).run(once=True)
        assert report.units_skipped == 0
        assert sorted(cached_ids(config.cache.dir)) == list(range(objects * rows))
        assert proxy.object_gets == 2 * objects, f"{proxy.object_gets} GETs for {objects} objects of 3 units"
    finally:
        proxy.close()


def test_flipped_bits_in_small_arrow_objects_never_reach_a_row(s3: Any, bucket: str, s3_endpoint: str) -> None:
    """Arrow IPC has no checksum of its own: read whole, a small object is checked by its MD5 ETag, so
    with half of all object GETs flipping one bit every row still reads exactly as written (read in
    ranges, the same flips reach rows unseen)."""
    from faultproxy import FaultProxy

    from epochcache.sources import ArrowSource
    from epochcache.sources.retry import Retrier

    written = {}
    for number in range(4):
        table = make_table(60, number * 60)
        path = f"{bucket}/flips/part-{number:03d}.arrow"
        with s3.open(path, "wb") as f, pa.ipc.new_file(f, table.schema) as w:
            for batch in table.to_batches(max_chunksize=20):
                w.write_batch(batch)
        written[path] = table
    proxy = FaultProxy(s3_endpoint, rate=0.0, flip_rate=0.5, seed=5)
    try:
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url}}
        source = ArrowSource(f"s3://{bucket}/flips", storage_options=options)
        retrier = Retrier(20, 0.0, 0.0, lambda name: None)
        for obj in source.list_objects():
            units = retrier.call(source.units, obj, what="units")
            read = pa.concat_tables([retrier.call(source.read, unit, what=unit.key) for unit in units])
            assert read.drop_columns(["__key__"]).equals(written[obj.path]), f"{obj.path}: rows differ"
        assert proxy.faults["flip"] >= 4
    finally:
        proxy.close()


@pytest.mark.parametrize("where", ["footer", "unit"])
@pytest.mark.parametrize("fmt", ["arrow", "parquet"])
def test_a_failed_whole_read_is_fetched_afresh_on_the_retry(
    s3: Any, bucket: str, s3_options: dict[str, Any], monkeypatch: pytest.MonkeyPatch, fmt: str, where: str
) -> None:
    """The first whole fetch comes back damaged where no checksum caught it (injection: as from a store
    whose ETags are no MD5s), in its footer's length (its parse fails) or at the start of its first
    unit (that unit's decode fails): the read is corrupt, and the retry fetches the bytes again rather
    than using the held ones again."""
    import pyarrow.parquet as pq

    from epochcache.sources import ArrowSource, ParquetSource

    table = make_table(30)
    path = f"{bucket}/once/part-000.{fmt}"
    with s3.open(path, "wb") as f:
        if fmt == "arrow":
            with pa.ipc.new_file(f, table.schema) as writer:
                writer.write_table(table, max_chunksize=10)
        else:
            pq.write_table(table, f, row_group_size=10)
    source = (ArrowSource if fmt == "arrow" else ParquetSource)(f"s3://{bucket}/once", storage_options=s3_options)
    (obj,) = source.list_objects()
    units = source.units(obj)
    if where == "footer":  # the footer length's high byte (then ARROW1 / PAR1)
        at, span = obj.size - (7 if fmt == "arrow" else 5), 1
    else:  # the first batch's message length / the first page's header, after the file's magic
        at = source._footer(obj).blocks[0][0] if fmt == "arrow" else 4  # type: ignore[attr-defined]
        span = 8
    fetched: list[str] = []
    real = source._remote.fetch_whole  # type: ignore[attr-defined]

    def damaged_once(obj: RemoteObject) -> bytes:
        data = real(obj)
        fetched.append(obj.path)
        if len(fetched) > 1:
            return data
        return data[:at] + bytes(b ^ 0x40 for b in data[at:at + span]) + data[at + span:]

    monkeypatch.setattr(source._remote, "fetch_whole", damaged_once)  # type: ignore[attr-defined]
    with pytest.raises(CorruptObjectError, match="footer" if where == "footer" else "unreadable"):
        source.read(units[0])
    assert source.read(units[0]).column("id").to_pylist() == list(range(10))
    assert len(fetched) == 2

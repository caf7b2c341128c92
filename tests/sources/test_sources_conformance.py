"""One conformance suite every source passes, on a local folder and on the S3 server.

Each format stores the same samples (``make_table``'s ids; the table formats also its images whose
pixels equal ``id % 251``) in several objects, then the suite checks the Source protocol: listing,
units covering every row exactly once, stable unique keys, column selection, ranged reads only
(requests counted: one per unit), and the errors for missing objects, corrupt files and unknown
columns. Where a format cannot have a property, the test says why it is skipped.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diskcache
import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import make_table

from epochcache.config import SamplerConfig, SourceConfig
from epochcache.errors import CorruptObjectError, ObjectMissingError, SourceError
from epochcache.sources import KEY_COLUMN, RemoteObject, Source, open_source
from epochcache.sources.footers import FooterStore

OBJECTS, UNITS_PER_FILE, ROWS_PER_UNIT = 3, 4, 40


def _write_parquet(fs: Any, root: str, number: int, table: pa.Table) -> None:
    with fs.open(f"{root}/part-{number:03d}.parquet", "wb") as f:
        pq.write_table(table, f, row_group_size=ROWS_PER_UNIT)


def _write_arrow(fs: Any, root: str, number: int, table: pa.Table) -> None:
    with fs.open(f"{root}/part-{number:03d}.arrow", "wb") as f, pa.ipc.new_file(f, table.schema) as writer:
        writer.write_table(table, max_chunksize=ROWS_PER_UNIT)


def _write_tar(fs: Any, root: str, number: int, table: pa.Table) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for sample_id in table.column("id").to_pylist():
            for field, payload in (("id", str(sample_id).encode()), ("image", bytes([sample_id % 251]) * 16)):
                info = tarfile.TarInfo(f"samples/{sample_id:06d}.{field}")
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    fs.pipe(f"{root}/part-{number:03d}.tar", buffer.getvalue())


def _write_objects(fs: Any, root: str, number: int, table: pa.Table) -> None:
    fs.makedirs(f"{root}/part-{number:03d}", exist_ok=True)
    for sample_id in table.column("id").to_pylist():
        fs.pipe(f"{root}/part-{number:03d}/{sample_id:06d}.bin", str(sample_id).encode())


def _int_ids(column: str) -> Callable[[pa.Table], list[int]]:
    return lambda table: [int(value) for value in table.column(column).to_pylist()]


@dataclass(frozen=True)
class Format:
    """How one format stores the shared samples, and how to read their ids back."""

    name: str
    write: Callable[[Any, str, int, pa.Table], None]  # (fs, root, object number, its rows)
    rows_per_object: int
    units_per_object: int
    id_column: str
    ids: Callable[[pa.Table], list[int]]
    suffix: str | None  # None: every object under the URL is data

    @property
    def total(self) -> int:
        return OBJECTS * self.rows_per_object

    @property
    def objects(self) -> int:  # objects listed: one per sample for the "objects" format
        return OBJECTS * (self.rows_per_object if self.name == "objects" else 1)


FORMATS = [
    Format("parquet", _write_parquet, UNITS_PER_FILE * ROWS_PER_UNIT, UNITS_PER_FILE, "id", _int_ids("id"), ".parquet"),
    Format("arrow", _write_arrow, UNITS_PER_FILE * ROWS_PER_UNIT, UNITS_PER_FILE, "id", _int_ids("id"), ".arrow"),
    Format("webdataset", _write_tar, ROWS_PER_UNIT, 1, "id", _int_ids("id"), ".tar"),
    Format("objects", _write_objects, 4, 1, "data", _int_ids("data"), None),
]


class CallCounter:
    """Wraps ``RemoteFiles._read`` (every request of a source goes through it): counts the requests
    and the bytes asked for; behaviour unchanged."""

    def __init__(self, inner: Callable[..., bytes]) -> None:
        self.inner, self.calls, self.requested = inner, 0, 0

    def __call__(self, obj: RemoteObject, start: int, end: int, whole: bool, *into: memoryview) -> bytes:
        self.calls += 1
        self.requested += end - start
        return self.inner(obj, start, end, whole, *into)


@pytest.fixture(params=FORMATS, ids=lambda f: f.name)
def fmt(request: pytest.FixtureRequest) -> Format:
    return request.param


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Any, str, dict[str, Any]]:
    """(filesystem, root path, storage_options) of an empty dataset folder."""
    if request.param == "local":
        return fsspec.filesystem("file"), str(tmp_path / "remote"), {}
    s3, bucket, options = (request.getfixturevalue(n) for n in ("s3", "bucket", "s3_options"))
    return s3, f"{bucket}/remote", options


def _url(fs: Any, root: str) -> str:
    return root if fs.protocol in ("file", ("file", "local")) else f"s3://{root}"


@pytest.fixture
def dataset(fmt: Format, where: tuple[Any, str, dict[str, Any]]) -> tuple[Any, str, dict[str, Any]]:
    fs, root, options = where
    fs.makedirs(root, exist_ok=True)
    for number in range(OBJECTS):
        fmt.write(fs, root, number, make_table(fmt.rows_per_object, number * fmt.rows_per_object))
    if fmt.suffix is not None:
        fs.pipe(f"{root}/README.txt", b"not data")
    return fs, root, options


def _source(fmt: Format, dataset: tuple[Any, str, dict[str, Any]], sampler: SamplerConfig | None = None,
            footers: FooterStore | None = None, **kwargs: Any) -> Source:
    fs, root, options = dataset
    config = SourceConfig(url=_url(fs, root), format=fmt.name, storage_options=options, **kwargs)
    return open_source(config, sampler, footers)


def test_lists_only_its_objects_sorted(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    objects = _source(fmt, dataset).list_objects()
    assert len(objects) == fmt.objects
    assert [o.path for o in objects] == sorted(o.path for o in objects)
    assert all(o.size > 0 for o in objects)
    if fmt.suffix is not None:
        assert all(o.path.endswith(fmt.suffix) for o in objects), "README.txt is not data"


def test_units_cover_every_row_once_with_stable_keys(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    source = _source(fmt, dataset)
    ids, keys, by_unit = [], [], {}
    for obj in source.list_objects():
        units = source.units(obj)
        assert len(units) == fmt.units_per_object and len({u.key for u in units}) == len(units)
        for unit in units:
            table = source.read(unit)
            assert unit.rows in (None, table.num_rows)
            assert all(key.startswith(f"{obj.path}:") for key in table.column(KEY_COLUMN).to_pylist())
            ids.extend(fmt.ids(table))
            keys.extend(table.column(KEY_COLUMN).to_pylist())
            by_unit[unit.key] = table.column(KEY_COLUMN).to_pylist()
    assert sorted(ids) == list(range(fmt.total))
    assert len(set(keys)) == fmt.total
    again = _source(fmt, dataset)  # a fresh source (a restarted daemon) names every row alike
    obj = again.list_objects()[-1]
    unit = again.units(obj)[-1]
    assert again.read(unit).column(KEY_COLUMN).to_pylist() == by_unit[unit.key]


def test_table_formats_keep_every_value(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    if fmt.name not in ("parquet", "arrow"):
        pytest.skip("the image tensor column exists only in the table formats")
    source = _source(fmt, dataset)
    table = source.read(source.units(source.list_objects()[1])[2])
    pixels = table.column("image").combine_chunks().to_numpy_ndarray()[:, 0, 0, 0]
    assert (pixels == np.array(table.column("id")) % 251).all()


def test_column_selection(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    source = _source(fmt, dataset, columns=[fmt.id_column])
    obj = source.list_objects()[0]
    assert source.read(source.units(obj)[-1]).column_names == [fmt.id_column, KEY_COLUMN]


def test_reads_are_few_ranged_gets(
    fmt: Format, dataset: tuple[Any, str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _source(fmt, dataset, SamplerConfig(whole_object_bytes=0))
    obj = source.list_objects()[0]
    counter = CallCounter(source._remote._read)  # type: ignore[attr-defined]
    monkeypatch.setattr(source._remote, "_read", counter)  # type: ignore[attr-defined]
    units = source.units(obj)
    confirm = 0 if _url(*dataset[:2]) == dataset[1] else 1  # over a network the footer is read once more
    assert counter.calls <= 2 + confirm, "metadata: at most one tail read and a second for a large footer"
    before = counter.calls, counter.requested
    source.read(units[-1])
    assert counter.calls - before[0] == 1, "one ranged GET per unit"
    if fmt.units_per_object > 1:
        assert counter.requested - before[1] < obj.size / 2, "a unit, never the whole object"


def test_small_objects_are_read_whole_in_one_get(
    fmt: Format, dataset: tuple[Any, str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    if fmt.name not in ("parquet", "arrow"):
        pytest.skip("tars and one-sample objects are read whole whatever their size")
    remote = _url(*dataset[:2]) != dataset[1]
    source = _source(fmt, dataset)
    obj = source.list_objects()[0]
    counter = CallCounter(source._remote._read)  # type: ignore[attr-defined]
    monkeypatch.setattr(source._remote, "_read", counter)  # type: ignore[attr-defined]
    units = source.units(obj)
    assert counter.calls == 1, "the footer is read once: the whole object's checksum covers it"
    tail = counter.requested
    tables = [source.read(unit) for unit in units]
    if remote:
        assert counter.calls == 2, "one GET serves every unit"
        assert counter.requested - tail == obj.size + 1, "the object, and one byte past it (growth is seen)"
    else:
        assert counter.calls == 1 + len(units), "a local file is read in ranges: nothing to save or check"
    ranged = _source(fmt, dataset, SamplerConfig(whole_object_bytes=0))
    assert all(table.equals(ranged.read(unit)) for unit, table in zip(units, tables, strict=True))
    source.read(units[0])  # every unit was read, so the object was let go: fetched again
    assert counter.calls == (3 if remote else 2 + len(units))


def _counted(source: Source, monkeypatch: pytest.MonkeyPatch) -> CallCounter:
    counter = CallCounter(source._remote._read)  # type: ignore[attr-defined]
    monkeypatch.setattr(source._remote, "_read", counter)  # type: ignore[attr-defined]
    return counter


# Footers are kept for the formats that have them, read over a network (a local file's footer is read
# again: that costs no request).
footed = pytest.mark.parametrize(("fmt", "where"), [(FORMATS[0], "s3"), (FORMATS[1], "s3")],
                                 ids=["parquet-s3", "arrow-s3"], indirect=["where"])


RANGED = SamplerConfig(whole_object_bytes=0)


@footed
@pytest.mark.parametrize("sampler", [RANGED, SamplerConfig()], ids=["ranged", "whole"])
def test_a_footer_kept_on_disk_is_not_read_again(
    fmt: Format, dataset: tuple[Any, str, dict[str, Any]], sampler: SamplerConfig, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    footers = FooterStore(tmp_path / "footers", 2**20)
    first = _source(fmt, dataset, sampler, footers)
    objects = first.list_objects()
    counter = _counted(first, monkeypatch)
    for obj in objects:
        [first.read(unit) for unit in first.units(obj)]  # a whole object's footer is kept once checked
    whole = sampler.whole_object_bytes > 0
    assert counter.calls == len(objects) * (2 if whole else 2 + fmt.units_per_object), "tail (+ confirm) + units"
    # A new source (a later pass, a restart, or footers gone from memory in a wide mixing window)
    again = _source(fmt, dataset, sampler, footers)
    counter = _counted(again, monkeypatch)
    units = [unit for obj in objects for unit in again.units(obj)]
    assert counter.calls == 0, "no footer read again"
    ids = sorted(i for unit in units for i in fmt.ids(again.read(unit)))
    assert ids == list(range(fmt.total))
    assert counter.calls == (len(objects) if whole else len(units)), "only the units' GETs"


@footed
def test_a_rewritten_object_is_not_answered_with_its_old_footer(
    fmt: Format, dataset: tuple[Any, str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    fs, root, _ = dataset
    footers = FooterStore(tmp_path / "footers", 2**20)
    first = _source(fmt, dataset, RANGED, footers)
    old = first.list_objects()[0]
    assert len(first.units(old)) == fmt.units_per_object
    fmt.write(fs, root, 0, make_table(ROWS_PER_UNIT, 10_000))  # one unit now, of other rows
    again = _source(fmt, dataset, RANGED, footers)
    new = next(obj for obj in again.list_objects() if obj.path == old.path)
    assert new.etag != old.etag
    counter = _counted(again, monkeypatch)
    units = again.units(new)
    assert counter.calls == 2, "the new version's footer read (and confirmed)"
    assert len(units) == 1 and fmt.ids(again.read(units[0])) == list(range(10_000, 10_000 + ROWS_PER_UNIT))


@footed
def test_a_footer_damaged_on_disk_is_read_from_the_remote_again(
    fmt: Format, dataset: tuple[Any, str, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    footers = FooterStore(tmp_path / "footers", 2**20)
    first = _source(fmt, dataset, RANGED, footers)
    obj = first.list_objects()[0]
    first.units(obj)
    footers.close()
    with diskcache.Cache(str(tmp_path / "footers")) as raw:  # the store's own files, damaged on disk
        (key,) = list(raw)
        value = bytearray(raw[key])
        value[len(value) // 2] ^= 0x10
        raw[key] = bytes(value)
    again = _source(fmt, dataset, RANGED, FooterStore(tmp_path / "footers", 2**20))
    counter = _counted(again, monkeypatch)
    units = again.units(obj)
    assert counter.calls == 2, "read from the remote, not from the damaged entry"
    assert "damaged on disk" in caplog.text
    assert sorted(i for unit in units for i in fmt.ids(again.read(unit))) == list(range(fmt.rows_per_object))


@footed
def test_a_kept_footer_that_fails_a_decode_is_dropped(
    fmt: Format, dataset: tuple[Any, str, dict[str, Any]], tmp_path: Path
) -> None:
    fs, root, _ = dataset
    footers = FooterStore(tmp_path / "footers", 2**20)
    source = _source(fmt, dataset, RANGED, footers)
    objects = source.list_objects()
    fmt.write(fs, root, 9, make_table(4 * ROWS_PER_UNIT + 7, 0))  # another layout: its footer misplaces units
    other = next(obj for obj in _source(fmt, dataset).list_objects() if obj.path.endswith(f"-009{fmt.suffix}"))
    footers.put(source.kind, objects[0], _source(fmt, dataset, RANGED)._fetch_footer(other))  # type: ignore[attr-defined]
    # Trusted at first (its checksum holds): the object's units, or their reads, do not add up
    with pytest.raises(CorruptObjectError):
        for unit in source.units(objects[0]):
            source.read(unit)
    again = _source(fmt, dataset, RANGED, footers)  # the retry, on a source with nothing in memory
    units = again.units(objects[0])
    assert len(units) == fmt.units_per_object
    assert sorted(i for unit in units for i in fmt.ids(again.read(unit))) == list(range(fmt.rows_per_object))


def test_a_missing_object_is_object_missing(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    fs, root, _ = dataset
    source = _source(fmt, dataset)
    obj = source.list_objects()[0]
    fs.rm(obj.path)
    with pytest.raises(ObjectMissingError, match=Path(obj.path).name):
        source.read(source.units(obj)[0])


def test_a_corrupt_file_is_a_corrupt_object_naming_it(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    if fmt.suffix is None:
        pytest.skip("any bytes are a valid sample when each object is one")
    fs, root, _ = dataset
    fs.pipe(f"{root}/zz-broken{fmt.suffix}", b"garbage" * 20)
    source = _source(fmt, dataset)
    broken = source.list_objects()[-1]
    with pytest.raises(CorruptObjectError, match="zz-broken"):
        source.read(source.units(broken)[0])


def test_an_unknown_column_is_a_source_error(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    if fmt.name == "webdataset":
        pytest.skip("webdataset columns name fields; a field no sample has is a column of nulls, by design")
    with pytest.raises(SourceError, match="nope"):
        source = _source(fmt, dataset, columns=[fmt.id_column, "nope"])
        source.units(source.list_objects()[0])


def test_repr_hides_credentials(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    fs, root, options = dataset
    secret = {"key": "AKIACONFORMANCE", "secret": "conformance-secret"}
    source = open_source(SourceConfig(url=_url(fs, root), format=fmt.name, storage_options={**options, **secret}))
    assert "conformance-secret" not in repr(source) and "AKIACONFORMANCE" not in repr(source)


# ---- Hostile remote: every format, each damage either yields exactly the source's rows or raises
# CorruptObjectError (an object changed mid-pass: ObjectMissingError, skipped until the next listing).
# Never rows that differ from what was written.


def _unit_ids(fmt: Format, source: Source, obj: RemoteObject) -> list[list[int] | None]:
    """Each unit's ids, checked against their payload (:func:`_checked_ids`); None for a corrupt
    unit. A footer too damaged to split the object into units counts as one corrupt unit."""
    try:
        units = source.units(obj)
    except CorruptObjectError:
        return [None]
    out: list[list[int] | None] = []
    for unit in units:
        try:
            out.append(_checked_ids(fmt, source.read(unit), unit.key))
        except CorruptObjectError:
            out.append(None)
    return out


def _checked_ids(fmt: Format, table: pa.Table, where: str) -> list[int]:
    """The ids of ``table``, after checking each row's payload (pixels or bytes) matches its id."""
    ids = fmt.ids(table)
    if fmt.name in ("parquet", "arrow"):
        pixels = table.column("image").combine_chunks().to_numpy_ndarray()[:, 0, 0, 0]
        assert (pixels == np.array(ids) % 251).all(), f"{where}: wrong pixels"
    elif fmt.name == "webdataset":
        assert table.column("image").to_pylist() == [bytes([i % 251]) * 16 for i in ids], f"{where}: wrong bytes"
    return ids


def _assert_exact_or_corrupt(fmt: Format, got: list[list[int] | None], first: int) -> None:
    """Read units hold exactly the written ids, consecutive from ``first`` in unit order; skipped
    (corrupt) units only leave gaps."""
    expected = list(range(first, first + fmt.rows_per_object))
    read = [i for ids in got if ids is not None for i in ids]
    assert set(read) <= set(expected) and len(read) == len(set(read)), "rows that were never written"
    assert read == sorted(read), "rows out of their order"


def _damage(fs: Any, path: str, at: float | None, length: int) -> None:
    """XOR ``length`` bytes from the fraction ``at`` of the object (None: the middle of its footer)."""
    data = bytearray(fs.cat_file(path))
    if at is None:  # Parquet: <footer><u32 length>PAR1; Arrow IPC: <footer><i32 length>ARROW1
        trailer = 8 if data.endswith(b"PAR1") else 10
        footer = int.from_bytes(data[len(data) - trailer : len(data) - trailer + 4], "little")
        start = len(data) - trailer - footer // 2
    else:
        start = int(len(data) * at)
    data[start : start + length] = bytes(b ^ 0x5A for b in data[start : start + length])
    fs.pipe(path, bytes(data))


def test_hostile_damaged_metadata(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    if fmt.name == "objects":
        pytest.skip("an object per sample has no metadata to damage")
    fs, root, _ = dataset
    path = _source(fmt, dataset).list_objects()[1].path
    # the footer (tables) sits at the end; for a tar, the header of its second sample's first member
    _damage(fs, path, None if fmt.name != "webdataset" else 1024 / fs.size(path), 24)
    source = _source(fmt, dataset)
    got = _unit_ids(fmt, source, source.list_objects()[1])
    assert None in got, "the damage was noticed"
    _assert_exact_or_corrupt(fmt, got, fmt.rows_per_object)


def test_hostile_corrupt_payload(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    if fmt.name != "parquet":
        pytest.skip(f"{fmt.name} stores no checksum of its payload: damaged stored bytes are the source's bytes "
                    "(damage in transit is the bit-flip test's)")
    fs, root, _ = dataset
    for number in range(OBJECTS):  # rewritten with page CRCs, the way to make Parquet payload checkable
        with fs.open(f"{root}/part-{number:03d}.parquet", "wb") as f:
            pq.write_table(make_table(fmt.rows_per_object, number * fmt.rows_per_object), f,
                           row_group_size=ROWS_PER_UNIT, write_page_checksum=True)
    path = _source(fmt, dataset).list_objects()[1].path
    _damage(fs, path, 0.3, 8)
    source = _source(fmt, dataset)
    got = _unit_ids(fmt, source, source.list_objects()[1])
    assert None in got, "the damage was noticed"
    _assert_exact_or_corrupt(fmt, got, fmt.rows_per_object)


def test_hostile_truncated_object(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    if fmt.name == "objects":
        pytest.skip("any bytes are a sample when each object is one (a cut in transit is caught by length)")
    fs, root, _ = dataset
    path = _source(fmt, dataset).list_objects()[1].path
    fs.pipe(path, fs.cat_file(path)[: int(fs.size(path) * 0.6)])
    source = _source(fmt, dataset)
    got = _unit_ids(fmt, source, source.list_objects()[1])
    assert None in got
    _assert_exact_or_corrupt(fmt, got, fmt.rows_per_object)


@pytest.mark.parametrize("whole", [False, True], ids=["ranged", "whole"])
def test_hostile_object_rewritten_mid_pass(fmt: Format, dataset: tuple[Any, str, dict[str, Any]], whole: bool) -> None:
    """Every unit read is of the listed version: refused once the object changed, or, where the
    first unit's read fetched the whole object (small, remote), served from that version's bytes."""
    fs, root, _ = dataset
    held = whole and fmt.name in ("arrow", "parquet") and _url(fs, root) != root
    source = _source(fmt, dataset, SamplerConfig(whole_object_bytes=8 * 2**20 if whole else 0))
    obj = source.list_objects()[-1]
    units = source.units(obj)
    first = source.read(units[0])
    listed = [fmt.ids(first)] + [fmt.ids(source.read(unit)) for unit in units[1:]] if held else []
    source = _source(fmt, dataset, SamplerConfig(whole_object_bytes=8 * 2**20 if whole else 0))
    first = source.read(units[0])
    fs.pipe(obj.path, fs.cat_file(source.list_objects()[0].path) + b"\0" * 4096)  # another object's bytes
    if held:
        assert [fmt.ids(first)] + [fmt.ids(source.read(unit)) for unit in units[1:]] == listed
        return
    for unit in units:
        with pytest.raises(ObjectMissingError, match="changed since it was listed"):
            source.read(unit)


def test_hostile_bit_flips(fmt: Format, s3: Any, bucket: str, s3_endpoint: str) -> None:
    """Through the fault proxy, 30% of object GETs come back with one bit flipped; with retries every
    unit reads exactly as written (or, out of attempts, is corrupt): never a flipped row. (Arrow IPC has
    no checksum of its own: its small objects are read whole, checked by their MD5 ETag; a larger
    one's ranged reads cannot be checked, S3 has no checksum of a byte range.)"""
    from faultproxy import FaultProxy

    from epochcache.sources.retry import Retrier

    root = f"{bucket}/flips"
    for number in range(OBJECTS):
        table = make_table(fmt.rows_per_object, number * fmt.rows_per_object)
        if fmt.name == "parquet":
            with s3.open(f"{root}/part-{number:03d}.parquet", "wb") as f:
                pq.write_table(table, f, row_group_size=ROWS_PER_UNIT, write_page_checksum=True)
        else:
            fmt.write(s3, root, number, table)
    proxy = FaultProxy(s3_endpoint, rate=0.0, flip_rate=0.3, seed=3)
    try:
        options = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": proxy.url}}
        source = open_source(SourceConfig.model_validate(
            {"url": f"s3://{root}", "format": fmt.name, "storage_options": options}))
        retrier = Retrier(10, 0.0, 0.0, lambda name: None)
        read: list[int] = []
        for obj in source.list_objects():
            for unit in retrier.call(source.units, obj, what="units"):
                read.extend(_checked_ids(fmt, retrier.call(source.read, unit, what=unit.key), unit.key))
        assert proxy.faults["flip"] > 0
        assert sorted(read) == list(range(fmt.total)), "every row, exactly once, exactly as written"
    finally:
        proxy.close()


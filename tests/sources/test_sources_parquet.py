"""Tests for epochcache.sources.parquet over a loopback S3 server (moto) and a local folder."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import s3fs
from conftest import make_table, write_parquet_dataset
from pydantic import ValidationError

from epochcache.config import SourceConfig
from epochcache.errors import CorruptObjectError, SourceError
from epochcache.sources import KEY_COLUMN, ParquetSource, RemoteObject, open_source

FILES = 3
ROWS_PER_FILE = 40
ROWS_PER_GROUP = 16  # groups of 16, 16, 8


class RangeSpy:
    """Wraps ``RemoteFiles._read`` (every request goes through it) and records the byte ranges asked
    for; behaviour unchanged."""

    def __init__(self, inner: Callable[..., bytes]) -> None:
        self.inner = inner
        self.calls: list[tuple[str, int | None, int | None, int]] = []

    def __call__(self, obj: RemoteObject, start: int, end: int, whole: bool, *into: memoryview) -> bytes:
        data = self.inner(obj, start, end, whole, *into)
        self.calls.append((obj.path, start, end, len(data)))
        return data

    @property
    def requested(self) -> int:
        return sum(end - start for _, start, end, _ in self.calls if start is not None and end is not None)

    @property
    def received(self) -> int:
        return sum(n for *_, n in self.calls)


@pytest.fixture
def s3_dataset(s3: s3fs.S3FileSystem, bucket: str) -> list[str]:
    return write_parquet_dataset(s3, f"{bucket}/data", FILES, ROWS_PER_FILE, ROWS_PER_GROUP)


@pytest.fixture
def s3_source(s3_dataset: list[str], bucket: str, s3_options: dict[str, Any]) -> ParquetSource:
    return ParquetSource(f"s3://{bucket}/data", storage_options=s3_options)


@pytest.fixture
def local_root(tmp_path: Path) -> str:
    root = str(tmp_path / "remote")
    fs = fsspec.filesystem("file")
    fs.makedirs(root, exist_ok=True)
    write_parquet_dataset(fs, root, FILES, ROWS_PER_FILE, ROWS_PER_GROUP)
    return root


def check_units_and_reads(source: ParquetSource, objects: list[RemoteObject]) -> None:
    """Every unit of every object has the right rows/offsets and reads back the right ids and keys."""
    for number, obj in enumerate(objects):
        units = source.units(obj)
        assert [u.index for u in units] == [0, 1, 2]
        assert [u.rows for u in units] == [16, 16, 8]
        assert [u.row_offset for u in units] == [0, 16, 32]
        assert all(u.obj == obj and u.nbytes > 0 for u in units)
        assert [u.key for u in units] == [f"{obj.path}#{i}" for i in range(3)]
        for unit in units:
            table = source.read(unit)
            assert table.column_names == ["image", "id", KEY_COLUMN]
            assert table.num_rows == unit.rows
            first_id = number * ROWS_PER_FILE + unit.row_offset
            assert table.column("id").to_pylist() == list(range(first_id, first_id + unit.rows))
            rows = range(unit.row_offset, unit.row_offset + unit.rows)
            assert table.column(KEY_COLUMN).to_pylist() == [f"{obj.path}:{row}" for row in rows]
            assert table.schema.field(KEY_COLUMN).type == pa.string()
            images = table.column("image").chunk(0).to_numpy_ndarray()
            assert np.array_equal(images[:, 0, 0, 0], (np.array(table.column("id").to_pylist()) % 251).astype(np.uint8))


# -- listing --------------------------------------------------------------------------------------


def test_list_objects_s3(s3_source: ParquetSource, s3_dataset: list[str], s3: s3fs.S3FileSystem) -> None:
    objects = s3_source.list_objects()
    assert [o.path for o in objects] == sorted(s3_dataset)
    assert [o.size for o in objects] == [s3.size(p) for p in sorted(s3_dataset)]


def test_list_objects_local(local_root: str) -> None:
    objects = ParquetSource(local_root).list_objects()
    assert [Path(o.path).name for o in objects] == ["part-000.parquet", "part-001.parquet", "part-002.parquet"]
    assert [o.size for o in objects] == [Path(o.path).stat().st_size for o in objects]


def test_list_objects_skips_other_files_and_finds_nested(local_root: str) -> None:
    Path(local_root, "README.txt").write_text("not data")
    Path(local_root, "_SUCCESS").write_bytes(b"")
    nested = Path(local_root, "sub")
    nested.mkdir()
    pq.write_table(make_table(5, start=1000), nested / "extra.parq")
    names = [Path(o.path).name for o in ParquetSource(local_root).list_objects()]
    assert names == ["part-000.parquet", "part-001.parquet", "part-002.parquet", "extra.parq"]


def test_list_objects_sorted_by_path(local_root: str) -> None:
    Path(local_root, "sub").mkdir()
    pq.write_table(make_table(5), Path(local_root, "sub", "a.parquet"))
    paths = [o.path for o in ParquetSource(local_root).list_objects()]
    assert paths == sorted(paths)
    assert len(paths) == FILES + 1


def test_single_file_url(s3_dataset: list[str], s3_options: dict[str, Any]) -> None:
    source = ParquetSource(f"s3://{s3_dataset[1]}", storage_options=s3_options)
    objects = source.list_objects()
    assert [o.path for o in objects] == [s3_dataset[1]]
    ids = source.read(source.units(objects[0])[0]).column("id").to_pylist()
    assert ids == list(range(ROWS_PER_FILE, ROWS_PER_FILE + 16))


def test_prefix_does_not_match_sibling_folder(
    s3: s3fs.S3FileSystem, bucket: str, s3_dataset: list[str], s3_options: dict[str, Any]
) -> None:
    with s3.open(f"{bucket}/data2/other.parquet", "wb") as f:
        pq.write_table(make_table(4), f)
    objects = ParquetSource(f"s3://{bucket}/data", storage_options=s3_options).list_objects()
    assert [o.path for o in objects] == sorted(s3_dataset)


def test_empty_prefix_s3(bucket: str, s3_options: dict[str, Any]) -> None:
    source = ParquetSource(f"s3://{bucket}/nothing-here", storage_options=s3_options)
    with pytest.raises(SourceError) as info:
        source.list_objects()
    assert f"s3://{bucket}/nothing-here" in str(info.value)


def test_empty_local_folder(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.csv").write_text("a,b\n")
    with pytest.raises(SourceError, match="no Parquet files"):
        ParquetSource(str(tmp_path / "empty")).list_objects()


def test_missing_local_folder(tmp_path: Path) -> None:
    with pytest.raises(SourceError):
        ParquetSource(str(tmp_path / "absent")).list_objects()


# -- units and reads ------------------------------------------------------------------------------


def test_units_and_read_s3(s3_source: ParquetSource) -> None:
    check_units_and_reads(s3_source, s3_source.list_objects())


def test_units_and_read_local(local_root: str) -> None:
    source = ParquetSource(local_root)
    check_units_and_reads(source, source.list_objects())


def test_column_selection(s3_dataset: list[str], bucket: str, s3_options: dict[str, Any]) -> None:
    source = ParquetSource(f"s3://{bucket}/data", columns=["id"], storage_options=s3_options)
    obj = source.list_objects()[2]
    unit = source.units(obj)[1]
    table = source.read(unit)
    assert table.column_names == ["id", KEY_COLUMN]
    assert table.column("id").to_pylist() == list(range(2 * ROWS_PER_FILE + 16, 2 * ROWS_PER_FILE + 32))
    assert table.column(KEY_COLUMN)[0].as_py() == f"{obj.path}:16"


def test_column_selection_fetches_only_that_column(
    s3_dataset: list[str], bucket: str, s3_options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    both = ParquetSource(f"s3://{bucket}/data", storage_options=s3_options)
    only_id = ParquetSource(f"s3://{bucket}/data", columns=["id"], storage_options=s3_options)
    fetched = []
    for source in (both, only_id):
        obj = source.list_objects()[0]
        unit = source.units(obj)[0]  # footer read before spying
        spy = RangeSpy(source._remote._read)
        monkeypatch.setattr(source._remote, "_read", spy)
        source.read(unit)
        monkeypatch.undo()
        assert len(spy.calls) == 1  # one ranged GET per unit
        fetched.append(spy.requested)
    assert fetched[1] < fetched[0]


def test_unknown_column_named(s3_dataset: list[str], bucket: str, s3_options: dict[str, Any]) -> None:
    source = ParquetSource(f"s3://{bucket}/data", columns=["id", "labelz"], storage_options=s3_options)
    obj = source.list_objects()[0]
    with pytest.raises(SourceError) as info:
        source.units(obj)
    message = str(info.value)
    assert "labelz" in message
    assert "id" in message and "image" in message  # the columns that do exist


def test_not_parquet_with_parquet_suffix_s3(
    s3: s3fs.S3FileSystem, bucket: str, s3_options: dict[str, Any]
) -> None:
    s3.pipe(f"{bucket}/bad/fake.parquet", b"id,label\n1,cat\n2,dog\n" * 10)
    source = ParquetSource(f"s3://{bucket}/bad", storage_options=s3_options)
    (obj,) = source.list_objects()
    with pytest.raises(CorruptObjectError) as info:
        source.units(obj)
    assert "fake.parquet" in str(info.value)


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"PAR1",
        b"hello world" + (10**9).to_bytes(4, "little") + b"PAR1",  # footer length beyond the file
        b"PAR1" + b"x" * 100 + (50).to_bytes(4, "little") + b"PAR1",  # garbage footer
    ],
    ids=["empty", "magic-only", "huge-footer-length", "garbage-footer"],
)
def test_corrupt_parquet_is_corrupt_object_local(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(content)
    source = ParquetSource(str(path))
    (obj,) = source.list_objects()
    with pytest.raises(CorruptObjectError, match="broken.parquet"):
        source.units(obj)


def test_huge_footer_length_is_corrupt_object_s3(
    s3: s3fs.S3FileSystem, bucket: str, s3_options: dict[str, Any]
) -> None:
    s3.pipe(f"{bucket}/bad/odd.parquet", b"hello world" + (10**9).to_bytes(4, "little") + b"PAR1")
    source = ParquetSource(f"s3://{bucket}/bad", storage_options=s3_options)
    (obj,) = source.list_objects()
    with pytest.raises(CorruptObjectError, match="odd.parquet"):
        source.units(obj)


def test_large_footer_needs_second_read(tmp_path: Path) -> None:
    # Over 64 KiB of footer (many columns): the first tail read is not enough.
    table = pa.table({f"column_{i:04d}": pa.array(np.arange(10, dtype=np.int64)) for i in range(1500)})
    path = tmp_path / "wide.parquet"
    pq.write_table(table, path, row_group_size=5)
    assert pq.read_metadata(path).serialized_size > 64 * 1024
    source = ParquetSource(str(path), columns=["column_0042", "column_1499"])
    (obj,) = source.list_objects()
    units = source.units(obj)
    assert [u.rows for u in units] == [5, 5]
    back = source.read(units[1])
    assert back.column_names == ["column_0042", "column_1499", KEY_COLUMN]
    assert back.column("column_0042").to_pylist() == list(range(5, 10))


def test_read_fetches_a_small_part_of_a_large_file(
    s3: s3fs.S3FileSystem, bucket: str, s3_options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(0)
    rows = 40_000
    table = pa.table(
        {
            "id": pa.array(np.arange(rows, dtype=np.int64)),
            "payload": pa.array(rng.integers(0, 2**62, size=rows, dtype=np.int64)),  # incompressible
        }
    )
    with s3.open(f"{bucket}/big/data.parquet", "wb") as f:
        pq.write_table(table, f, row_group_size=rows // 8)
    # (a file over whole_object_bytes: read in ranges)
    source = ParquetSource(f"s3://{bucket}/big", storage_options=s3_options, whole_object_bytes=0)
    (obj,) = source.list_objects()

    spy = RangeSpy(source._remote._read)
    monkeypatch.setattr(source._remote, "_read", spy)
    units = source.units(obj)
    assert len(units) >= 4
    back = source.read(units[5])

    assert back.column("id").to_pylist() == list(range(5 * rows // 8, 6 * rows // 8))
    assert all(start is not None and end is not None for _, start, end, _ in spy.calls)  # ranged GETs only
    assert len(spy.calls) == 3  # the tail, the footer's bytes again (a check), the row group
    assert spy.requested < obj.size / 3, (spy.requested, obj.size)
    assert spy.received < obj.size / 3


def test_footer_is_read_once_per_object(
    s3_dataset: list[str], bucket: str, s3_options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_source = ParquetSource(f"s3://{bucket}/data", storage_options=s3_options, whole_object_bytes=0)  # ranges
    obj = s3_source.list_objects()[0]
    spy = RangeSpy(s3_source._remote._read)
    monkeypatch.setattr(s3_source._remote, "_read", spy)
    units = s3_source.units(obj)
    s3_source.units(obj)
    for unit in units:
        s3_source.read(unit)
    assert len(spy.calls) == 2 + len(units), "the tail and its footer's check once, then a GET per unit"


def test_missing_object_is_source_error(tmp_path: Path, local_root: str) -> None:
    source = ParquetSource(local_root)
    obj = source.list_objects()[0]
    Path(obj.path).unlink()
    with pytest.raises(SourceError, match="is gone"):
        source.units(obj)


# -- construction ---------------------------------------------------------------------------------


def test_repr_hides_storage_options(bucket: str, s3_endpoint: str) -> None:
    secret = "Sup3rS3cretValue-do-not-print"
    options = {"key": "AKIDEXAMPLEKEY", "secret": secret, "client_kwargs": {"endpoint_url": s3_endpoint}}
    source = ParquetSource(f"s3://{bucket}/data", storage_options=options)
    text = repr(source)
    assert secret not in text
    assert "AKIDEXAMPLEKEY" not in text
    assert f"s3://{bucket}/data" in text
    assert secret not in str(source)


def test_open_source_from_config(local_root: str) -> None:
    source = open_source(SourceConfig(url=local_root, columns=["id"]))
    assert isinstance(source, ParquetSource)
    assert source.columns == ["id"]
    obj = source.list_objects()[0]
    assert source.read(source.units(obj)[0]).column_names == ["id", KEY_COLUMN]


# -- known bugs -----------------------------------------------------------------------------------


def write_dotted(path: Path) -> None:
    table = pa.table(
        {
            "id": pa.array(np.arange(100, dtype=np.int64)),
            "feature.x": pa.array(np.arange(100, dtype=np.float64) * 2),
            "label": pa.array(np.arange(100, dtype=np.int64) % 3),
        }
    )
    pq.write_table(table, path, row_group_size=50)


def test_all_columns_of_dotted_file_read(tmp_path: Path) -> None:
    # Without a column selection a dot in a name is harmless.
    write_dotted(tmp_path / "dots.parquet")
    source = ParquetSource(str(tmp_path / "dots.parquet"))
    back = source.read(source.units(source.list_objects()[0])[1])
    assert back.column("feature.x").to_pylist() == [2.0 * i for i in range(50, 100)]


@pytest.mark.parametrize("columns", [["feature.x"], ["id", "feature.x"], ["label", "feature.x"]])
def test_selecting_column_with_dot_in_name(tmp_path: Path, columns: list[str]) -> None:
    write_dotted(tmp_path / "dots.parquet")
    source = ParquetSource(str(tmp_path / "dots.parquet"), columns=columns)
    unit = source.units(source.list_objects()[0])[1]
    back = source.read(unit)
    assert back.column_names == [*columns, KEY_COLUMN]
    assert back.column("feature.x").to_pylist() == [2.0 * i for i in range(50, 100)]


def test_empty_column_selection_is_refused(local_root: str) -> None:
    with pytest.raises(ValidationError, match="columns"):
        SourceConfig(url=local_root, columns=[])
    with pytest.raises(SourceError, match="empty"):
        ParquetSource(local_root, columns=[])


def test_unselected_middle_columns_are_not_downloaded(
    s3: s3fs.S3FileSystem, bucket: str, s3_options: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(1)
    rows = 300_000  # ~2.4 MB of incompressible int64 per column: gaps above the 1 MiB read-through
    table = pa.table({name: pa.array(rng.integers(0, 2**62, size=rows, dtype=np.int64)) for name in "abc"})
    with s3.open(f"{bucket}/wide/data.parquet", "wb") as f:
        pq.write_table(table, f, row_group_size=rows)
    source = ParquetSource(f"s3://{bucket}/wide", columns=["a", "c"], storage_options=s3_options)
    (obj,) = source.list_objects()
    (unit,) = source.units(obj)
    spy = RangeSpy(source._remote._read)
    monkeypatch.setattr(source._remote, "_read", spy)
    back = source.read(unit)
    assert back.column("c").equals(table.column("c"))
    assert len(spy.calls) == 2, "one GET per run of wanted chunks"
    assert spy.requested < obj.size * 0.7, (spy.requested, obj.size)  # column b (a third) left out


def test_a_units_bytes_count_the_wanted_columns_only(tmp_path: Path) -> None:
    """The daemon bounds its bytes in flight and refuses oversized units by ``Unit.nbytes``: a row group
    whose wanted column is small must not be sized by its other columns."""
    pq.write_table(make_table(2_000), tmp_path / "part.parquet", row_group_size=2_000, use_dictionary=False)
    every = ParquetSource(str(tmp_path)).units(ParquetSource(str(tmp_path)).list_objects()[0])[0]
    ids = ParquetSource(str(tmp_path), columns=["id"])
    wanted = ids.units(ids.list_objects()[0])[0]
    assert every.nbytes > 1_000_000
    assert 16_000 <= wanted.nbytes < 40_000, "2,000 int64 ids, plainly encoded, and their page headers"

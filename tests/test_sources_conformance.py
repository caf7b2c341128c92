"""One conformance suite every source passes, on a local folder and on the S3 server.

Each format writes the same samples (``make_table``: an id and an image whose pixels equal
``id % 251``) into several files of several units, then the suite checks the Source protocol:
listing, units covering every row exactly once, stable unique keys, column selection, ranged reads
only (requests counted), and the errors for missing objects, corrupt files and unknown columns.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import make_table

from epochcache.config import SourceConfig
from epochcache.errors import ObjectMissingError, SourceError
from epochcache.sources import KEY_COLUMN, Source, open_source

FILES, UNITS_PER_FILE, ROWS_PER_UNIT = 3, 4, 40
TOTAL = FILES * UNITS_PER_FILE * ROWS_PER_UNIT


def _write_parquet(f: Any, table: pa.Table) -> None:
    pq.write_table(table, f, row_group_size=ROWS_PER_UNIT)


def _write_arrow(f: Any, table: pa.Table) -> None:
    with pa.ipc.new_file(f, table.schema) as writer:
        writer.write_table(table, max_chunksize=ROWS_PER_UNIT)


@dataclass(frozen=True)
class Format:
    name: str
    suffix: str
    write: Callable[[Any, pa.Table], None]


FORMATS = [Format("parquet", ".parquet", _write_parquet), Format("arrow", ".arrow", _write_arrow)]


class CallCounter:
    """Wraps ``cat_file``: counts the requests and the bytes asked for; behaviour unchanged."""

    def __init__(self, inner: Callable[..., bytes]) -> None:
        self.inner, self.calls, self.requested = inner, 0, 0

    def __call__(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        if start is None or end is None:
            raise AssertionError(f"a whole-object read of {path}")
        self.calls += 1
        self.requested += end - start
        return self.inner(path, start=start, end=end, **kwargs)


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
    per_file = UNITS_PER_FILE * ROWS_PER_UNIT
    for number in range(FILES):
        with fs.open(f"{root}/part-{number:03d}{fmt.suffix}", "wb") as f:
            fmt.write(f, make_table(per_file, number * per_file))
    fs.pipe(f"{root}/README.txt", b"not data")
    return fs, root, options


def _source(fmt: Format, dataset: tuple[Any, str, dict[str, Any]], **kwargs: Any) -> Source:
    fs, root, options = dataset
    return open_source(SourceConfig(url=_url(fs, root), format=fmt.name, storage_options=options, **kwargs))


def test_lists_only_its_files_sorted(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    objects = _source(fmt, dataset).list_objects()
    assert [Path(o.path).name for o in objects] == [f"part-{n:03d}{fmt.suffix}" for n in range(FILES)]
    assert all(o.size > 0 for o in objects)


def test_units_cover_every_row_once_with_stable_keys(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    source = _source(fmt, dataset)
    ids, keys = [], []
    for obj in source.list_objects():
        units = source.units(obj)
        assert len(units) == UNITS_PER_FILE and len({u.key for u in units}) == UNITS_PER_FILE
        for unit in units:
            table = source.read(unit)
            assert unit.rows in (None, table.num_rows)
            assert all(key.startswith(f"{obj.path}:") for key in table.column(KEY_COLUMN).to_pylist())
            ids.extend(table.column("id").to_pylist())
            keys.extend(table.column(KEY_COLUMN).to_pylist())
            pixels = table.column("image").combine_chunks().to_numpy_ndarray()[:, 0, 0, 0]
            assert (pixels == np.array(table.column("id")) % 251).all()
    assert sorted(ids) == list(range(TOTAL))
    assert len(set(keys)) == TOTAL
    again = _source(fmt, dataset)  # a fresh source (a restarted daemon) names every row alike
    obj = again.list_objects()[1]
    assert again.read(again.units(obj)[2]).column(KEY_COLUMN).to_pylist() == [
        k for k in keys if k.startswith(f"{obj.path}:")][2 * ROWS_PER_UNIT : 3 * ROWS_PER_UNIT]


def test_column_selection(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    source = _source(fmt, dataset, columns=["id"])
    obj = source.list_objects()[0]
    assert source.read(source.units(obj)[1]).column_names == ["id", KEY_COLUMN]


def test_reads_are_few_ranged_gets_never_whole_objects(
    fmt: Format, dataset: tuple[Any, str, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _source(fmt, dataset)
    obj = source.list_objects()[0]
    counter = CallCounter(source._remote.fs.cat_file)  # type: ignore[attr-defined]
    monkeypatch.setattr(source._remote.fs, "cat_file", counter)  # type: ignore[attr-defined]
    units = source.units(obj)
    assert counter.calls <= 2, "metadata: one tail read, a second only for a large footer"
    before = counter.calls, counter.requested
    source.read(units[1])
    assert counter.calls - before[0] == 1, "one ranged GET per unit"
    assert counter.requested - before[1] < obj.size / 2


def test_a_missing_object_is_object_missing(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    fs, root, _ = dataset
    source = _source(fmt, dataset)
    obj = source.list_objects()[0]
    fs.rm(obj.path)
    with pytest.raises(ObjectMissingError, match=Path(obj.path).name):
        source.units(obj)


def test_a_corrupt_file_is_a_source_error_naming_it(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    fs, root, _ = dataset
    fs.pipe(f"{root}/zz-broken{fmt.suffix}", b"garbage" * 20)
    source = _source(fmt, dataset)
    broken = source.list_objects()[-1]
    with pytest.raises(SourceError, match="zz-broken"):
        source.units(broken)


def test_an_unknown_column_is_a_source_error(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    source = _source(fmt, dataset, columns=["id", "nope"])
    with pytest.raises(SourceError, match="nope"):
        source.units(source.list_objects()[0])


def test_repr_hides_credentials(fmt: Format, dataset: tuple[Any, str, dict[str, Any]]) -> None:
    fs, root, options = dataset
    secret = {"key": "AKIACONFORMANCE", "secret": "conformance-secret"}
    source = open_source(SourceConfig(url=_url(fs, root), format=fmt.name, storage_options={**options, **secret}))
    assert "conformance-secret" not in repr(source) and "AKIACONFORMANCE" not in repr(source)

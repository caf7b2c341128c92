"""Arrow arrays built from buffers give what pyarrow's conversions give, and no epochcache process
imports pandas (pyarrow does, at its first conversion, wherever pandas is installed: 147 ms and 56 MB)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from epochcache.arrays import binaries, flags, numbers, numpy_view, text, texts, unpacked


@pytest.mark.parametrize("dtype", [np.int8, np.uint16, np.int32, np.int64, np.float16, np.float32, np.float64])
def test_numbers_and_their_views_round_trip_any_numeric_dtype(dtype: type) -> None:
    values = np.arange(40).astype(dtype)
    array = numbers(values[::2])  # (not contiguous: copied once)
    assert array.equals(pa.array(values[::2]))
    view = numpy_view(array.slice(3, 9))
    assert view.dtype == np.dtype(dtype) and view.tolist() == values[::2][3:12].tolist()


def test_views_of_sliced_list_and_tensor_columns_share_the_columns_memory() -> None:
    flat = np.arange(96, dtype=np.uint8)
    lists = pa.FixedSizeListArray.from_arrays(pa.FixedSizeListArray.from_arrays(numbers(flat), 4), 3)
    tensor_type = pa.fixed_shape_tensor(pa.uint8(), [3, 4])
    tensors = pa.ExtensionArray.from_storage(tensor_type, pa.FixedSizeListArray.from_arrays(numbers(flat), 12))
    for column in (lists, tensors):
        view = numpy_view(column.slice(2, 5))
        assert view.shape == (5, 3, 4)
        assert view.tolist() == flat.reshape(8, 3, 4)[2:7].tolist()
        assert np.shares_memory(view, flat)
    permuted = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.uint8(), [3, 4], permutation=[1, 0]),
                                              tensors.storage)
    np.testing.assert_array_equal(numpy_view(permuted), permuted.to_numpy_ndarray())
    assert numpy_view(numbers(np.zeros(0, np.int64))).shape == (0,)
    assert numpy_view(tensors.slice(8, 0)).shape == (0, 3, 4)


def test_views_of_lists_over_sliced_values_and_refusal_of_null_numbers() -> None:
    flat = np.arange(40, dtype=np.int16)
    lists = pa.FixedSizeListArray.from_arrays(numbers(flat).slice(4), 4)  # (the values have an offset too)
    assert numpy_view(lists.slice(1, 3)).tolist() == flat[4:].reshape(9, 4)[1:4].tolist()
    holed = pa.FixedSizeListArray.from_arrays(pa.array([1, None, 3, 4, 5, 6], pa.int16()), 2)
    assert numpy_view(holed.slice(1)).tolist() == [[3, 4], [5, 6]]
    with pytest.raises(ValueError, match="1 null items or numbers"):
        numpy_view(holed)


def test_numbers_of_bools_and_of_either_byte_order_and_a_refusal_of_strings() -> None:
    assert numbers(np.array([True, False, True])).equals(pa.array([True, False, True]))
    big = np.arange(5, dtype=">i4")
    assert numbers(big).equals(pa.array(np.arange(5, dtype=np.int32)))
    day = np.array(["2026-11-26"], "datetime64[s]")
    assert numbers(day).equals(pa.array(day))
    with pytest.raises(TypeError, match="<U3"):
        numbers(np.array(["abc"]))


def test_a_null_item_inside_a_row_is_refused_not_read_as_numbers() -> None:
    inner = pa.FixedSizeListArray.from_arrays(numbers(np.arange(8, dtype=np.float32)), 2,
                                              mask=pa.array([False, True, False, False]))
    column = pa.FixedSizeListArray.from_arrays(inner, 2)  # row 0's second item is null; no row is
    assert column.null_count == 0
    with pytest.raises(ValueError, match="1 null items"):
        numpy_view(column)
    assert numpy_view(column.slice(1)).tolist() == [[[4, 5], [6, 7]]]


def test_a_tensor_column_over_sliced_values_is_viewed_at_its_rows() -> None:
    flat = np.arange(60, dtype=np.uint8)
    storage = pa.FixedSizeListArray.from_arrays(numbers(flat).slice(6), 6)  # 9 items of 2x3
    tensors = pa.ExtensionArray.from_storage(pa.fixed_shape_tensor(pa.uint8(), [2, 3]), storage)
    assert numpy_view(tensors.slice(2, 3)).tolist() == flat[6:].reshape(9, 2, 3)[2:5].tolist()


def test_flags_and_unpacked_bools_match_pyarrows() -> None:
    mask = np.random.default_rng(0).random(37) < 0.5
    assert flags(mask).equals(pa.array(mask))
    assert unpacked(flags(mask).slice(5, 20)).tolist() == mask[5:25].tolist()


def test_binaries_and_texts_match_pyarrows_with_nulls_and_empty_values() -> None:
    values = [b"ab", None, b"", b"xyz", memoryview(b"mv")]
    built = binaries(values)
    built.validate(full=True)
    assert built.equals(pa.array([b"ab", None, b"", b"xyz", b"mv"], pa.binary()))
    assert texts(["é", "", "abc"]).equals(pa.array(["é", "", "abc"], pa.string()))
    assert binaries([]).equals(pa.array([], pa.binary()))
    wide = memoryview(np.arange(3, dtype=np.int32))  # (items of 4 bytes: its bytes count, not its items)
    assert binaries([wide]).to_pylist() == [np.arange(3, dtype=np.int32).tobytes()]
    keys = pc.binary_join_element_wise(text("a/b:"), pc.cast(numbers(np.arange(3)), pa.string()), text(""))
    assert keys.to_pylist() == ["a/b:0", "a/b:1", "a/b:2"]


def test_binaries_past_the_bytes_an_array_holds_are_chunked_and_a_value_past_them_refused() -> None:
    values = [b"abc", b"de", b"f", b"ghij", None, b"mn"]
    chunked = binaries(values, max_bytes=5)
    assert isinstance(chunked, pa.ChunkedArray)
    assert all(sum(len(v or b"") for v in chunk.to_pylist()) <= 5 for chunk in chunked.chunks)
    assert chunked.to_pylist() == values
    with pytest.raises(ValueError, match="6 bytes"):
        binaries([b"abcdef"], max_bytes=5)


# Importing it leaves a line in $PANDAS_IMPORTED, then fails as if pandas were not installed.
_FAKE_PANDAS = """
import os
with open(os.environ["PANDAS_IMPORTED"], "a") as f:
    f.write("pandas imported\\n")
raise ImportError("pandas (a stand-in that records its import)")
"""

_RUN = """
import json, sys
from epochcache import EpochCachedLoader, SyncDaemon
from epochcache.config import SourceConfig, load_config
from epochcache.sources import open_source
remote, cache, tars, objects = sys.argv[1:]
config = load_config(None, {"source.url": remote, "cache.dir": cache, "cache.shard_bytes": "64KiB",
                            "sampler.row_fraction": 0.5})
for _ in range(2):  # (two passes: both halves of every unit)
    SyncDaemon(config, progress=False).run(once=True)
seen = {}
for workers in (0, 2):
    with EpochCachedLoader(cache, batch_size=16, num_workers=workers, progress=False) as loader:
        batches = list(loader)
    seen[workers] = sorted(i for b in batches for i in b["id"].tolist())
    for b in batches:  # (the Arrow and binary columns came with their rows)
        ids = b["id"].tolist()
        assert b["tags"].to_pylist() == [[i] * (i % 3) for i in ids], b["tags"]
        blobs = [None if v is None else bytes(v) for v in b["blob"]]
        assert blobs == [None if i % 5 == 0 else b"x" * (i % 7) for i in ids]
        assert b["caption"] == [f"sample {i}" for i in ids]
for url, fmt, extra in ((tars, "webdataset", {}), (objects, "objects", {"labels": "folder"})):
    source = open_source(SourceConfig(url=url, format=fmt, **extra))
    seen[fmt] = sum(source.read(u).num_rows for o in source.list_objects() for u in source.units(o))
print(json.dumps(seen))
"""


@pytest.mark.slow  # (fresh processes: 4 s)
def test_no_process_of_the_daemon_or_the_loader_imports_pandas(tmp_path: Path) -> None:
    fake = tmp_path / "site" / "pandas"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(_FAKE_PANDAS)
    ids = np.arange(96, dtype=np.int64)
    table = pa.table({
        "id": ids,
        "image": pa.FixedShapeTensorArray.from_numpy_ndarray(np.zeros((96, 2, 2), np.uint8)),
        "tags": pa.array([[int(i)] * int(i % 3) for i in ids], pa.list_(pa.int32())),  # (an Arrow column)
        "blob": pa.array([None if i % 5 == 0 else b"x" * int(i % 7) for i in ids], pa.binary()),  # (with nulls)
        "caption": pa.array([f"sample {i}" for i in ids], pa.string()),
    })
    (tmp_path / "remote").mkdir()
    pq.write_table(table, tmp_path / "remote" / "part-0.parquet", row_group_size=24)
    (tmp_path / "tars").mkdir()
    with tarfile.open(tmp_path / "tars" / "a.tar", "w") as tar:
        for key, field in (("s0", "jpg"), ("s0", "cls"), ("s1", "jpg")):
            info = tarfile.TarInfo(f"{key}.{field}")
            info.size = 3
            tar.addfile(info, io.BytesIO(b"abc"))
    for name in ("cat/1.bin", "dog/2.bin"):
        (tmp_path / "objects" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "objects" / name).write_bytes(b"pixels")
    marker = tmp_path / "pandas_imported"
    env = {**os.environ, "PANDAS_IMPORTED": str(marker),
           "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    ran = subprocess.run(
        [sys.executable, "-c", _RUN, str(tmp_path / "remote"), str(tmp_path / "cache"), str(tmp_path / "tars"),
         str(tmp_path / "objects")], env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    seen = json.loads(ran.stdout.splitlines()[-1])
    assert seen["0"] == seen["2"] == ids.tolist() and seen["webdataset"] == 2 and seen["objects"] == 2
    assert not marker.exists(), "pyarrow was made to import pandas"

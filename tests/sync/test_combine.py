"""A shard's rows combined unit by unit equal the units' rows concatenated, for every column kind."""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import epochcache.sync.combine as combine_module
from epochcache.sources.pool import ROWS_POOL
from epochcache.sync.combine import combine

ROWS = 7


def unit(first: int, with_nulls: bool) -> pa.Table:
    """ROWS rows of many column kinds, some sliced out of a longer array (a non-zero offset)."""
    ids = np.arange(first, first + ROWS + 3, dtype=np.int64)
    pixels = (np.arange(first, first + (ROWS + 3) * 6) % 251).astype(np.uint8)
    images = pa.FixedSizeListArray.from_arrays(pa.array(pixels), 6).slice(2, ROWS)
    tensor_type = pa.fixed_shape_tensor(pa.float32(), [2, 3])
    tensors = pa.ExtensionArray.from_storage(
        tensor_type, pa.FixedSizeListArray.from_arrays(pa.array(pixels[: ROWS * 6].astype(np.float32)), 6))
    blobs = pa.array([bytes([i % 256]) * 4 for i in ids], pa.binary(4)).slice(1, ROWS)
    words = [None if with_nulls and i % 3 == 0 else f"w{i}" for i in ids[:ROWS]]
    maybe = [None if with_nulls and i % 2 else float(i) for i in ids[:ROWS]]
    return pa.table({
        "id": pa.array(ids).slice(3, ROWS), "image": images, "tensor": tensors, "blob": blobs,
        "raw": pa.array([bytes(int(i) % 5) for i in ids[:ROWS]], pa.binary()),
        "word": pa.array(words, pa.string()), "maybe": pa.array(maybe, pa.float64()),
        "flag": pa.array([bool(i % 2) for i in ids[:ROWS]]), "tags": pa.array([[int(i)] * 2 for i in ids[:ROWS]]),
    })


@pytest.mark.parametrize("units", [1, 2, 5])
@pytest.mark.parametrize("with_nulls", [False, True])
def test_combined_rows_equal_the_units_concatenated(units: int, with_nulls: bool) -> None:
    tables = [unit(100 * n, with_nulls) for n in range(units)]
    expected = pa.concat_tables(tables).combine_chunks()

    rows = combine(tables, ROWS_POOL)

    assert tables == [], "the units were not let go"
    assert rows.schema == expected.schema
    assert all(column.num_chunks == 1 for column in rows.columns)
    assert rows.equals(expected)
    rows.validate(full=True)


def test_a_column_with_a_null_in_one_unit_is_combined_like_any_other() -> None:
    """A fixed-size column is copied into one buffer only if no unit has a null in it."""
    tables = [pa.table({"x": pa.array([1.0, 2.0])}), pa.table({"x": pa.array([None, 4.0])})]
    expected = pa.concat_tables(tables).combine_chunks()

    rows = combine(tables, ROWS_POOL)

    assert rows.equals(expected) and rows.column("x").null_count == 1


def test_each_unit_is_let_go_before_the_shard_is_finished(monkeypatch: pytest.MonkeyPatch) -> None:
    """The units and the shard are never both held whole: each unit's buffers are freed once copied."""
    events: list[str] = []
    tables = []
    for number in range(3):
        values = np.full(1000, number, dtype=np.int64)
        weakref.finalize(values, events.append, f"unit {number} freed")
        column = pa.Array.from_buffers(pa.int64(), len(values), [None, pa.py_buffer(values)])
        tables.append(pa.table({"x": column}))
        del values, column
    finish = combine_module._Fixed.finish

    def finishing(sink: Any) -> pa.Array:
        events.append("finish")
        return finish(sink)

    monkeypatch.setattr(combine_module._Fixed, "finish", finishing)

    rows = combine(tables, ROWS_POOL)

    assert events == ["unit 0 freed", "unit 1 freed", "unit 2 freed", "finish"]
    assert rows.column("x").to_pylist() == [0] * 1000 + [1] * 1000 + [2] * 1000

"""Tensor shapes from field metadata (:func:`epochcache.cache.columns.shaped`)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from epochcache.cache.columns import is_fixed_width, shaped
from epochcache.errors import SourceError
from epochcache.sources.layouts import tensor_table


def test_fixed_size_binary_with_a_shape_becomes_a_tensor_over_the_same_bytes() -> None:
    images = np.arange(5 * 3 * 2 * 2, dtype=np.uint8).reshape(5, 3, 2, 2)
    table = tensor_table({"image": images, "id": np.arange(5)})
    data = table.column("image").chunk(0).buffers()[1]

    out = shaped(table.slice(1, 3))

    column = out.column("image").chunk(0)
    assert out.schema.field("image").type == pa.fixed_shape_tensor(pa.uint8(), [3, 2, 2])
    assert is_fixed_width(column.type)
    assert column.storage.values.buffers()[1].address == data.address, "no copy"
    np.testing.assert_array_equal(column.to_numpy_ndarray(), images[1:4])
    assert out.column("id").to_pylist() == [1, 2, 3]


def test_a_dtype_in_the_metadata_reads_the_bytes_as_that_type() -> None:
    values = np.arange(4 * 6, dtype=np.float32).reshape(4, 2, 3)
    out = shaped(tensor_table({"x": values}))
    assert out.schema.field("x").type == pa.fixed_shape_tensor(pa.float32(), [2, 3])
    np.testing.assert_array_equal(out.column("x").combine_chunks().to_numpy_ndarray(), values)


def test_a_fixed_size_list_with_a_shape_becomes_a_tensor() -> None:
    flat = pa.FixedSizeListArray.from_arrays(pa.array(np.arange(12, dtype=np.int16)), 6)
    field = pa.field("x", flat.type, metadata={"shape": "[2, 3]"})
    out = shaped(pa.Table.from_arrays([flat], schema=pa.schema([field])))
    assert out.column("x").combine_chunks().to_numpy_ndarray().tolist() == [[[0, 1, 2], [3, 4, 5]],
                                                                            [[6, 7, 8], [9, 10, 11]]]


def test_a_table_without_shapes_is_returned_as_it_is() -> None:
    table = pa.table({"id": [1, 2], "blob": pa.array([b"ab", b"cd"], pa.binary(2))})
    assert shaped(table) is table


@pytest.mark.parametrize(("kind", "metadata", "says"), [
    (pa.binary(12), {"shape": "[3, 3]"}, "does not fill its type"),
    (pa.binary(12), {"shape": "[3, -4]"}, "not a list of positive ints"),
    (pa.binary(12), {"shape": "3x4"}, "not a tensor's"),
    (pa.binary(12), {"shape": "[4]", "dtype": "int32"}, "does not fill its type"),
    (pa.binary(12), {"shape": "[12]", "dtype": "no-such-type"}, "not a tensor's"),
    (pa.string(), {"shape": "[3]"}, "applies to a fixed-size binary or a fixed-size list"),
])
def test_a_shape_that_does_not_fit_is_a_source_error_naming_the_column(
    kind: pa.DataType, metadata: dict[str, str], says: str
) -> None:
    value = b"x" * 12 if pa.types.is_fixed_size_binary(kind) else "x"
    field = pa.field("image", kind, metadata=metadata)
    table = pa.Table.from_arrays([pa.array([value], kind)], schema=pa.schema([field]))
    with pytest.raises(SourceError, match=f"column 'image'.*{says}.*fix the field metadata"):
        shaped(table)
